"""The initiator side of the tcp backend: one pipelined connection.

Requests go out back to back; responses come back in order. Write payloads
are handed to the transport as memoryview slices of the source region; read
payloads are received straight into the destination slice by get_buffer.
Any timeout or stream error aborts the connection and fails what was queued
on it, so nothing is left half done. An idle connection retires itself
(`idle_s`, see conn_guard.ConnLimits.client_idle_s): the pool hands it out no more and opens a
fresh one when needed, and it closes once idle for another period. So the
server's longer idle timeout never cuts a connection a request is put on.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from mooncaked.transfer.api import (
    PeerUnavailableError,
    ProtocolError,
    TransferError,
    TransferTimeoutError,
)
from mooncaked.transfer.ratelimit import CHUNK_BYTES, TokenBucket
from mooncaked.transfer.wire import (
    MAX_ERROR_BYTES,
    MAX_INFO_BYTES,
    RESP,
    Op,
    Status,
    error_from_status,
    pack_request,
    unpack_response,
)

logger = logging.getLogger(__name__)

WRITE_BUFFER_HIGH = 4 * 1024 * 1024
COALESCE_BYTES = 256 * 1024  # small requests are gathered into one writev up to this
COALESCE_BUFS = 512  # ...or this many buffers (IOV_MAX is 1024)
_HEADER, _BODY, _CLOSED = range(3)


@dataclass(slots=True)
class WireOp:
    """One request ready for the wire: payload for writes, dest for reads."""

    op: Op
    name: bytes
    offset: int
    length: int
    payload: memoryview | None = None
    dest: memoryview | None = None


@dataclass(slots=True)
class _Pending:
    req_id: int
    op: Op
    length: int
    dest: memoryview | None
    future: asyncio.Future[bytes | None]
    timeout_s: float
    deadline: float  # loop time by which its answer must be in


class ClientConnection(asyncio.BufferedProtocol):
    """One outgoing connection; send() pipelines requests, answers resolve futures.

    Deadlines: an op must be answered within timeout_s of being sent, and of
    the op before it being answered, so a long pipeline is not cut short
    while it moves but a stalled peer is noticed within timeout_s. One timer
    per connection watches only the oldest unanswered op (answers come in
    order), so the hot path sets no timer per op.
    """

    def __init__(self, peer: str, limiter: TokenBucket | None, on_closed: Callable[[ClientConnection], None],
                 idle_s: float) -> None:
        self.peer = peer
        self._idle_s = idle_s
        self.outstanding_bytes = 0  # payload bytes sent or queued and not yet answered
        self._loop = asyncio.get_running_loop()
        self._limiter = limiter
        self._on_closed = on_closed
        self._transport: asyncio.Transport | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._hdr = bytearray(RESP.size)
        self._state = _HEADER
        self._target: memoryview | bytearray = memoryview(self._hdr)
        self._filled = 0
        self._status = Status.OK
        self._body: bytearray | None = None
        self._error: TransferError | None = None
        self._last_req = 0  # the latest request id: the idle check compares it between its ticks
        self._idle_mark = -1
        self._idle_timer: asyncio.TimerHandle | None = None
        self.retired = False  # idle for a while: the pool no longer hands it out

    @property
    def closed(self) -> bool:
        return self._state == _CLOSED

    @property
    def gone(self) -> bool:
        """Not to be handed out again: closed, or retired for being idle."""
        return self.retired or self._state == _CLOSED

    # -- asyncio callbacks -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._idle_timer = self._loop.call_later(self._idle_s, self._check_idle)

    def _check_idle(self) -> None:
        """Idle since the last tick (no request sent, none waiting): retire it, and if it was
        retired already, close it (whoever took it from the pool before it retired has used
        it by now, or that use would have shown as activity)."""
        self._idle_timer = None
        if self.closed:
            return
        if not self._pending and not self._send_lock.locked() and self._last_req == self._idle_mark:
            if self.retired:
                logger.debug("closing idle transfer connection to %s", self.peer)
                self.abort(PeerUnavailableError(f"connection to {self.peer} closed after being idle"))
                return
            self.retired = True
        self._idle_mark = self._last_req
        self._idle_timer = self._loop.call_later(self._idle_s, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = self._error or PeerUnavailableError(
            f"connection to transfer peer {self.peer} was lost ({exc or 'closed by peer'}); "
            "the peer may have stopped; retry once it is back"
        )
        self._shut(reason)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _CLOSED:
            return memoryview(bytearray(65536))
        return memoryview(self._target)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _CLOSED:
            return
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        try:
            if self._state == _HEADER:
                self._on_header()
            else:
                self._complete()
        except ProtocolError as e:
            logger.warning("closing transfer connection to %s: %s", self.peer, e)
            self.abort(PeerUnavailableError(f"peer {self.peer} broke the protocol: {e}"))

    # -- response parsing --------------------------------------------------
    def _on_header(self) -> None:
        status, req_id, body_len = unpack_response(self._hdr)
        if not self._pending:
            raise ProtocolError(f"response {req_id} with no request outstanding")
        head = self._pending[0]
        if head.req_id != req_id:
            raise ProtocolError(f"response {req_id} out of order (expected {head.req_id})")
        self._status = status
        self._body = None
        if status != Status.OK:
            if body_len > MAX_ERROR_BYTES:
                raise ProtocolError(f"error message of {body_len} bytes")
            self._body = bytearray(body_len)
            target: memoryview | bytearray = self._body
        elif head.op == Op.READ:
            if body_len != head.length or head.dest is None:
                raise ProtocolError(f"read answered with {body_len} bytes, asked {head.length}")
            target = head.dest
        elif head.op == Op.INFO:
            if body_len > MAX_INFO_BYTES:
                raise ProtocolError(f"info of {body_len} bytes")
            self._body = bytearray(body_len)
            target = self._body
        elif body_len:
            raise ProtocolError(f"write ack with {body_len} body bytes")
        else:
            target = self._hdr
        if body_len == 0:
            self._complete()
        else:
            self._state, self._target, self._filled = _BODY, target, 0

    def _complete(self) -> None:
        head = self._pending.popleft()
        self.outstanding_bytes -= head.length
        if self._pending:
            nxt = self._pending[0]
            nxt.deadline = max(nxt.deadline, self._loop.time() + nxt.timeout_s)
        if not head.future.done():
            if self._status == Status.OK:
                head.future.set_result(bytes(self._body) if head.op == Op.INFO and self._body else None)
            else:
                message = (self._body or b"").decode("utf-8", "replace")
                head.future.set_exception(error_from_status(self._status, message, self.peer))
        self._state, self._target, self._filled = _HEADER, memoryview(self._hdr), 0

    # -- deadlines -----------------------------------------------------------
    def _arm(self) -> None:
        if self._timer is None and self._pending:
            self._timer = self._loop.call_at(self._pending[0].deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if self.closed or not self._pending:
            return
        head = self._pending[0]
        if head.deadline <= self._loop.time():
            self.abort(
                TransferTimeoutError(
                    f"transfer peer {self.peer} did not complete an op within the {head.timeout_s}s "
                    "deadline; the peer is stalled or the link too slow for it (raise timeout_s)"
                )
            )
        else:
            self._arm()

    # -- sending -----------------------------------------------------------
    async def send(
        self, ops: list[WireOp], timeout_s: float, futures: list[asyncio.Future[bytes | None]]
    ) -> None:
        """Pipeline ops on this connection; appends one future per op to `futures`.

        Small requests are coalesced into one writelines (one writev); big
        payloads are handed over as the region's own memoryview. Never
        raises for a broken connection: the affected futures carry the error.
        If cancelled, `futures` tells the caller whether anything went out.
        """
        async with self._send_lock:
            try:
                await self._send_locked(ops, timeout_s, futures)
            except TransferError as e:
                for _ in range(len(ops) - len(futures)):
                    failed: asyncio.Future[bytes | None] = self._loop.create_future()
                    failed.set_exception(e)
                    futures.append(failed)

    def send_now(self, op: WireOp, timeout_s: float) -> asyncio.Future[bytes | None] | None:
        """Hand one op to the transport without awaiting anything; its future.

        The single-op path (one put/get): no lock, no coroutine. None when it
        must queue behind another sender (one holds the send lock, or the
        transport is over its high-water mark) or be paced: use send() then.
        Raises TransferError if the connection is closed.
        """
        if self._send_lock.locked() or self._limiter is not None or not self._can_write.is_set():
            return None
        transport = self._writable()
        future, header = self._enqueue(op, timeout_s)
        if op.payload is not None and op.length:
            transport.writelines((header, op.payload))
        else:
            transport.write(header)
        return future

    def _writable(self) -> asyncio.Transport:
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise self._error or PeerUnavailableError(f"connection to {self.peer} is closed")
        return transport

    def _enqueue(self, op: WireOp, timeout_s: float) -> tuple[asyncio.Future[bytes | None], bytes]:
        """Book an op as sent (its deadline starts now); its future and request header."""
        future: asyncio.Future[bytes | None] = self._loop.create_future()
        req_id = self._last_req = next(self._ids)
        deadline = self._loop.time() + timeout_s
        self._pending.append(_Pending(req_id, op.op, op.length, op.dest, future, timeout_s, deadline))
        self.outstanding_bytes += op.length
        if self._timer is None:
            self._arm()
        return future, pack_request(op.op, req_id, op.name, op.offset, op.length)

    async def _send_locked(
        self, ops: list[WireOp], timeout_s: float, futures: list[asyncio.Future[bytes | None]]
    ) -> None:
        transport = self._writable()
        bufs: list[bytes | memoryview] = []
        queued = 0
        for op in ops:
            future, header = self._enqueue(op, timeout_s)
            futures.append(future)
            bufs.append(header)
            payload = op.payload if op.length else None
            if payload is not None and self._limiter is not None:
                transport.writelines(bufs)
                bufs = []
                await self._paced(transport, payload, self._limiter)
                continue
            if payload is not None:
                bufs.append(payload)
                queued += op.length
            if queued >= COALESCE_BYTES or len(bufs) >= COALESCE_BUFS:
                transport.writelines(bufs)
                bufs, queued = [], 0
                await self._drain()
        if bufs:
            transport.writelines(bufs)
        await self._drain()

    async def _paced(self, transport: asyncio.Transport, payload: memoryview, limiter: TokenBucket) -> None:
        for start in range(0, len(payload), CHUNK_BYTES):
            chunk = payload[start : start + CHUNK_BYTES]
            await limiter.take(len(chunk))
            await self._drain()
            transport.write(chunk)

    async def _drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()
        if self.closed:
            raise self._error or PeerUnavailableError(f"connection to {self.peer} is closed")

    def abort(self, reason: TransferError) -> None:
        """Drop the connection now and fail everything queued on it with reason."""
        self._error = self._error or reason
        if self._transport is not None:
            self._transport.abort()
        self._shut(reason)

    def _shut(self, reason: TransferError) -> None:
        if self._state == _CLOSED:
            return
        self._state = _CLOSED
        self._error = self._error or reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._can_write.set()  # wake senders so they see the error
        self.outstanding_bytes = 0
        while self._pending:
            p = self._pending.popleft()
            if not p.future.done():
                p.future.set_exception(self._error)
        self._on_closed(self)


def stripe(lengths: list[int], load: list[int]) -> list[list[int]]:
    """Op indices per lane (one lane per entry of ``load``, the bytes each already carries): biggest
    first onto the least loaded, each lane in submission order. Shared by the asyncio pool and the I/O
    process's blocking lanes, so both split a batch alike."""
    load = list(load)
    lanes: list[list[int]] = [[] for _ in load]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = load.index(min(load))
        load[k] += lengths[i]
        lanes[k].append(i)
    for lane in lanes:
        lane.sort()
    return lanes
