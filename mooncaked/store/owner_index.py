"""A DRAM segment's owner publishes what it would serve by key in shared memory: a get on its host
needs no round trip at all.

Over TCP a reader that knows an object's owner, size and checksum asks the owner by key
(owner_server.py). On the owner's own host the bytes are one memcpy away (shared memory), so
the owner also writes, next to its DRAM segment, the answer it would give: a table of the keys
its DRAM journal holds (where, how big, what checksum) and until when its serve window is open.
A reader there looks the key up in the table, copies the bytes out of the segment, hashes them,
and looks again: the object is served only when the entry matched the size and checksum it knew
before and after the copy, the window was open both times, and the bytes hash to the checksum.
That is the owner's answer without asking it, under the same rules:

- The window is the owner's (owner_server.ServeWindow), in CLOCK_MONOTONIC nanoseconds, which
  every process on the host shares: from the send of the Ping that vouched for it, so it closes
  no later than the one the master counts on when a Remove waits out an owner that did not
  acknowledge. A reader wants ``MARGIN_NS`` of it left.
- An entry leaves the table when the owner applies the journal batch that takes the key away,
  before it acknowledges the batch, so after a Remove returns no reader finds the key here.
- A place reused during the copy holds other bytes: the checksum, or the entry's sequence number
  that changed, says so, and the reader asks the master.

Each entry is written under a sequence number (odd while it is written), and readers re-read
it around their reads (a seqlock). That needs stores and loads to stay in program order, which
x86's memory model gives plain stores and loads; elsewhere the owner publishes no table and
readers take the other paths. The table is a file in /dev/shm of mode 0600, next to the segment
and under the same trust rule (transfer/shm.py): any process of the same user may read and
forge it, as it could ptrace the owner; a forged entry can still only yield bytes that hash to
the checksum the reader already knew. Readers mark the entries they served (``touched``), and the
owner reports those keys with its next Ping, so the master's LRU counts these reads too.

The table is bounded (``slots``, 4 ways per bucket): a key that finds its bucket full evicts the
oldest entry of it, which is then read the other ways.
"""

from __future__ import annotations

import logging
import platform
import struct
import time
from collections import OrderedDict

import xxhash

from mooncaked.transfer.api import TransferError
from mooncaked.transfer.shm_files import create_file, map_segment, remove_file

logger = logging.getLogger(__name__)

MAGIC = b"MCKDIDX1"
HEADER = struct.Struct("<8sQQ")  # magic, slots, window open until (CLOCK_MONOTONIC ns; 0: closed)
HEADER_BYTES = 64
SEQ = struct.Struct("<Q")
ENTRY = struct.Struct("<QQQQ")  # key hash, offset, size, checksum
SLOT_BYTES = 48  # sequence number, entry, 8 spare bytes
WAYS = 4
UNTIL_AT = 16  # the window's offset in the header
MARGIN_NS = 5_000_000  # window a reader wants left (copy and check fit well inside)
SUFFIX = "-index"
_pack_seq, _pack_entry = SEQ.pack_into, ENTRY.pack_into
MIN_SLOTS, MAX_SLOTS = 1024, 1 << 20


def supported() -> bool:
    """Whether this CPU keeps plain stores and loads in order (the seqlock relies on it): x86-64."""
    return platform.machine().lower() in ("x86_64", "amd64")


def index_name(segment_shm_name: str) -> str:
    """The table's shm name: its DRAM segment's, with a suffix (so a hint naming the segment finds it)."""
    return segment_shm_name + SUFFIX


