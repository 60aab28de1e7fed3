"""What a client's DRAM segment holds, as the master told it: the journal a remount re-reports.

The master keeps the pool's metadata; the bytes stay in the engines. So that a master that lost
its metadata (a restart, or a new leader) gets the DRAM objects back as it gets the LMDB ones,
it tells each DRAM segment's owner, batched on the Tasks stream, what was committed there (key,
offset, size, checksum) and what left. The owner keeps the latest entry per offset; at a remount
it re-reports the entries whose bytes still hash to their checksum (xxh3 over its own DRAM), so a
place overwritten since, or an entry whose "left" notice never came, is simply not reported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store.owner_index import OwnerIndex
from mooncaked.store.records import ObjectRecord, checksum

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Held:
    key: str
    size: int
    checksum: int


class DramJournal:
    """Offset -> the object the master last committed there (one per offset: a newer one replaces it)."""

    def __init__(self) -> None:
        self._at: dict[int, Held] = {}
        self._where: dict[str, int] = {}  # key -> its offset (a key re-put elsewhere replaces its old entry)
        self.applied = 0  # entries applied since start (tests wait on it)
        self.index: OwnerIndex | None = None  # the same keys, published to readers on this host (owner_index.py)

    def __len__(self) -> int:
        return len(self._at)

    def apply(self, entries: Iterable[store_pb2.JournalEntry]) -> None:
        """Take a batch from the master, in its order."""
        for e in entries:
            self.applied += 1
            if e.size:
                self.note(e.key, e.offset, e.size, e.checksum)
            else:
                held = self._at.get(e.offset)
                if held is not None and held.key == e.key:
                    del self._at[e.offset]
                    if self._where.get(e.key) == e.offset:
                        self._unwhere(e.key)

    def note(self, key: str, offset: int, size: int, checksum: int) -> None:
        """An object now at `offset`: from the master's journal, or written here by this client itself
        and committed (so a master lost before its journal batch came still gets it back)."""
        at, where = self._at, self._where
        old = at.get(offset)
        if old is not None and old.key != key and where.get(old.key) == offset:
            self._unwhere(old.key)
        prev = where.get(key)
        if prev is not None and prev != offset:
            del at[prev]
        at[offset] = Held(key, size, checksum)
        where[key] = offset
        if self.index is not None:
            self.index.put(key, offset, size, checksum)

    def find(self, key: str) -> tuple[int, Held] | None:
        """Where the key's committed copy is here, and what it holds (owner reads: owner_server.py)."""
        offset = self._where.get(key)
        return None if offset is None else (offset, self._at[offset])

    def records(self, dram: memoryview) -> list[ObjectRecord]:
        """Blocking (hashes the DRAM): the entries whose bytes are intact, in offset order; the others
        are forgotten."""
        out = []
        stale = []
        for offset in sorted(self._at):
            held = self._at[offset]
            end = offset + held.size
            if end <= len(dram) and checksum(dram[offset:end]) == held.checksum:
                out.append(ObjectRecord(held.key, offset, held.size, held.checksum))
            else:
                stale.append(offset)
        for offset in stale:
            self._drop(offset)
        if stale:
            logger.info("DRAM journal: %d entries no longer match their bytes (places reused); not re-reported",
                        len(stale))
        return out

    def forget(self, keys: Iterable[str]) -> None:
        """Entries the master refused at a remount (it holds those keys elsewhere)."""
        for key in keys:
            offset = self._where.get(key)
            if offset is not None:
                self._drop(offset)

    def clear(self) -> None:
        self._at.clear()
        self._where.clear()
        if self.index is not None:
            self.index.clear()

    def _drop(self, offset: int) -> None:
        held = self._at.pop(offset)
        if self._where.get(held.key) == offset:
            self._unwhere(held.key)

    def _unwhere(self, key: str) -> None:
        del self._where[key]
        if self.index is not None:
            self.index.remove(key)
