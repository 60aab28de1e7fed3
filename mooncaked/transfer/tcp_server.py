"""The target side of the tcp backend: serve writes, reads and info requests.

Each connection is a BufferedProtocol whose get_buffer hands the event loop
either a small header buffer or, for a write's payload, the memoryview slice
of the destination region itself, so the kernel's recv lands the bytes in
place. Read payloads go out as memoryview slices of the source region
(writelines, no copy on uvloop). Anything that is not our protocol closes
that one connection with a logged reason; the server keeps serving others.

With a cluster secret, a connection starts in the handshake (handshake.py):
get_buffer hands out exactly the answer's bytes, so no byte of a request is
even read before the peer proved the secret. Every connection is bounded by
conn_guard: a cap per server, and a timer that drops one that stalls or idles.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable
from typing import cast

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerInfo, ProtocolError, TransferError
from mooncaked.transfer.conn_guard import ConnLimits, ConnWatch, admit, close_within
from mooncaked.transfer.handshake import ANSWER_BYTES, HandshakeError, ServerHandshake
from mooncaked.transfer.ratelimit import CHUNK_BYTES, TokenBucket
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.wire import (
    MAGIC,
    REQ,
    Op,
    Request,
    Status,
    encode_info,
    error_status,
    pack_response,
    unpack_request,
)

logger = logging.getLogger(__name__)

WRITE_BUFFER_HIGH = 4 * 1024 * 1024
DISCARD_CHUNK = 1024 * 1024
ANSWER_NOW_BYTES = 64 * 1024
"""The first answer of a loop turn leaves at once if its op moved at least
this many payload bytes: a lone put/get is then acked without waiting for
the loop to come round (measured ~10-20 us less per 512 KiB op). Answers
after it in the same turn still gather into one writelines, so pipelined
batches keep one wakeup of the initiator per turn (acking every big op at
once cost 64-256 KiB batches 15-30% of their throughput on loopback)."""
_HEADER, _PAYLOAD, _DISCARD, _CLOSED, _AUTH = range(5)


class ServerConnection(asyncio.BufferedProtocol):
    """One incoming connection: parse requests in order, answer in order.

    Answers produced in one loop iteration leave in one writelines (acks of
    small writes would otherwise cost a syscall each), except that the
    first one leaves at once when its op was big (see ANSWER_NOW_BYTES).
    """

    def __init__(self, server: TcpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._hdr = bytearray(REQ.size)
        self._hdr_view = memoryview(self._hdr)
        self._scratch: bytearray | None = None  # only when a bad write must be drained
        self._state = _HEADER
        self._lost = False  # connection_lost came
        self._target: memoryview = self._hdr_view
        self._filled = 0
        self._req: Request | None = None
        self._error: TransferError | None = None
        self._discard_left = 0
        self.ops_served = 0
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        # paced sending (rate limit) goes through a queue and one sender task
        self._outq: collections.deque[tuple[bytes, memoryview | bytes | None]] = collections.deque()
        self._out_ready = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._sender: asyncio.Task[None] | None = None
        self._rx = 0  # bytes received: the watch's measure of progress
        self._handshake: ServerHandshake | None = None  # while the peer has not proven the secret
        self._watch: ConnWatch | None = None

    # -- asyncio callbacks -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host, port = (transport.get_extra_info("peername") or ("?", "?"))[:2]
        self._peer = f"{host}:{port}"
        server = self._server
        token = server.token
        refused = admit(server.limits, len(server.connections), server.unproven, token is not None)
        if refused is not None:
            logger.warning("refused transfer connection from %s: %s", self._peer, refused)
            self._state = _CLOSED
            self._transport.abort()
            return
        self._transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        server.connections.add(self)
        if token is not None:
            self._handshake = ServerHandshake(token)
            server.unproven += 1
            self._state, self._target = _AUTH, memoryview(bytearray(ANSWER_BYTES))
            self._transport.write(self._handshake.challenge)
        self._watch = ConnWatch(server.limits, token is None, self._progress, self._partial, self._drop)
        if self._server.limiter is not None:
            self._sender = self._loop.create_task(self._send_paced())

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _CLOSED
        self._lost = True
        self._server.connections.discard(self)
        if self._handshake is not None:
            self._handshake = None
            self._server.unproven -= 1
        if self._watch is not None:
            self._watch.cancel()
        if self._sender is not None:
            self._sender.cancel()
        logger.debug("transfer connection from %s closed (%s)", self._peer, exc)

    def pause_writing(self) -> None:
        self._can_write.clear()
        if self._sender is None and self._transport is not None:
            self._transport.pause_reading()  # stop taking requests until answers drain

    def resume_writing(self) -> None:
        self._can_write.set()
        if self._sender is None and self._transport is not None:
            self._transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _DISCARD:
            assert self._scratch is not None
            return memoryview(self._scratch)[: min(self._discard_left, len(self._scratch))]
        if self._state == _CLOSED:
            self._scratch = self._scratch or bytearray(DISCARD_CHUNK)
            return memoryview(self._scratch)
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._rx += nbytes
        try:
            self._advance(nbytes)
        except ProtocolError as e:
            self._reject(str(e))

    # -- request parsing ---------------------------------------------------
    def _advance(self, nbytes: int) -> None:
        state = self._state
        if state == _HEADER:
            self._filled += nbytes
            if self._filled < REQ.size:
                if self._filled >= 4 and int.from_bytes(self._hdr[:4], "little") != MAGIC:
                    raise ProtocolError(f"bad magic {bytes(self._hdr[:4])!r}")
                return
            req = self._req = unpack_request(self._hdr)
            try:
                name = req.name.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError(f"region name is not UTF-8: {e}") from e
            self._dispatch(req, name)
        elif state == _PAYLOAD:
            self._filled += nbytes
            if self._filled < len(self._target):
                return
            done = self._req
            assert done is not None
            self.ops_served += 1
            metrics.count_op("tcp", "write", "target", True, received=done.length)
            self._respond(Status.OK, done.req_id, None, done.length)
            self._expect_header()
        elif state == _DISCARD:
            self._discard_left -= nbytes
            if self._discard_left == 0:
                assert self._req is not None and self._error is not None
                self._answer_error(self._req, self._error)
                self._error = None
                self._expect_header()
        elif state == _AUTH:
            self._filled += nbytes
            if self._filled == ANSWER_BYTES:
                self._prove()

    def _prove(self) -> None:
        """The peer's handshake answer is in: prove ourselves and serve, or close without a word."""
        assert self._handshake is not None and self._transport is not None and self._watch is not None
        try:
            proof = self._handshake.verify(self._target)
        except HandshakeError as e:
            logger.warning("refused transfer connection from %s: %s", self._peer, e)
            self._state = _CLOSED
            self._transport.abort()
            return
        self._handshake = None
        self._server.unproven -= 1
        self._watch.proven = True
        self._transport.write(proof)
        self._expect_header()

    def _progress(self) -> int:
        return self._rx

    def _partial(self) -> bool:
        """A request half received (its header, or a write's payload still coming in)."""
        return self._state in (_PAYLOAD, _DISCARD) or (self._state == _HEADER and self._filled > 0)

    def _expect_header(self) -> None:
        self._state, self._target, self._filled = _HEADER, self._hdr_view, 0

    def _dispatch(self, req: Request, name: str) -> None:
        if req.op == Op.INFO:
            self.ops_served += 1
            self._respond(Status.OK, req.req_id, encode_info(self._server.info()))
            self._expect_header()
            return
        try:
            region = self._server.regions.lookup(name, req.offset, req.length, where="remote")
        except TransferError as e:
            if req.op == Op.WRITE and req.length:
                self._error = e  # keep the stream in step: drain the payload, then answer
                self._discard_left = req.length
                self._scratch = self._scratch or bytearray(DISCARD_CHUNK)
                self._state = _DISCARD
            else:
                self._answer_error(req, e)
                self._expect_header()
            return
        if req.op == Op.WRITE:
            if req.length:
                self._state, self._target, self._filled = _PAYLOAD, region.slice_view(req.offset, req.length), 0
                return
            self.ops_served += 1
            self._respond(Status.OK, req.req_id, None)
        else:  # READ
            self.ops_served += 1
            metrics.count_op("tcp", "read", "target", True, sent=req.length)
            self._respond(Status.OK, req.req_id, region.slice_view(req.offset, req.length), req.length)
        self._expect_header()

    def _answer_error(self, req: Request, exc: TransferError) -> None:
        self.ops_served += 1
        metrics.count_op("tcp", req.op.name.lower(), "target", False)
        logger.info("refused %s from %s: %s", req.op.name.lower(), self._peer, exc)
        self._respond(error_status(exc), req.req_id, str(exc).encode()[: 64 * 1024])

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _drop(self, reason: str) -> None:
        """The watch's verdict: close now, whatever is queued (the peer may not be reading; closed
        already too, when it does not take the answers owed)."""
        if not self._lost:
            logger.warning("closing transfer connection from %s: %s", self._peer, reason)
            self.abort()

    def _reject(self, reason: str) -> None:
        if self._state == _CLOSED:
            return
        logger.warning("closing transfer connection from %s: %s", self._peer, reason)
        self._state = _CLOSED
        if self._transport is not None:
            self._flush()
            close_within(self._transport, lambda: self._drop("answers owed not taken after its close"))

    # -- responses ---------------------------------------------------------
    def _respond(self, status: Status, req_id: int, body: memoryview | bytes | None, moved: int = 0) -> None:
        """Queue an answer (in request order); `moved`: the op's payload bytes."""
        header = pack_response(status, req_id, len(body) if body is not None else 0)
        if self._sender is not None:
            self._outq.append((header, body))
            self._out_ready.set()
            return
        self._out.append(header)
        if body:
            self._out.append(body)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_scheduled_answers)
            if moved >= ANSWER_NOW_BYTES:
                self._flush()  # the loop turn's first answer; later ones wait for the flush

    def _flush_scheduled_answers(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        transport = self._transport
        if out and transport is not None and not transport.is_closing():
            transport.writelines(out)

    async def _send_paced(self) -> None:
        """Sender for a rate-limited engine: payloads go out chunk by chunk."""
        limiter = self._server.limiter
        assert limiter is not None and self._transport is not None
        transport = self._transport
        while True:
            while not self._outq:
                self._out_ready.clear()
                await self._out_ready.wait()
            header, body = self._outq.popleft()
            transport.write(header)
            if body:
                view = memoryview(body)
                for start in range(0, len(view), CHUNK_BYTES):
                    chunk = view[start : start + CHUNK_BYTES]
                    await limiter.take(len(chunk))
                    await self._can_write.wait()
                    if transport.is_closing():
                        return
                    transport.write(chunk)


class TcpServer:
    """Listens for peers and serves the regions of one engine."""

    def __init__(
        self,
        regions: RegionTable,
        info: Callable[[], PeerInfo],
        limiter: TokenBucket | None = None,
        token: bytes | None = None,
        limits: ConnLimits | None = None,
    ) -> None:
        self.regions = regions
        self.info = info  # what INFO answers: only what a peer needs (see TransferEngine.peer_info)
        self.limiter = limiter
        self.token = token  # the cluster secret peers must prove (handshake.py); None: no handshake
        self.limits = limits or ConnLimits()
        self.connections: set[ServerConnection] = set()
        self.unproven = 0  # connections still in the handshake
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        # SO_REUSEADDR only (restart past TIME_WAIT); never SO_REUSEPORT: one port, one listener
        self._server = await loop.create_server(
            lambda: ServerConnection(self), host, port, reuse_address=True, reuse_port=False, backlog=256
        )
        sockname = self._server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.abort()
        self.connections.clear()
        await self._server.wait_closed()
        self._server = None
