"""A reader's connections to DRAM owners' key servers (owner_server.py): one per owner, requests
pipelined, each answer's bytes received straight into the memory the caller names.

A read waits CONNECT_GRACE_S at most for a connection still opening (it goes on opening for the
next read). Every read has a short deadline (GRACE_S plus the bytes at SLOW_BYTES_PER_S): the master's path
is the fallback, so a stalled owner must not hold a get for long. A connection whose answer is
late, or whose caller went away, is dropped at once, so nothing lands later in memory given back.
An owner that could not be reached, or answered late, is not asked again for DOWN_S: its readers
go through the master meanwhile.

With a spin budget (`StoreClientConfig.owner_read_spin_us`), a read receives its answer on the
calling thread, polling the socket, until the answer is in or the budget passes with no byte;
only then does it wait on the event loop. On a host where waking a sleeping process costs tens
of µs (docs/performance.md "KV pool"), that saves a wake per read at the price of a CPU spinning
while the owner answers. Off by default: in an engine the spin holds the GIL its engine thread
needs, and each poll gives the GIL up to that thread for as long as it likes; and an owner served
from the polling client's own event loop cannot answer until the poll gives up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass

from mooncaked.store import fresh_bytes
from mooncaked.store.owner_wire import REPLY, SERVED, KeyRequest, WireError, pack_request
from mooncaked.store.master_link import host_of
from mooncaked.store.records import Hasher, checksum_stream
from mooncaked.transfer import TransferError
from mooncaked.transfer.handshake import HANDSHAKE_TIMEOUT_S, authenticated, open_socket

logger = logging.getLogger(__name__)

DOWN_S = 1.0  # after a failed connection or a late answer, that owner is read through the master this long
GRACE_S = 0.05  # an owner's answer is given up after this, plus its bytes at SLOW_BYTES_PER_S
SLOW_BYTES_PER_S = 100e6
CONNECT_GRACE_S = 0.2  # a read waits this long for a new connection; it keeps opening in the background
SCRATCH_MAX_BYTES = 64 << 20  # the largest object read_bytes takes (off CPython its connection keeps a buffer that big)
REWRITTEN = -2  # read_bytes: served, but not the bytes asked for (the place was rewritten while sent)
_ids = itertools.count(1)


@dataclass(slots=True)
class OwnerRead:
    """One object asked of an owner: its bytes land in `into` (exactly `size` bytes) when served; with no
    `into` (read_bytes), in a new bytes object, checked against `checksum` as they land."""

    key: str
    size: int
    checksum: int
    into: memoryview | None = None


class _Pending:
    """One request in flight. A read with no `into` is a single get wanting `bytes` (read_bytes): its
    answer lands in the bytes object it is handed over as (fresh_bytes), hashed as it arrives, and is
    handed over only if it matches."""

    __slots__ = ("req_id", "read", "fut")

    def __init__(self, req_id: int, read: OwnerRead, fut: asyncio.Future) -> None:
        self.req_id, self.read, self.fut = req_id, read, fut


class _Conn(asyncio.BufferedProtocol):
    """Answers arrive in request order: a header, then (when served) the bytes, into the request's memory."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[_Pending] = deque()
        self.closed = False
        self._hdr = bytearray(REPLY.size)
        self._hpos = 0
        self._body: memoryview | None = None  # the served bytes' destination while they arrive
        self._bpos = 0
        self._out: bytes | None = None  # the bytes a read_bytes answer lands in, unseen until checked (fresh_bytes)
        self._scratch = bytearray()  # where such answers land instead off CPython (copied out once checked)
        self._hasher: Hasher | None = None  # hashes such an answer chunk by chunk as it lands
        self._sock: socket.socket | None = None  # a duplicate of the transport's socket, for spin()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def spin(self, fut: asyncio.Future, budget_s: float) -> None:
        """Receive answers on this thread, through the protocol's own buffers, until `fut` is settled or
        `budget_s` passed with no byte to read; the event loop then takes over where this left off."""
        if self._sock is None:
            assert self.transport is not None
            fd = self.transport.get_extra_info("socket").fileno()
            self._sock = socket.socket(fileno=os.dup(fd))  # non-blocking: the flag is the transport's
        end = time.perf_counter() + budget_s
        while not fut.done() and not self.closed:
            try:
                n = self._sock.recv_into(self.get_buffer(-1))
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return
                continue
            except OSError:
                return  # the transport meets the same error and fails the reads
            if n == 0:
                return  # end of stream: the transport's connection_lost says so
            self.buffer_updated(n)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"owner connection lost ({exc or 'closed'})"))

    def fail(self, e: Exception) -> None:
        self.closed = True
        self._body = self._out = None  # the view into _out first: nothing may write into it once it is let go
        while self.pending:
            p = self.pending.popleft()
            if not p.fut.done():
                p.fut.set_exception(e)
        if self.transport is not None:
            self.transport.abort()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._bpos:]
        return memoryview(self._hdr)[self._hpos:]

    def buffer_updated(self, nbytes: int) -> None:
        body = self._body
        if body is not None:
            if self._hasher is not None:  # while the rest is still on its way
                self._hasher.update(body[self._bpos:self._bpos + nbytes])
            self._bpos += nbytes
            if self._bpos == len(body):
                self._body = None
                self._done(SERVED)
            return
        self._hpos += nbytes
        if self._hpos < REPLY.size:
            return
        self._hpos = 0
        req_id, status, size = REPLY.unpack(self._hdr)
        if not self.pending or self.pending[0].req_id != req_id:
            self.fail(WireError(f"an answer to request {req_id} nobody asked for"))
            return
        head = self.pending[0].read
        if status == SERVED:
            if size != head.size:
                self.fail(WireError(f"served {size} bytes for a {head.size}-byte object"))
                return
            if head.into is not None:
                self._body = head.into
            else:  # a read_bytes
                self._out, self._body = self._landing(size)
                self._hasher = checksum_stream()
            self._bpos = 0
        else:
            self._done(status)

    def _landing(self, size: int) -> tuple[bytes | None, memoryview]:
        """Where a read_bytes answer lands: the bytes the get returns (CPython), else the scratch buffer."""
        if fresh_bytes.supported():
            return fresh_bytes.fresh(size)
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        return None, memoryview(self._scratch)[:size]

    def _done(self, status: int) -> None:
        p = self.pending.popleft()
        hasher, self._hasher = self._hasher, None
        out, self._out = self._out, None
        if p.fut.done():
            return
        r = p.read
        if r.into is None and status == SERVED:  # a read_bytes: handed over once checked (a bad one is dropped)
            assert hasher is not None
            if hasher.intdigest() != r.checksum:
                p.fut.set_result(REWRITTEN)
            else:
                p.fut.set_result(out if out is not None else bytes(memoryview(self._scratch)[:r.size]))
        else:
            p.fut.set_result(status)

    def eof_received(self) -> bool:
        return False


