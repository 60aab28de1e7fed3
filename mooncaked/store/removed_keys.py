"""Keys removed lately, so that a late report of an older copy does not bring them back.

A master learns of objects after the fact in two ways: an owner's remount (its journal or its LMDB
tier) and a writer's re-report of its last puts (recent_writes.py). Both may arrive seconds after a
restart or a fail-over, and a client may have removed the key at the new master in between: the
new master did not know the key then, so the remove did nothing, and the late report would make
the removed object readable again. The master notes every key a Remove names here (known or not)
and refuses a report of it for KEEP_S. A new commit of the key lets reports of that object (its
checksum) through, and still refuses the removed versions' (the new object evicted, a late report of
an old one must not take its place). Bounded by count, oldest first, as a Remove may name keys the
master never held.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

KEEP_S = 120.0  # far longer than a remount or re-report takes to arrive after a restart (a few pings)
MAX_KEYS = 1 << 16  # a few MB with block-hash keys, ~80 MB with the longest (1 KiB); a flood forgets the oldest first


class RemovedKeys:
    """key -> (when it was removed, the checksum of the object committed under it since, if any)."""

    def __init__(self, keep_s: float = KEEP_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self.max_keys = max_keys
        self.clock = clock
        self._at: OrderedDict[str, tuple[float, int | None]] = OrderedDict()

    def note(self, keys: Iterable[str]) -> None:
        now = self.clock()
        at = self._at
        for key in keys:
            at[key] = (now, None)
            at.move_to_end(key)
        while len(at) > self.max_keys:
            at.popitem(last=False)
        self._prune(now)

    def committed(self, key: str, checksum: int) -> None:
        """A new object under a noted key: reports of it (this checksum) are taken again."""
        if self._at:
            entry = self._at.get(key)
            if entry is not None:
                self._at[key] = (entry[0], checksum)

    def holds(self, key: str, checksum: int) -> bool:
        """Whether a report of `key` with `checksum` must be refused."""
        entry = self._at.get(key)
        if entry is None or self.clock() - entry[0] >= self.keep_s:
            return False
        return entry[1] != checksum

    def _prune(self, now: float) -> None:
        at = self._at
        while at:
            key, (when, _) = next(iter(at.items()))
            if now - when < self.keep_s:
                return
            del at[key]

    def __len__(self) -> int:
        return len(self._at)
