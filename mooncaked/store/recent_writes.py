"""Puts this client committed on other clients' DRAM in the last few seconds, kept to re-report them.

The master tells a DRAM segment's owner what was committed there in batches (dram_journal.py), up
to JOURNAL_FLUSH_S after the commit; a leader killed in between would leave the owner unaware of an
object the writer was told is stored, and a new leader rebuilt from the owners' remounts would not
know it. A put on the writer's own DRAM is journaled by the writer itself at commit (writes.py);
for a put on another's DRAM the writer keeps its record here for KEEP_S (longer while the master
may be gone: master_watch.py) and, when a new master or leader answers, re-reports it
(`ReportWrites`); the new master takes it only into free space, and every read checks the
checksum, so a stale record can cost a miss, never wrong bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

KEEP_S = 3.0  # far longer than a journal batch takes to go out (JOURNAL_FLUSH_S: 10 ms)


@dataclass(frozen=True, slots=True)
class Write:
    at: float
    segment: str
    key: str
    offset: int
    size: int
    checksum: int


class RecentWrites:
    """The last KEEP_S of this client's commits on other segments, oldest first."""

    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._writes: deque[Write] = deque()
        self.frozen = False  # the master may be gone: nothing ages out until it is known (master_watch.py)

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False

    def __len__(self) -> int:
        return len(self._writes)

    def note(self, segment: str, key: str, offset: int, size: int, checksum: int) -> None:
        now = self._clock()
        self._prune(now)
        self._writes.append(Write(now, segment, key, offset, size, checksum))

    def by_segment(self) -> dict[str, list[Write]]:
        """What is still worth re-reporting, per segment."""
        self._prune(self._clock())
        out: dict[str, list[Write]] = {}
        for w in self._writes:
            out.setdefault(w.segment, []).append(w)
        return out

    def settle(self, segment: str) -> None:
        """The master answered for this segment (taken or refused): nothing more to report there."""
        self._writes = deque(w for w in self._writes if w.segment != segment)

    def _prune(self, now: float) -> None:
        while not self.frozen and self._writes and now - self._writes[0].at > self.keep_s:
            self._writes.popleft()
