"""Limits on the HTTP front's connections and bodies, so no client can hold the conductor.

Without them a client that sent half a request head was held forever (20,100 of them used up
the conductor's file descriptors) and a body of any size was read. Here:

- a request head must arrive within ``header_timeout_s`` of connecting or of its first byte,
  else the connection is dropped (aiohttp has no such timeout; ``_GuardedHandler`` adds it);
- a body must arrive within ``body_timeout_s`` (408) and be at most ``max_request_bytes`` (413,
  refused from Content-Length before reading when it says so);
- an idle keep-alive connection closes after ``idle_timeout_s`` (aiohttp's keepalive timeout);
- at most ``max_connections`` are open: one more is answered 503 and closed at once, so its
  descriptor is back before the next accept; the open-files limit is raised to fit the cap.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from yarl import URL

from mooncaked.conductor.openai_schema import ApiError

log = logging.getLogger(__name__)

FD_RESERVE = 1024  # descriptors kept for gRPC channels, the engines' streams, files, logs
CLOSE_AFTER = "mooncaked.close_after"  # request key: answer, then close the connection
LINGER_S = 5.0  # after an early answer (413), read and drop the rest of a body this long, so the
# client sees the answer instead of a reset


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP front's limits (the conductor's --max-request-bytes and --http-* settings)."""

    max_request_bytes: int = 4 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    max_connections: int = 4096

    @classmethod
    def from_config(cls, cfg: Any) -> HttpLimits:
        return cls(cfg.max_request_bytes, cfg.http_header_timeout_s, cfg.http_body_timeout_s,
                   cfg.http_idle_timeout_s, cfg.http_max_connections)


def too_large(limits: HttpLimits, size: int | None = None) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body is larger{got} than this server takes: {limits.max_request_bytes} "
                         "bytes (the conductor's --max-request-bytes)", "invalid_request_error", None,
                    "request_too_large")


async def read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The whole (decompressed) body, within the size and time limits; a body that is cut off or
    whose Content-Encoding does not decode is a 400, never a 500."""
    declared = request.content_length
    if declared is not None and declared > limits.max_request_bytes:
        raise too_large(limits, declared)  # refused before reading a byte of it
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()  # aiohttp stops at client_max_size (= max_request_bytes)
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limits) from None
    except TimeoutError:
        request[CLOSE_AFTER] = True  # a client this slow gets no more of this connection, nor a lingering read
        request.content.feed_eof()
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s (the "
                            "conductor's --http-body-timeout-s)", "invalid_request_error", None,
                       "request_timeout") from None
    except web.HTTPException:
        raise
    except (RequestPayloadError, HttpProcessingError, ValueError, OSError, EOFError) as e:  # cut off, bad encoding
        # the rest of this body cannot be parsed: answer, then close the connection (no lingering read)
        request[CLOSE_AFTER] = True
        request.content.feed_eof()
        encoding = request.headers.get("Content-Encoding")
        how = f"Content-Encoding {encoding!r}" if encoding else "the body"
        reason = getattr(e, "message", None) or str(e) or type(e).__name__
        reason = " ".join(reason.rpartition("message:")[2].split())  # aiohttp's "400, message:\n  ..."
        raise ApiError(400, f"could not read the request body ({how}): {reason}") from None


def closes_connection(request: web.Request) -> bool:
    """Whether the answer to ``request`` must close its connection (its body is unreadable)."""
    return bool(request.get(CLOSE_AFTER))


class _Connections:
    """How many guarded connections of one site are open."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = 0


class _GuardedHandler(RequestHandler):
    """aiohttp's handler plus a deadline for each request head (and the connection count)."""

    __slots__ = ("_head_timeout_s", "_head_timer", "_count", "_counted")

    def __init__(self, manager: web.Server, *, head_timeout_s: float, count: _Connections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._count = count
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._count.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is dropped as one that sends half a head

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._count.open -= 1
            self._counted = False
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._head_timer is None and self._awaiting_head():
            self._arm()
        super().data_received(data)
        if self._messages:  # a whole head was parsed: the request is the handler's now
            self._disarm()

    def _awaiting_head(self) -> bool:
        return not self._request_in_progress and not self._messages

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self.transport is not None and self._awaiting_head():
            log.debug("dropping %s: no whole request head within %ss", self.peername, self._head_timeout_s)
            self.force_close()


_BUSY_BODY = (b'{"error": {"message": "too many open connections to this server; retry shortly", '
              b'"type": "server_error", "param": null, "code": "too_many_connections"}}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Retry-After: 1\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Refused(asyncio.Protocol):
    """A connection over the cap: told so and closed, its descriptor freed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's transports are not asyncio's classes
        writer.write(_BUSY)
        writer.close()


def fit_open_files(max_connections: int) -> int:
    """Raise the open-files soft limit to hold ``max_connections`` plus a reserve; returns the
    connection cap that fits (lower, with a warning, when the hard limit is too low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit to %d: %s", new, e)
    if soft != resource.RLIM_INFINITY and soft < want:
        fitted = max(1, soft - FD_RESERVE) if soft > 2 * FD_RESERVE else max(1, soft // 2)
        log.warning("the open-files limit is %d: at most %d HTTP connections (not %d); raise LimitNOFILE to "
                    "allow more", soft, fitted, max_connections)
        return fitted
    return max_connections


class GuardedSite(web.BaseSite):
    """A TCP site (as aiohttp's ``TCPSite``) whose connections keep ``HttpLimits``."""

    __slots__ = ("_host", "_port", "_bound_port", "_limits", "_cap", "_count", "_handler_kwargs")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits, *,
                 ssl_context: SSLContext | None = None, **handler_kwargs: Any) -> None:
        """``handler_kwargs`` go to each connection's aiohttp handler (as a runner's would)."""
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._bound_port = host, port, port
        self._limits = limits
        self._cap = fit_open_files(limits.max_connections)
        self._count = _Connections()
        self._handler_kwargs = {"keepalive_timeout": limits.idle_timeout_s, "lingering_time": LINGER_S,
                                **handler_kwargs}

    @property
    def name(self) -> str:
        return str(URL.build(scheme="https" if self._ssl_context else "http", host=self._host, port=self._bound_port))

    @property
    def port(self) -> int:
        return self._bound_port

    @property
    def open_connections(self) -> int:
        return self._count.open

    def _protocol(self) -> asyncio.Protocol:
        if self._count.open >= self._cap:
            return _Refused()
        server = self._runner.server
        assert server is not None
        return _GuardedHandler(server, loop=asyncio.get_running_loop(), head_timeout_s=self._limits.header_timeout_s,
                               count=self._count, **self._handler_kwargs)

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self._limits.header_timeout_s if self._ssl_context else None)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
