"""A DRAM segment's owner serves its committed objects by key: a get in one round trip, no master.

A reader that knows an object's owner, size and checksum (from its own put, or an earlier
lookup) asks the owner for the key. The owner answers from its DRAM journal (dram_journal.py:
what the master says was committed here), only when the key is there with exactly that size and
checksum, and only while its serve window is open; the reader hashes what comes back as on every
read, and falls back to the master's path on anything else.

Why the master stays the authority on existence (the serve window):
- What leaves this DRAM (remove, eviction, demotion) reaches the owner as a journal batch, numbered
  per client (`journal_seq`). The owner acknowledges a batch that takes keys away (TaskDone), and a
  Remove is answered only once every owner it took keys from acknowledged, or once that owner's
  window has certainly closed: so after a Remove, no owner serves the key.
- The window: the owner may serve until `sent + serve_window_s` of its last Ping whose reply
  (a) knew it under the master it follows and (b) named no journal batch it has not applied yet.
  The master flushes a client's pending journal before answering its Ping, and waits
  `serve_window_s` (plus a margin) for an owner that does not acknowledge: any window that owner
  could still hold comes from a Ping sent before the batch, so it has run out by then.
- A place reused after it was freed holds other bytes: the reader's checksum catches it.
What is not covered: a copy dropped by eviction (or with a dead owner's segment) stops being
served when its batch is applied (a few ms), not before the drop is visible to others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from mooncaked.store import metrics
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import DramSegment
from mooncaked.store.owner_index import OwnerIndex
from mooncaked.store.owner_wire import (NOT_HELD, REPLY, SERVED, STATUS_NAMES, WINDOW_CLOSED, WireError,
                                        read_requests, request_bytes)
from mooncaked.store.guarded_conn import MAX_PER_TURN, GuardedConnection
from mooncaked.transfer.conn_guard import ConnLimits
from mooncaked.transfer.handshake import ANSWER_BYTES

logger = logging.getLogger(__name__)

OWNER_LIMITS = ConnLimits(max_connections=256, max_unproven=64, idle_timeout_s=300.0, partial_timeout_s=10.0)
MAX_BUFFERED = 1 << 16  # unparsed request bytes one connection may hold (a request is at most ~4 KiB)


MAX_TOUCHED = 4096  # keys served by key reported with one ping at most (the rest go unreported)


@dataclass(slots=True)
class ServeWindow:
    """Until when this owner may serve reads by key (CLOCK_MONOTONIC ns, which every process on the host
    shares: readers of its shared-memory index check the same figure, owner_index.py), and what it has
    applied of whose journal; and the keys it served since its last ping (reported with the next: the
    master's LRU counts them)."""

    until_ns: int = 0
    epoch: int = 0  # the master whose journal batches `applied` counts
    applied: int = 0
    touched: set[str] = field(default_factory=set)
    index: OwnerIndex | None = None  # where readers on this host find the window (owner_index.py)

    def take_touched(self) -> list[str]:
        out, self.touched = list(self.touched), set()
        if self.index is not None:
            out += self.index.take_touched(MAX_TOUCHED)
        return out[:MAX_TOUCHED]

    def _set_until(self, until_ns: int) -> None:
        self.until_ns = until_ns
        if self.index is not None:
            self.index.set_window(until_ns)

    def open(self, now_ns: int | None = None) -> bool:
        return (time.monotonic_ns() if now_ns is None else now_ns) < self.until_ns

    def close(self) -> None:
        self._set_until(0)

    def restart(self) -> None:
        """A (re)mount: closed until a Ping vouches, and the master's numbering starts again."""
        self._set_until(0)
        self.epoch, self.applied = 0, 0

    def journal_applied(self, epoch: int, seq: int) -> None:
        """A journal batch was applied (in stream order)."""
        if epoch != self.epoch:  # a new master: serve again only once its Ping vouches
            self.epoch = epoch
            self._set_until(0)
        self.applied = max(self.applied, seq)

    def pinged(self, sent_ns: int, known: bool, epoch: int, journal_seq: int, window_s: float) -> None:
        """A Ping sent at `sent_ns` (CLOCK_MONOTONIC, taken before the send) came back with this answer."""
        if not known or window_s <= 0:
            self.close()
            return
        if epoch != self.epoch:
            if journal_seq:  # this master numbered batches we have not seen: wait for them
                self.close()
                return
            self.epoch, self.applied = epoch, 0
        if self.applied >= journal_seq:
            self._set_until(max(self.until_ns, sent_ns + int(window_s * 1e9)))


class OwnerServer:
    """Serves this client's DRAM objects by key (see the module docstring); `await start(host)`."""

    def __init__(self, dram: DramSegment, journal: DramJournal, window: ServeWindow,
                 token: bytes | None = None, limits: ConnLimits = OWNER_LIMITS) -> None:
        self.dram = dram
        self.journal = journal
        self.window = window
        self.token = token
        self.limits = limits
        self.connections: set[_Conn] = set()
        self.unproven = 0
        self.address = ""
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), host, port, reuse_address=True)
        bound = self._server.sockets[0].getsockname()
        self.address = f"[{host}]:{bound[1]}" if ":" in host else f"{host}:{bound[1]}"
        logger.info("store owner reads by key on %s", self.address)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self.connections):
                c.abort()
            await self._server.wait_closed()
            self._server = None

    def answer(self, key: str, size: int, csum: int) -> tuple[int, memoryview | None]:
        """Status and, when served, the object's bytes in DRAM."""
        if not self.window.open():
            return WINDOW_CLOSED, None
        found = self.journal.find(key)
        if found is None or found[1].size != size or found[1].checksum != csum:
            return NOT_HELD, None
        offset = found[0]
        if offset + size > self.dram.nbytes:
            return NOT_HELD, None
        if len(self.window.touched) < MAX_TOUCHED:
            self.window.touched.add(key)
        return SERVED, self.dram.slice(offset, size)


