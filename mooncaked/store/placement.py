"""Where a new object's copies go: distinct DRAM segments, the most free space first (free_order.py).

Never two copies on one segment (each segment is tried once); the writer's preferred
segment, when named, goes first. A segment too full for the object first drops what loses
nothing (`eviction.free_now`); failing that, it starts demotions so a retry will fit. When no
DRAM segment has room now, the object goes to the writer's own LMDB tier (`place_on_lmdb`):
the writer holds the bytes, so storing them there is one local write, where waiting for a
demotion would be a round trip through another process and a second copy of older bytes.

A decider: it yields `Place` decisions (and the evictions that make room) and changes nothing;
the master allocates each place when it applies it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from mooncaked.store import eviction
from mooncaked.store.catalog import Catalog
from mooncaked.store.decisions import Decisions, Place
from mooncaked.store.records import Segment

logger = logging.getLogger(__name__)


def place(cat: Catalog, size: int, want: int, preferred: Segment | None, make_room: bool,
          evict: bool = True) -> Decisions[None]:
    """Up to `want` places for `size` bytes on distinct DRAM segments; none when none has room.
    `evict=False`: free space only (a place reserved ahead must not push objects out)."""
    with contextlib.closing(cat.free_order.ranked()) as ranked:
        yield from _place(cat, _preferred_first(ranked, preferred), size, want, make_room, evict)


def _preferred_first(ranked: Iterator[Segment], preferred: Segment | None) -> Iterator[Segment]:
    if preferred is not None:
        yield preferred
    yield from (seg for seg in ranked if seg is not preferred)


def _place(cat: Catalog, order: Iterator[Segment], size: int, want: int, make_room: bool,
           evict: bool) -> Decisions[None]:
    placed = 0
    ceiling = cat.policy.high_watermark
    if want <= 0:
        return
    for seg in order:
        if not evict and seg.used + size > ceiling * seg.capacity:
            continue  # a place reserved ahead never takes a segment past its watermark (it would push data out)
        if not seg.alloc.fits(size) and not (evict and (yield from eviction.free_now(cat, seg, size))):
            if make_room:
                yield from eviction.make_room(cat, seg, size)
            continue
        yield Place(seg, size)  # (each segment once: never two copies on one)
        placed += 1
        if placed == want:
            return  # (before asking the ranking for one more segment)


def place_on_lmdb(cat: Catalog, lmdb: Segment | None, size: int) -> Decisions[None]:
    """One place on the writer's LMDB tier (dropping its least recently used objects if it must, as a
    demotion would); none when it has no tier or no room."""
    if lmdb is not None and (lmdb.alloc.fits(size) or (yield from eviction.free_now(cat, lmdb, size))):
        yield Place(lmdb, size)


def make_room_for(cat: Catalog, nbytes: int) -> Decisions[None]:
    """Start demotions for `nbytes` that a batch could not place, from the emptiest segments on."""
    drams = sorted((s for s in cat.segments.values() if s.medium == "dram"),
                   key=lambda s: s.alloc.free_bytes + s.leaving_bytes, reverse=True)
    for seg in drams:
        if nbytes <= 0:
            break
        before = seg.leaving_bytes
        yield from eviction.make_room(cat, seg, nbytes)
        nbytes -= seg.leaving_bytes - before
