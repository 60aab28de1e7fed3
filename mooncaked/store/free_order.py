"""The DRAM segments ranked by free bytes, kept up to date as their space changes.

Placement tries the segment with the most free bytes first. Sorting every DRAM segment for each new
object made a put's cost grow with the pool: at 64 segments the sort and the scans beside it were
7 µs of the master's 18 µs per key (docs/performance.md, "Store master at scale"). Here each change
of a segment's space pushes one heap entry (-free bytes, mount order); an entry whose segment changed
again since, or left, is dropped when it comes up. The ranking equals a stable sort by free bytes,
most first (ties: the segment mounted first), as the segments stand when each is reached.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from mooncaked.store.records import Segment

_Entry = tuple[int, int, Segment]  # (-free bytes, mount order, segment)


class FreeOrder:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._order: dict[str, int] = {}  # segment name -> mount order (breaks ties)
        self._count = itertools.count()
        self.segments: dict[str, Segment] = {}  # the DRAM segments, in mount order
        self.biggest = 0  # the largest DRAM segment's capacity (0: none)

    def add(self, seg: Segment) -> None:
        self._order[seg.name] = next(self._count)
        self.segments[seg.name] = seg
        self.biggest = max(self.biggest, seg.capacity)
        self.changed(seg)

    def remove(self, seg: Segment) -> None:
        if self.segments.pop(seg.name, None) is not None:
            del self._order[seg.name]
            self.biggest = max((s.capacity for s in self.segments.values()), default=0)
            self._rebuild()  # (rare) no entry keeps the unmounted segment and what it held alive

    def changed(self, seg: Segment) -> None:
        """`seg`'s free bytes changed (a copy placed, freed, adopted)."""
        order = self._order.get(seg.name)
        if order is None:
            return
        heapq.heappush(self._heap, (-seg.alloc.free_bytes, order, seg))
        if len(self._heap) > 4 * len(self._order) + 64:  # mostly stale entries: start again from the segments
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(-s.alloc.free_bytes, self._order[n], s) for n, s in self.segments.items()]
        heapq.heapify(self._heap)

    def _current(self, entry: _Entry) -> bool:
        free, order, seg = entry
        return self._order.get(seg.name) == order and -free == seg.alloc.free_bytes

    def ranked(self) -> Iterator[Segment]:
        """The segments from the most free bytes down, each once. Whoever stops early must close the iterator
        (``with contextlib.closing(...)``): the entries it took off the heap go back then."""
        taken: list[_Entry] = []
        seen: set[str] = set()
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if not self._current(entry):
                    continue  # the segment changed since (its newer entry is in the heap), or left
                taken.append(entry)
                name = entry[2].name
                if name not in seen:  # (a segment changed after it was reached comes up again)
                    seen.add(name)
                    yield entry[2]
        finally:
            for entry in taken:
                if self._current(entry):  # unchanged meanwhile; a changed one pushed its new entry itself
                    heapq.heappush(self._heap, entry)
