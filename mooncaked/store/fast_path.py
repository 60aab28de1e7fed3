"""The master's fast path: StoreService's unary handlers served over framed TCP (fast_wire.py).

Each request runs the very handler gRPC would run (same `_rpc` error mapping), with a
context that turns `abort` into a status on the reply frame. Requests of one connection
run concurrently (a get may wait for a promotion) and their replies go out as they finish.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, NoReturn

import grpc

from mooncaked.store.fast_wire import HELLO, METHODS, REQUEST, FrameError, pack_reply, read_frames

logger = logging.getLogger(__name__)


class AbortError(Exception):
    """What `context.abort` raises on the fast path (the service's wrapper lets it through by this name)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FastContext:
    """The part of grpc.aio.ServicerContext the store's handlers use."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise AbortError(code, details)


class _Connection(asyncio.Protocol):
    def __init__(self, server: FastPathServer) -> None:
        self._server = server
        self._buf = bytearray()
        self._greeted = False
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._tasks: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername") or ("?", "?")
        self._peer = f"{peer[0]}:{peer[1]}"
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for t in self._tasks:
            t.cancel()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            if not self._greeted:
                if len(self._buf) < len(HELLO):
                    return
                if bytes(self._buf[:len(HELLO)]) != HELLO:
                    raise FrameError(f"bad greeting {bytes(self._buf[:len(HELLO)])!r}")
                del self._buf[:len(HELLO)]
                self._greeted = True
            frames, used = read_frames(self._buf, REQUEST)
            for f in frames:
                name = bytes(f.body[:f.tag]).decode("ascii", "replace")
                self._start(f.call_id, name, f.body[f.tag:], f.timeout_ms)
            del self._buf[:used]
        except FrameError as e:
            logger.warning("closing store fast-path connection from %s: %s", self._peer, e)
            self.close()

    def _start(self, call_id: int, name: str, body: bytes, timeout_ms: int) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(call_id, name, body, timeout_ms))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, call_id: int, name: str, body: bytes, timeout_ms: int) -> None:
        status, out = await self._server.handle(name, body, timeout_ms)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(pack_reply(call_id, status, out))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class FastPathServer:
    """Serves a StoreService's unary methods on a plain TCP port."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.get_running_loop().create_server(lambda: _Connection(self), host, port,
                                                                      reuse_address=True, backlog=256)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def handle(self, name: str, body: bytes, timeout_ms: int) -> tuple[int, bytes]:
        """Run one call; (gRPC status code value, reply bytes or error text)."""
        method = METHODS.get(name)
        if method is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no unary StoreMaster method {name!r}".encode()
        try:
            request = method.request.FromString(body)
        except Exception as e:  # noqa: BLE001 - any decode failure is the caller's
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"{name}: undecodable request: {e}".encode()
        context = FastContext(timeout_ms / 1000 if timeout_ms else None)
        try:
            reply = await getattr(self.service, name)(request, context)
        except AbortError as e:
            return e.code.value[0], e.details.encode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - a handler outside the service's error mapping; keep serving
            logger.exception("store fast path: %s failed", name)
            return grpc.StatusCode.INTERNAL.value[0], f"store master bug in {name}: {e!r}".encode()
        return 0, reply.SerializeToString()

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.close()
        await self._server.wait_closed()
        self._server = None