class OwnerLinks:
    """Connections to owners by key-server address; `read` asks one owner for some objects."""

    def __init__(self, token: bytes | None, timeout_s: float, spin_s: float = 0.0) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self.spin_s = spin_s  # receive answers on the caller's thread this long before sleeping (Conn.spin)
        self._conns: dict[str, _Conn] = {}
        self._down_until: dict[str, float] = {}
        self._opening: dict[str, asyncio.Task[_Conn]] = {}

    def reachable(self, address: str) -> bool:
        return asyncio.get_running_loop().time() >= self._down_until.get(address, 0.0)

    async def read(self, address: str, reads: list[OwnerRead]) -> list[int | bytes]:
        """Each read's status (owner_wire): SERVED means its `into` holds the bytes the owner sent (not
        yet checked); a read with no `into` gives its bytes instead, checked as they landed (read_bytes),
        or REWRITTEN. Raises TransferError when the owner cannot be asked or does not answer in time."""
        return await self._ask(address, reads)

    async def read_bytes(self, address: str, key: str, size: int, csum: int) -> bytes | int:
        """One object as new `bytes`, checked against `csum`; else its status: NOT_HELD, WINDOW_CLOSED,
        or REWRITTEN (served, but its place was rewritten while sent). No staging: the answer lands in
        the bytes returned. Raises TransferError as read() does."""
        if size > SCRATCH_MAX_BYTES:
            raise TransferError(f"owner {address}: {size} bytes is over the {SCRATCH_MAX_BYTES}-byte read_bytes limit")
        return (await self._ask(address, [OwnerRead(key, size, csum)]))[0]

    async def _ask(self, address: str, reads: list[OwnerRead]) -> list:
        loop = asyncio.get_running_loop()
        conn = self._conns.get(address)
        if conn is None or conn.closed:
            conn = await self._connected(address)
        deadline = min(self.timeout_s, GRACE_S + sum(r.size for r in reads) / SLOW_BYTES_PER_S)
        # one timer, not asyncio.timeout: its context machinery costs more than a small read's bookkeeping
        timer = loop.call_at(loop.time() + deadline, conn.fail, TimeoutError(f"no answer within {deadline:.3f}s"))
        try:
            futs = []
            frames = []
            for r in reads:
                req_id = next(_ids)
                fut = loop.create_future()
                conn.pending.append(_Pending(req_id, r, fut))
                frames.append(pack_request(KeyRequest(req_id, r.key, r.size, r.checksum)))
                futs.append(fut)
            assert conn.transport is not None
            conn.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))
            if self.spin_s:
                conn.spin(futs[-1], self.spin_s)
            await futs[-1]  # answers come in order: the others are settled by now (or the link failed all)
            timer.cancel()
            return [f.result() for f in futs]
        except BaseException as e:
            timer.cancel()
            if self._conns.get(address) is conn:
                del self._conns[address]
            conn.fail(ConnectionError("a read on it was given up"))  # an answer may still come: into memory given back
            if isinstance(e, TimeoutError):
                self._down_until[address] = loop.time() + DOWN_S
            if isinstance(e, (TimeoutError, OSError, ConnectionError, WireError, TransferError)):
                raise TransferError(f"owner {address}: {e or type(e).__name__}") from None
            raise

    async def _connected(self, address: str) -> _Conn:
        """A connection, waited for CONNECT_GRACE_S at most: one still opening then goes on in the
        background (for the next read), and this read takes the master's path."""
        task = self._opening.get(address)
        if task is None:
            task = self._opening[address] = asyncio.ensure_future(self._open(address))
            task.add_done_callback(lambda _: self._opening.pop(address, None))
        try:
            async with asyncio.timeout(CONNECT_GRACE_S):
                return await asyncio.shield(task)
        except TimeoutError:
            raise TransferError(f"owner {address}: still connecting") from None

    async def _open(self, address: str) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port = host_of(address), int(address.rsplit(":", 1)[1])
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                sock = await open_socket(host, port)
                if self.token is not None:
                    sock = await authenticated(sock, self.token, f"the store owner at {address}", HANDSHAKE_TIMEOUT_S)
                _, conn = await loop.create_connection(_Conn, sock=sock)
        except (OSError, TransferError, TimeoutError) as e:
            self._down_until[address] = loop.time() + DOWN_S
            logger.info("store owner %s unreachable for reads by key (%s); reading through the master", address,
                        e or type(e).__name__)
            raise TransferError(f"owner {address}: {e or type(e).__name__}") from None
        self._conns[address] = conn
        return conn

    def close(self) -> None:
        for task in list(self._opening.values()):
            task.cancel()
        for conn in self._conns.values():
            conn.fail(ConnectionError("closed"))
        self._conns.clear()
