"""A client's LMDB tier: objects that left DRAM, kept on disk across restarts.

Two sub-databases in one environment: `meta` maps key -> (checksum, size) and `data` maps
key -> the bytes. A remount reads only `meta` (small), so re-reporting a big tier is cheap;
a read checks the data against the checksum and deletes a value that does not match, so a
flipped byte on disk is never served. Writes are batched into one transaction; the
environment is opened with sync off (a process crash keeps what the OS has; `close` syncs).
Methods block: callers run them in a thread.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import lmdb

from mooncaked.startup import StartupError
from mooncaked.store.records import ObjectRecord, checksum

logger = logging.getLogger(__name__)

_META = struct.Struct("<QQ")  # checksum, size
MAP_OVERHEAD = 2  # LMDB pages, free lists and MVCC copies need room beyond the payload
MAP_SLACK = 64 << 20


@dataclass(frozen=True, slots=True)
class LmdbWrite:
    key: str
    data: memoryview
    checksum: int


class LmdbTier:
    """One LMDB environment lent to the pool as `capacity` bytes."""

    def __init__(self, path: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"LMDB tier at {path}: capacity must be positive, got {capacity}")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity = capacity
        try:
            self.env = lmdb.open(path, map_size=capacity * MAP_OVERHEAD + MAP_SLACK, max_dbs=2, sync=False,
                                 metasync=False, readahead=False, lock=True)
        except lmdb.Error as e:  # not an LMDB environment, another version's, unreadable: the user's to fix
            raise StartupError(f"the LMDB tier at {path} (--store-lmdb-path) cannot be opened: {e}; point it at "
                               "an empty folder, or at one this engine's store wrote") from None
        self._meta = self.env.open_db(b"meta")
        self._data = self.env.open_db(b"data")

    def records(self) -> list[ObjectRecord]:
        """Every object held, from the metadata only (what a remount re-reports)."""
        out = []
        with self.env.begin(db=self._meta) as txn:
            for key, value in txn.cursor():
                csum, size = _META.unpack(value)
                out.append(ObjectRecord(key.decode(), 0, size, csum))
        return out

    def write_many(self, items: Sequence[LmdbWrite]) -> list[str]:
        """Store objects in one transaction; one error string per item ('' when stored)."""
        errors = [""] * len(items)
        try:
            with self.env.begin(write=True) as txn:
                for item in items:
                    k = item.key.encode()
                    txn.put(k, _META.pack(item.checksum, len(item.data)), db=self._meta)
                    txn.put(k, item.data, db=self._data)
        except lmdb.MapFullError:
            logger.warning("LMDB tier %s is full (map of %d bytes); demotions of this batch failed", self.path,
                           self.env.info()["map_size"])
            errors = ["lmdb map full"] * len(items)
        return errors

    def read_into(self, key: str, dest: memoryview, want_checksum: int) -> str:
        """Copy the object into `dest` after checking it; '' on success, else why not (a bad value is deleted)."""
        k = key.encode()
        with self.env.begin(buffers=True) as txn:
            meta = txn.get(k, db=self._meta)
            data = txn.get(k, db=self._data)
            if meta is None or data is None:
                return "missing on LMDB"
            csum, size = _META.unpack(bytes(meta))
            if size != len(data) or size != len(dest) or csum != want_checksum:
                problem = f"size/checksum differ from the master's ({size} vs {len(dest)} bytes)"
            elif checksum(data) != csum:
                problem = "checksum mismatch"
            else:
                dest[:] = data
                return ""
        logger.error("LMDB tier %s: object %s is corrupt (%s); deleting it", self.path, key, problem)
        self.delete_many([key])
        return problem if problem == "checksum mismatch" else f"checksum mismatch: {problem}"

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        with self.env.begin(write=True) as txn:
            for key in keys:
                k = key.encode()
                n += txn.delete(k, db=self._data)
                txn.delete(k, db=self._meta)
        return n

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