class _Conn(GuardedConnection):
    what = "store owner-read"
    write_high = 4 << 20  # answers queued are views of the DRAM, not copies: room for a batch's worth
    def __init__(self, server: OwnerServer) -> None:
        super().__init__(server)
        self._served = 0

    def _progress(self) -> int:
        return self._served

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._handshake is not None:
            self._buf += data
            if len(self._buf) < ANSWER_BYTES or not self._prove():
                return
            data = b""
        self._take(data)
        if len(self._buf) > MAX_BUFFERED and not self._holds:  # held: reading stops, the buffer cannot grow
            self._drop(f"{len(self._buf)} bytes of an unfinished request")

    bad_input = (WireError,)

    def _serve(self, buf: bytes | bytearray) -> tuple[int, bool]:
        requests, used = read_requests(buf, MAX_PER_TURN)
        transport, server = self._transport, self._server
        assert transport is not None and isinstance(server, OwnerServer)
        unserved = bytearray()  # answers with no bytes, written together (one object queued, not one each)
        for i, r in enumerate(requests):
            if self._holds:  # the peer is behind on its answers: the rest wait (guarded_conn.py)
                used = sum(request_bytes(q) for q in requests[:i])
                break
            status, view = server.answer(r.key, r.size, r.checksum)
            self._served += 1
            metrics.owner_read(STATUS_NAMES[status]).inc()
            if view is None:
                unserved += REPLY.pack(r.req_id, status, 0)
                continue
            if unserved:
                transport.write(bytes(unserved))
                unserved.clear()
            # bytes still queued when their place is rewritten fail the reader's checksum: a fallback
            transport.writelines((REPLY.pack(r.req_id, SERVED, r.size), view))
        if unserved:
            transport.write(bytes(unserved))
        return used, len(requests) == MAX_PER_TURN


__all__ = ["NOT_HELD", "SERVED", "WINDOW_CLOSED", "OwnerServer", "ServeWindow"]
