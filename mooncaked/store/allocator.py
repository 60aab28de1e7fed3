"""Space inside one segment: which byte ranges are free.

`ExtentAllocator` (DRAM segments) keeps the free extents twice, sorted by offset (to merge
neighbours on free) and sorted by (size, offset) (to find the best fit with one bisect),
so alloc and free search in O(log n). `ByteBudget` (LMDB tiers) only counts bytes: LMDB
places values itself, a replica there has no offset.
"""

from __future__ import annotations

import bisect
import logging

logger = logging.getLogger(__name__)

DEFAULT_ALIGN = 64


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class ExtentAllocator:
    """Best-fit allocator over [0, capacity); "no room" is None, a double free is a bug (assert)."""

    def __init__(self, capacity: int, align: int = DEFAULT_ALIGN) -> None:
        assert capacity >= 0 and align > 0 and align & (align - 1) == 0, (capacity, align)
        self.capacity = capacity
        self.align = align
        self.used = 0
        self._starts: list[int] = []  # free extents' starts, sorted
        self._size_at: dict[int, int] = {}  # free extent start -> size
        self._by_size: list[tuple[int, int]] = []  # (size, start), sorted
        self._taken: dict[int, int] = {}  # allocated start -> aligned size
        usable = capacity // align * align
        if usable:
            self._add_free(0, usable)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def fits(self, size: int) -> bool:
        """Whether `alloc(size)` would succeed (free extents are whole multiples of `align`, so the
        largest one holds `size` exactly when it holds `size` rounded up)."""
        return bool(self._by_size) and self._by_size[-1][0] >= size

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of `size` bytes, or None when no free extent is big enough."""
        assert size > 0, size
        need = align_up(size, self.align)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        ext_size, start = self._by_size[i]
        self._remove_free(start)
        if ext_size > need:
            self._add_free(start + need, ext_size - need)
        self._taken[start] = need
        self.used += need
        return start

    def take(self, offset: int, size: int) -> bool:
        """Mark exactly [offset, offset+size) allocated (a remount re-reporting what it holds)."""
        need = align_up(size, self.align)
        if offset % self.align or size <= 0:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        ext_size = self._size_at[start]
        if offset + need > start + ext_size:
            return False
        self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if start + ext_size > offset + need:
            self._add_free(offset + need, start + ext_size - offset - need)
        self._taken[offset] = need
        self.used += need
        return True

    def free(self, offset: int, size: int = 0) -> None:
        """Give back the extent that `alloc` (or `take`) returned at `offset`."""
        need = self._taken.pop(offset, None)
        assert need is not None, f"free of offset {offset} that is not allocated"
        assert not size or align_up(size, self.align) == need, (offset, size, need)
        self.used -= need
        start, end = offset, offset + need
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._size_at[prev] == start:
                start = prev
                self._remove_free(prev)
        if end in self._size_at:
            nxt_size = self._size_at[end]
            self._remove_free(end)
            end += nxt_size
        self._add_free(start, end - start)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._size_at[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int) -> None:
        size = self._size_at.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]


class ByteBudget:
    """Counts bytes against a capacity; every extent is at offset 0 (LMDB places values itself)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self.free_bytes

    def fits(self, size: int) -> bool:
        """Whether `alloc(size)` would succeed."""
        return self.used + size <= self.capacity

    def alloc(self, size: int) -> int | None:
        assert size > 0, size
        if self.used + size > self.capacity:
            return None
        self.used += size
        return 0

    def take(self, offset: int, size: int) -> bool:
        """Remounted LMDB objects are always accepted; eviction trims an over-full tier."""
        self.used += size
        return True

    def free(self, offset: int, size: int = 0) -> None:
        assert 0 < size <= self.used, (size, self.used)
        self.used -= size
