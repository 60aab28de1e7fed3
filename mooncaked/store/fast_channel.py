"""The client end of the master's fast path: one multiplexed connection, calls matched by id.

A call that times out gives up its id (a late reply is dropped); a lost connection fails
every call waiting on it with StoreUnavailable, and the owner opens a new channel. With the
cluster secret the connection proves it (mooncaked.transfer.handshake) before its greeting;
a channel idle for a while closes itself before the master's idle timeout could cut it.

Following a leader (store masters under HA, master_link.py), a channel is given the link: a
call whose master is gone (the connection broke) or answers that it is not the leader (or not
sure of its lease) closes the channel and goes on by gRPC through the link, which finds the
leader and tries again within the call's deadline; the owner's next call opens a fast path
to the new leader. A call that gets no answer at all makes the link ask who leads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from mooncaked.store.errors import StoreUnavailable, from_rpc_error, from_status
from mooncaked.store.fast_wire import (
    HELLO,
    MAX_REQUEST_BYTES,
    METHODS,
    REPLY,
    FrameError,
    RequestTooBig,
    pack_request,
    read_frames,
)
from mooncaked.transfer.api import TransferError
from mooncaked.transfer.conn_guard import CLIENT_IDLE_CLOSE_S
from mooncaked.transfer.handshake import AUTH_MAGIC, HANDSHAKE_TIMEOUT_S, authenticated, open_socket

logger = logging.getLogger(__name__)
BOUND_TO_ONE_MASTER = frozenset({"PutEnd", "BatchPutEnd", "PutRevoke", "TaskDone"})  # as master_link's
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class Redirect(Protocol):
    """Where a call goes when this channel's master no longer serves it (a `MasterLink`)."""

    async def call(self, name: str, request: Any, timeout: float | None = None, raw: bool = False) -> Any: ...

    def suspect(self) -> None: ...


class _Protocol(asyncio.Protocol):
    def __init__(self, channel: FastChannel) -> None:
        self._channel = channel
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            frames, used = read_frames(self._buf, REPLY)
        except FrameError as e:
            if self._buf.startswith(AUTH_MAGIC):
                self._channel.fail("the master requires the cluster secret (it opened with the handshake): "
                                   "give this client the cluster token file")
            else:
                self._channel.fail(f"the master broke the fast-path protocol: {e}")
            return
        for f in frames:
            self._channel.resolve(f.call_id, f.tag, f.body)
        del self._buf[:used]

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel.fail(f"connection lost ({exc or 'closed by the master'})")


