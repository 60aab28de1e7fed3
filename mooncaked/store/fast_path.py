"""The master's fast path: StoreService's unary handlers served over framed TCP, or a Unix socket
for clients on the master's host (fast_wire.py).

Each request runs the very handler gRPC would run, with the same error mapping and a context
that turns `abort` into a status on the reply frame. A handler that answers at once (`.now`,
see service._now: nearly all of them) is answered inside `data_received`, no task scheduled,
which is a good part of a round trip's cost in Python; the rest (a get waiting for a
promotion) run as tasks, concurrently, and their replies go out as they finish.

With a cluster secret, a connection must first pass the handshake of
mooncaked.transfer.handshake: until then no byte is taken as a greeting or a frame. Every
connection is bounded as the transfer port's are (mooncaked.transfer.conn_guard): a cap, a
handshake deadline, an idle timeout, and a half-received frame dropped when it is not complete
within FAST_PATH_LIMITS.partial_timeout_s; a frame's size is checked from its header. A peer
that does not read its answers stops being read; one connection gets MAX_PER_TURN answers a turn
of the loop and MAX_RUNNING calls waiting at once (guarded_conn.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Awaitable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from mooncaked.store.errors import StoreError
from mooncaked.store.fencing import Gate
from mooncaked.store.fast_wire import HELLO, METHODS, REQUEST, FrameError, frame_bytes, pack_reply, read_frames
from mooncaked.store.guarded_conn import MAX_PER_TURN, GuardedConnection
from mooncaked.transfer.conn_guard import ConnLimits
from mooncaked.transfer.handshake import ANSWER_BYTES, check_token

logger = logging.getLogger(__name__)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
FAST_PATH_LIMITS = ConnLimits(max_connections=256, max_unproven=64, idle_timeout_s=300.0, partial_timeout_s=10.0)
"""One connection per store client is the usual; a frame is at most ~1 MB (fast_wire), so ten
seconds is plenty to finish one, and 256 half frames hold at most ~290 MB."""
MAX_RUNNING = 256  # calls of one connection waiting on something (a promotion, owners' acks): more wait to be read


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


class _Connection(GuardedConnection):
    what = "store fast-path"

    def __init__(self, server: FastPathServer) -> None:
        super().__init__(server)
        self._greeted = False
        self._tasks: set[asyncio.Task] = set()
        self._frames = 0  # frames taken: the watch's measure of progress

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for t in self._tasks:
            t.cancel()

    def _progress(self) -> int:
        return self._frames

    def _partial(self) -> bool:
        # frames waiting behind calls still running are not the peer's dawdling (the idle timeout holds)
        return (bool(self._buf) and "running" not in self._holds) or not self._greeted

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._greeted:  # the usual case
            self._take(data)
            return
        self._buf += data
        if self._handshake is not None:
            if len(self._buf) < ANSWER_BYTES or not self._prove():
                return
        if len(self._buf) < len(HELLO):
            return
        if bytes(self._buf[:len(HELLO)]) != HELLO:
            self._broken(FrameError(f"bad greeting {bytes(self._buf[:len(HELLO)])!r}"))
            return
        del self._buf[:len(HELLO)]
        self._greeted = True
        self._take(b"")

    bad_input = (FrameError,)

    def _broken(self, e: Exception) -> None:
        logger.warning("closing store fast-path connection from %s: %s", self._peer, e)
        self.close()  # answers to the frames before the bad one still go out

    def _serve(self, buf: bytes | bytearray) -> tuple[int, bool]:
        frames, used = read_frames(buf, REQUEST, MAX_PER_TURN)
        for i, f in enumerate(frames):
            if self._holds:  # the peer is behind on its answers, or has too many running: the rest wait
                return sum(frame_bytes(g) for g in frames[:i]), True
            self._frames += 1
            answer = self._server.answer(f.body[:f.tag].decode("ascii", "replace"), f.body[f.tag:], f.timeout_ms)
            if isinstance(answer, tuple):
                self._reply(f.call_id, answer)
            else:
                self._start(f.call_id, answer)
        return used, len(frames) == MAX_PER_TURN

    def _start(self, call_id: int, answer: Awaitable[tuple[int, bytes]]) -> None:
        task = asyncio.get_running_loop().create_task(self._serve_later(call_id, answer))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if len(self._tasks) >= MAX_RUNNING:
            self._hold("running")

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if len(self._tasks) < MAX_RUNNING:
            self._release("running")

    async def _serve_later(self, call_id: int, answer: Awaitable[tuple[int, bytes]]) -> None:
        self._reply(call_id, await answer)

    def _reply(self, call_id: int, answer: tuple[int, bytes]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(pack_reply(call_id, *answer))


class FastPathServer:
    """Serves a StoreService's unary methods on a plain TCP port, and for clients on this host on a
    Unix socket too (Linux abstract namespace: nothing to clean up; a round trip costs less there).

    `token`: the cluster secret each connection must prove first (None: no handshake);
    `limits`: the cap and timeouts of its connections."""

    def __init__(self, service: Any, token: bytes | None = None, limits: ConnLimits | None = None) -> None:
        self.service = service
        self.token = check_token(token)
        self.limits = limits or FAST_PATH_LIMITS
        self.unproven = 0  # connections still in the handshake
        self.connections: set[_Connection] = set()
        self._servers: list[asyncio.base_events.Server] = []
        self.port = 0
        self.unix_name = ""  # "@name" for the abstract socket "\0name"; "" when there is none
        self._routes: dict[str, tuple[Any, Any, Any]] = {}  # method name -> (request type, handler, .now)
        self._gate = getattr(service, "gate", None) or Gate()  # who may be served (one object for the process)

    async def start(self, host: str, port: int = 0, unix: bool = True) -> int:
        loop = asyncio.get_running_loop()
        # SO_REUSEADDR only (restart past TIME_WAIT); never SO_REUSEPORT: one port, one listener
        tcp = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, reuse_port=False,
                                       backlog=256)
        self._servers.append(tcp)
        self.port = tcp.sockets[0].getsockname()[1]
        if unix and sys.platform == "linux":
            name = f"mooncaked-store-{os.getpid()}-{self.port}-{uuid.uuid4().hex[:8]}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind("\0" + name)
                sock.listen(256)
                self._servers.append(await loop.create_unix_server(lambda: _Connection(self), sock=sock))
                self.unix_name = "@" + name
            except OSError as e:  # a sandbox without Unix sockets: TCP serves everyone
                sock.close()
                logger.info("store fast path: no Unix socket (%s); TCP only", e)
        return self.port

    def answer(self, name: str, body: bytes, timeout_ms: int) -> tuple[int, bytes] | Awaitable[tuple[int, bytes]]:
        """(gRPC status code value, reply bytes or error text) now, or an awaitable of it."""
        route = self._routes.get(name)
        if route is None:
            method = METHODS.get(name)
            if method is None:
                return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no unary StoreMaster method {name!r}".encode()
            handler = getattr(self.service, name)
            route = self._routes[name] = (method.request, handler, getattr(handler, "now", None))
        request_type, handler, now = route
        why = self._gate.refusal(name)  # a standby, or a fenced leader's write (fencing.py)
        if why is not None:
            return _UNAVAILABLE, why.encode()
        try:
            request = request_type.FromString(body)
        except Exception as e:  # noqa: BLE001 - any decode failure is the caller's
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"{name}: undecodable request: {e}".encode()
        context = FastContext(timeout_ms / 1000 if timeout_ms else None)
        if now is None:
            return self._finish(name, handler(request, context))
        try:
            reply = now(self.service, request, context)
        except Exception as e:  # noqa: BLE001 - mapped like the gRPC path maps it
            return _status_of(name, e)
        if isinstance(reply, Message):
            return 0, reply.SerializeToString()
        return self._finish(name, reply)

    @staticmethod
    async def _finish(name: str, pending: Awaitable[Message]) -> tuple[int, bytes]:
        try:
            reply = await pending
        except Exception as e:  # noqa: BLE001 - mapped like the gRPC path maps it
            return _status_of(name, e)
        return 0, reply.SerializeToString()

    async def close(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        for conn in list(self.connections):
            conn.close()
        for server in servers:
            await server.wait_closed()


def _status_of(name: str, e: Exception) -> tuple[int, bytes]:
    """A failed call's status: the store's typed errors and aborts as they are, anything else a bug."""
    if isinstance(e, StoreError):
        return e.code.value[0], str(e).encode("utf-8", "replace")
    if isinstance(e, AbortError):
        return e.code.value[0], e.details.encode("utf-8", "replace")
    logger.error("store fast path: %s failed", name, exc_info=e)
    return grpc.StatusCode.INTERNAL.value[0], f"store master bug in {name}: {e!r}".encode()