def slots_for(dram_bytes: int) -> int:
    """A power of two: one slot per 16 KiB of DRAM, within [MIN_SLOTS, MAX_SLOTS]."""
    want = max(MIN_SLOTS, min(MAX_SLOTS, dram_bytes // (16 << 10)))
    return 1 << (want - 1).bit_length()


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode()) or 1  # 0 marks an empty slot


def _file_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * SLOT_BYTES + slots  # header, slots, one touched byte per slot


def _slot_at(slot: int) -> int:
    return HEADER_BYTES + slot * SLOT_BYTES


class OwnerIndex:
    """The owner's side: one writer (its event loop), kept in step with its DRAM journal and window."""

    def __init__(self, segment_shm_name: str, slots: int) -> None:
        assert slots >= WAYS and slots & (slots - 1) == 0, slots
        self.name = index_name(segment_shm_name)
        self.slots = slots
        self._mm = create_file(self.name, _file_bytes(slots))  # 0600, never over an existing name
        self._view = memoryview(self._mm)
        self._touched_at = HEADER_BYTES + slots * SLOT_BYTES
        HEADER.pack_into(self._view, 0, MAGIC, slots, 0)
        self._key_at: list[str | None] = [None] * slots
        self._slot_of: dict[str, int] = {}
        self._seq = [0] * slots  # each slot's sequence number, as written (the one writer keeps its own copy)
        self._mask = slots // WAYS - 1
        self._victim = bytearray(slots // WAYS)  # per bucket: the way to evict next (round robin)
        self.until_ns = 0

    def put(self, key: str, offset: int, size: int, checksum: int) -> None:
        """The journal holds `key` at `offset` now (a new entry, or one that moved)."""
        khash = key_hash(key)
        slot = self._slot_of.get(key)
        if slot is None:  # (applied a few hundred times a flush: kept to C-level calls)
            bucket = (khash & self._mask) * WAYS
            try:
                slot = self._key_at.index(None, bucket, bucket + WAYS)
            except ValueError:  # full: evict its ways in turn
                way = self._victim[bucket // WAYS]
                self._victim[bucket // WAYS] = (way + 1) % WAYS
                slot = bucket + way
                del self._slot_of[self._key_at[slot]]  # type: ignore[arg-type]
            self._key_at[slot] = key
            self._slot_of[key] = slot
        self._write(slot, khash, offset, size, checksum)

    def remove(self, key: str) -> None:
        """The journal no longer holds `key` (removed, evicted, moved away or forgotten)."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._key_at[slot] = None
            self._write(slot, 0, 0, 0, 0)

    def clear(self) -> None:
        for key in list(self._slot_of):
            self.remove(key)

    def set_window(self, until_ns: int) -> None:
        """Readers may serve until `until_ns` (CLOCK_MONOTONIC; 0: not at all)."""
        if until_ns != self.until_ns:
            self.until_ns = until_ns
            SEQ.pack_into(self._view, UNTIL_AT, until_ns)

    def take_touched(self, limit: int) -> list[str]:
        """Keys readers served since the last call (at most `limit`; the marks are cleared)."""
        out: list[str] = []
        marks = self._view[self._touched_at:]
        seen = bytes(marks)  # one copy of a byte per slot, once a ping
        at = seen.find(1)
        while at >= 0 and len(out) < limit:
            marks[at] = 0
            key = self._key_at[at]
            if key is not None:
                out.append(key)
            at = seen.find(1, at + 1)
        marks.release()
        return out

    def close(self) -> None:
        """Close the window and remove the file (readers that mapped it see it closed)."""
        self.set_window(0)
        remove_file(self.name)
        self._view.release()
        self._mm.close()

    def _write(self, slot: int, khash: int, offset: int, size: int, checksum: int) -> None:
        at = HEADER_BYTES + slot * SLOT_BYTES
        seq = self._seq[slot] + 1
        view = self._view
        _pack_seq(view, at, seq)  # odd: readers skip it, or find it changed after
        _pack_entry(view, at + 8, khash, offset, size, checksum)
        _pack_seq(view, at, seq + 1)
        self._seq[slot] = seq + 1


class IndexView:
    """A reader's mapping of one owner's table."""

    def __init__(self, name: str) -> None:
        self._mm = map_segment(name)  # ours only, private, never through a link (shm_files.py)
        self._view = memoryview(self._mm)
        size = len(self._mm)
        magic, slots, _ = HEADER.unpack_from(self._view, 0) if size >= HEADER_BYTES else (b"", 0, 0)
        if magic != MAGIC or slots < WAYS or slots & (slots - 1) or _file_bytes(slots) > size:
            self.close()
            raise TransferError(f"owner index {name} is not one (magic {magic!r}, {slots} slots, {size} bytes)")
        self.name = name
        self.slots = slots
        self._touched_at = HEADER_BYTES + slots * SLOT_BYTES

    def open_now(self) -> bool:
        return time.monotonic_ns() + MARGIN_NS < SEQ.unpack_from(self._view, UNTIL_AT)[0]

    def vouch(self, key: str, offset: int, size: int, checksum: int) -> tuple[int, int] | None:
        """(slot, sequence number) of the owner's entry for exactly this object while its window is
        open; None: ask the master."""
        if not self.open_now():
            return None
        khash = key_hash(key)
        want = (khash, offset, size, checksum)
        bucket = (khash & (self.slots // WAYS - 1)) * WAYS
        view = self._view
        for slot in range(bucket, bucket + WAYS):
            at = _slot_at(slot)
            seq = SEQ.unpack_from(view, at)[0]
            if seq & 1:
                continue
            entry = ENTRY.unpack_from(view, at + 8)
            if entry == want and SEQ.unpack_from(view, at)[0] == seq:
                return slot, seq
        return None

    def still(self, slot: int, seq: int) -> bool:
        """Whether the entry vouched for is unchanged and the window still open (after the copy)."""
        return SEQ.unpack_from(self._view, _slot_at(slot))[0] == seq and self.open_now()

    def touch(self, slot: int) -> None:
        self._view[self._touched_at + slot] = 1

    def close(self) -> None:
        self._view.release()
        self._mm.close()


class IndexViews:
    """A reader's mapped tables by name (at most `capacity`, least recently used dropped: a few owners
    share a host, and a gone owner's table, ~3 MiB a GiB of DRAM, stays mapped until then); a table that
    could not be mapped is not tried again for `retry_s` (a get must not pay a failing open each time)."""

    def __init__(self, capacity: int = 16, retry_s: float = 5.0) -> None:
        self.capacity = capacity
        self.retry_s = retry_s
        self._views: OrderedDict[str, IndexView] = OrderedDict()
        self._failed: dict[str, float] = {}

    def get(self, name: str) -> IndexView | None:
        view = self._views.get(name)
        if view is not None:
            self._views.move_to_end(name)
            return view
        now = time.monotonic()
        if self._failed.get(name, 0.0) > now:
            return None
        try:
            view = IndexView(name)
        except TransferError as e:
            logger.debug("store get: owner index %s not used: %s", name, e)
            if len(self._failed) >= 4 * self.capacity:
                self._failed.clear()
            self._failed[name] = now + self.retry_s
            return None
        self._views[name] = view
        if len(self._views) > self.capacity:
            self._views.popitem(last=False)[1].close()
        return view

    def close(self) -> None:
        for view in self._views.values():
            view.close()
        self._views.clear()


__all__ = ["IndexView", "IndexViews", "OwnerIndex", "index_name", "slots_for", "supported"]
