"""Where a new object's copies go: distinct DRAM segments, the most free space first.

Never two copies on one segment (each segment is tried once); the writer's preferred
segment, when named, goes first. A segment too full for the object first drops what loses
nothing (`eviction.free_now`); failing that, it starts demotions so a retry will fit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mooncaked.store import eviction
from mooncaked.store.records import Placed, Replica, Segment

if TYPE_CHECKING:
    from mooncaked.store.master import StoreMaster

logger = logging.getLogger(__name__)


def place(m: StoreMaster, drams: Sequence[Segment], size: int, want: int, preferred: Segment | None,
          make_room: bool, evict: bool = True) -> list[Placed]:
    """Allocate up to `want` copies of `size` bytes on distinct segments; [] when none has room.
    `evict=False`: free space only (a place reserved ahead must not push objects out)."""
    order = sorted(drams, key=lambda s: s.alloc.free_bytes, reverse=True)
    if preferred is not None:
        order.remove(preferred)
        order.insert(0, preferred)
    placed: list[Placed] = []
    ceiling = m.policy.high_watermark
    for seg in order:
        if len(placed) == want:
            break
        if not evict and seg.used + size > ceiling * seg.capacity:
            continue  # a place reserved ahead never takes a segment past its watermark (it would push data out)
        offset = seg.alloc.alloc(size)
        if offset is None and evict and eviction.free_now(m, seg, size):
            offset = seg.alloc.alloc(size)
        if offset is None:
            if make_room:
                eviction.make_room(m, seg, size)
            continue
        placed.append(Placed(Replica(seg.name, offset, size), seg))
    assert len({p.segment.name for p in placed}) == len(placed), "two copies on one segment"
    return placed


def make_room_for(m: StoreMaster, nbytes: int) -> None:
    """Start demotions for `nbytes` that a batch could not place, from the emptiest segments on."""
    drams = sorted((s for s in m.segments.values() if s.medium == "dram"),
                   key=lambda s: s.alloc.free_bytes + s.leaving_bytes, reverse=True)
    for seg in drams:
        if nbytes <= 0:
            break
        before = seg.leaving_bytes
        eviction.make_room(m, seg, nbytes)
        nbytes -= seg.leaving_bytes - before