class FastChannel:
    """Calls StoreMaster's unary methods over the fast path; `await FastChannel.connect(...)`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self._calls = 0  # calls written: the idle check compares it between its ticks
        self._idle_mark = -1
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_s = CLIENT_IDLE_CLOSE_S
        self._link: Redirect | None = None  # following a leader: where failed calls go on
        self._by_owner = False  # closed by its owner: nothing goes on elsewhere
        self._on_lost: Callable[[], None] | None = None

    @classmethod
    async def connect(cls, host: str, port: int, timeout_s: float, unix: str = "",
                      token: bytes | None = None, idle_s: float = CLIENT_IDLE_CLOSE_S,
                      link: Redirect | None = None, on_lost: Callable[[], None] | None = None) -> FastChannel:
        """To the master's fast path at host:port, or at the Unix socket `unix` ("@name": abstract);
        with `token` (the cluster secret) the master and we prove it to each other first. Idle for
        `idle_s` (within twice that), the channel closes itself; the owner opens another. With
        `link` (a leader followed), calls the master no longer serves go on through it.
        `on_lost()` runs when the master is lost to us (the connection broke, or it no longer leads),
        not when the owner or the idle timer closes the channel: what the owner holds from that
        master (places reserved in segments) must not be used once another master may allocate."""
        channel = cls(f"unix:{unix}" if unix else f"{host}:{port}")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                if unix:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, "\0" + unix[1:] if unix.startswith("@") else unix)
                    except BaseException:
                        sock.close()
                        raise
                elif token is not None:
                    sock = await open_socket(host, port)
                if token is not None:
                    sock = await authenticated(sock, token, f"the store master's fast path at {channel.address}",
                                               HANDSHAKE_TIMEOUT_S)
                if unix:
                    transport, _ = await loop.create_unix_connection(lambda: _Protocol(channel), sock=sock)
                elif token is not None:
                    transport, _ = await loop.create_connection(lambda: _Protocol(channel), sock=sock)
                else:
                    transport, _ = await loop.create_connection(lambda: _Protocol(channel), host, port)
        except TransferError as e:  # the handshake failed: the message says how
            raise StoreUnavailable(str(e)) from None
        except (OSError, TimeoutError) as e:
            raise StoreUnavailable(f"cannot reach the store master's fast path at {channel.address}: {e}") from None
        channel._transport = transport  # type: ignore[assignment]
        channel._loop = loop
        channel._link = link
        channel._on_lost = on_lost
        transport.write(HELLO)
        channel._idle_s = idle_s
        channel._idle_timer = loop.call_later(idle_s, channel._check_idle)
        return channel

    def _check_idle(self) -> None:
        """Close the channel if no call went out since the last tick and none is waiting (the
        owner opens a new one for the next call)."""
        self._idle_timer = None
        if self.closed:
            return
        if not self._pending and self._calls == self._idle_mark:
            self._on_lost = None  # nothing was lost
            self.fail(f"closed after {self._idle_s:g}s or more without a call")
            return
        self._idle_mark = self._calls
        assert self._loop is not None
        self._idle_timer = self._loop.call_later(self._idle_s, self._check_idle)

    async def call(self, method: str, request: Message, timeout_s: float) -> Message:
        """The reply, or the typed StoreError the master answered (or StoreUnavailable).

        One coroutine from the write to the decoded reply: this is every single put's and get's
        metadata call, and each await layer between costs."""
        return METHODS[method].reply.FromString(await self._exchange(method, request.SerializeToString(), timeout_s))

    def send(self, method: str, request: Message, timeout_s: float) -> Coroutine[Any, Any, Message]:
        """Put the call on the wire now; await what this returns for the reply (work can go on meanwhile)."""
        return self._decoded(METHODS[method].reply, self.send_raw(method, request.SerializeToString(), timeout_s))

    async def call_raw(self, method: str, body: bytes, timeout_s: float) -> bytes:
        """Any method name and body, as they are (tests speak bad requests with it)."""
        return await self.send_raw(method, body, timeout_s)

    def send_raw(self, method: str, body: bytes, timeout_s: float) -> Coroutine[Any, Any, bytes]:
        call_id, fut, timer = self._write(method, body, timeout_s)
        return self._reply(call_id, fut, timer, method, body)

    async def _exchange(self, method: str, body: bytes, timeout_s: float) -> bytes:
        call_id, fut, timer = self._write(method, body, timeout_s)
        return await self._reply(call_id, fut, timer, method, body)

    def _write(self, method: str, body: bytes,
               timeout_s: float) -> tuple[int, asyncio.Future[tuple[int, bytes]], asyncio.TimerHandle]:
        if self.closed or self._transport is None:
            raise StoreUnavailable(f"store master fast path {self.address} is closed")
        if len(body) + len(method) > MAX_REQUEST_BYTES:
            raise RequestTooBig(f"{method}: a request of {len(body)} bytes is over the fast path's "
                                f"{MAX_REQUEST_BYTES}-byte limit")
        call_id = self._calls = next(self._ids) & 0xFFFFFFFF
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self._pending[call_id] = fut
        # one timer per call, not asyncio.timeout: its context machinery costs more than the call itself here
        timer = loop.call_at(loop.time() + timeout_s, self._expire, call_id, method, timeout_s)
        self._transport.write(pack_request(call_id, method, int(timeout_s * 1000), body))
        return call_id, fut, timer

    async def _reply(self, call_id: int, fut: asyncio.Future[tuple[int, bytes]], timer: asyncio.TimerHandle,
                     method: str, request: bytes = b"") -> bytes:
        try:
            status, body = await fut
        except StoreUnavailable:
            if self._link is None or self._by_owner or not self.closed:  # not a lost connection
                raise
            return await self._redirect(method, request, timer.when())  # its master went
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)
        if status:
            if status == _UNAVAILABLE and self._link is not None:  # a standby, or a leader unsure of its lease
                self.fail(f"the master answered {method} UNAVAILABLE ({body[:160].decode('utf-8', 'replace')})")
                return await self._redirect(method, request, timer.when())
            raise from_status(status, body.decode("utf-8", "replace"), method)
        return body

    async def _redirect(self, method: str, request: bytes, deadline: float) -> bytes:
        """The call, by gRPC through the link (which finds the leader), within what is left of its time."""
        assert self._link is not None and self._loop is not None
        if method in BOUND_TO_ONE_MASTER:  # it names what this master made: meaningless to another
            raise StoreUnavailable(f"store master {method}: the master lost before it answered (a new leader "
                                   "knows nothing of what it refers to; start over)")
        left = deadline - self._loop.time()
        if left <= 0:
            raise StoreUnavailable(f"store master {method}: no time left to find the leader")
        try:
            return await self._link.call(method, request, left, raw=True)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, method) from None

    @staticmethod
    async def _decoded(reply_type: type[Message], raw: Coroutine[Any, Any, bytes]) -> Message:
        return reply_type.FromString(await raw)

    def _expire(self, call_id: int, method: str, timeout_s: float) -> None:
        fut = self._pending.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(StoreUnavailable(f"store master {method}: no answer within {timeout_s}s "
                                               f"on the fast path {self.address}"))
            if self._link is not None:  # a master that says nothing may be frozen: who leads now?
                self._link.suspect()

    def resolve(self, call_id: int, status: int, body: bytes) -> None:
        fut = self._pending.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_result((status, body))

    def fail(self, why: str) -> None:
        """Close and fail every waiting call (the owner reconnects for the next one)."""
        if self.closed:
            return
        self.closed = True
        logger.info("store fast path %s: %s", self.address, why)
        if self._on_lost is not None and not self._by_owner:
            self._on_lost()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._transport is not None:
            self._transport.abort()
        err = StoreUnavailable(f"store master fast path {self.address}: {why}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    def close(self) -> None:
        self._by_owner = True
        self.fail("closed by the client")
