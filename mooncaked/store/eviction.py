"""What leaves a full segment, and where it goes.

Approximate LRU: a round looks at the least recently used end of the segment's key order
(a bounded window, so a round costs O(window), not O(objects)) and takes victims until
about `evict_fraction` of the segment is freed below the high watermark. It never takes a
copy under a read lease, an uncommitted one, or one with a tier task in flight; soft-pinned
and hot objects go only in a second pass. A DRAM victim is demoted to its owner's LMDB tier
(a task; the DRAM bytes stay until the owner reports the copy done) unless another complete
copy exists or the owner has no LMDB tier, in which case it is dropped; LMDB victims are
dropped ("dropped from LMDB last").
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncaked.store import metrics, tiering
from mooncaked.store.records import RESERVED_PREFIX, ObjectMeta, Replica, Segment

if TYPE_CHECKING:
    from mooncaked.store.master import StoreMaster

logger = logging.getLogger(__name__)

SCAN_WINDOW = 1024
"""How many of a segment's least recently used keys one pass looks at."""


def evict_if_needed(m: StoreMaster, seg: Segment) -> None:
    """One eviction round if the segment (less what is already leaving) is above the high watermark."""
    hw = m.policy.high_watermark
    if seg.used - seg.leaving_bytes <= hw * seg.capacity:
        return
    target = (hw - m.policy.evict_fraction) * seg.capacity
    drop_places_ahead(m, seg, lambda: seg.used - seg.leaving_bytes <= target)
    _evict(m, seg, seg.used - seg.leaving_bytes - target)


def make_room(m: StoreMaster, seg: Segment, size: int) -> None:
    """Start moving enough out of a full segment that `size` bytes will fit once the moves finish.
    Counted against the largest hole, not all free bytes: scattered small holes do not fit `size`
    (retries move more out until the holes join)."""
    _evict(m, seg, size - seg.alloc.largest_free() - seg.leaving_bytes)


def _evict(m: StoreMaster, seg: Segment, need: float) -> None:
    if need <= 0:
        return
    freed = 0
    for pinned in (False, True):
        for obj, rep in _candidates(m, seg, pinned):
            if freed >= need:
                return
            freed += _evict_one(m, seg, obj, rep)
    if freed < need:
        logger.debug("segment %s stays above its watermark: %d bytes leased, busy or uncommitted",
                     seg.name, need - freed)


def drop_places_ahead(m: StoreMaster, seg: Segment, enough: Callable[[], bool]) -> None:
    """Give up places reserved ahead on the segment, newest first, until `enough()`: they hold no
    data (their writer falls back to a plain put), so they go before any object."""
    for key in reversed([k for k in m._pending if k.startswith(RESERVED_PREFIX)]):
        if enough():
            return
        obj = m.objects[key]
        if obj.replica_on(seg.name) is not None:
            m._forget(obj)


def free_now(m: StoreMaster, seg: Segment, size: int) -> bool:
    """Make a `size`-byte hole at once: places reserved ahead first, then copies that lose nothing
    (or that policy drops)."""
    drop_places_ahead(m, seg, lambda: seg.alloc.largest_free() >= size)
    lmdb = m._tier_of(seg.owner, "lmdb") if seg.medium == "dram" else None
    for pinned in (False, True):
        for obj, rep in _candidates(m, seg, pinned):
            if seg.alloc.largest_free() >= size:
                return True
            if lmdb is None or _copy_elsewhere(m, obj, rep):
                drop(m, seg, obj, rep)
    return seg.alloc.largest_free() >= size


def _candidates(m: StoreMaster, seg: Segment, pinned: bool) -> list[tuple[ObjectMeta, Replica]]:
    now = m.clock()
    out = []
    for key in itertools.islice(seg.keys, SCAN_WINDOW):
        obj = m.objects.get(key)
        if obj is None or not obj.committed or obj.busy or obj.lease_until > now:
            continue
        rep = obj.replica_on(seg.name)
        if rep is None or not rep.complete:
            continue
        if (obj.soft_pin or obj.hits >= m.policy.hot_hits) == pinned:
            out.append((obj, rep))
    return out


def _copy_elsewhere(m: StoreMaster, obj: ObjectMeta, rep: Replica) -> bool:
    return any(r is not rep and r.complete for r in obj.replicas)


def drop(m: StoreMaster, seg: Segment, obj: ObjectMeta, rep: Replica) -> int:
    m._drop_replica(obj, rep)
    m.evictions += 1
    metrics.EVICTIONS.labels(seg.medium, "drop").inc()
    return rep.size


def _evict_one(m: StoreMaster, seg: Segment, obj: ObjectMeta, rep: Replica) -> int:
    if seg.medium == "lmdb" or _copy_elsewhere(m, obj, rep):
        return drop(m, seg, obj, rep)
    lmdb = m._tier_of(seg.owner, "lmdb")
    if lmdb is None or not _demote(m, seg, lmdb, obj, rep):
        return drop(m, seg, obj, rep)
    return obj.size


def _demote(m: StoreMaster, seg: Segment, lmdb: Segment, obj: ObjectMeta, rep: Replica) -> bool:
    """Order the owner to copy `rep` to its LMDB tier; False when the tier has no room."""
    offset = lmdb.alloc.alloc(obj.size)
    if offset is None and free_now(m, lmdb, obj.size):
        offset = lmdb.alloc.alloc(obj.size)
    if offset is None:
        logger.info("LMDB tier %s is full of busy objects; cannot demote %s", lmdb.name, obj.key)
        return False
    obj.replicas.append(Replica(lmdb.name, offset, obj.size))
    lmdb.keys[obj.key] = None
    seg.leaving_bytes += obj.size
    tiering.new_task(m, "demote", seg.owner, obj, rep, lmdb.name, offset)
    return True


def evacuate(m: StoreMaster, seg: Segment) -> tuple[int, int]:
    """Demote every object that lives only on a DRAM segment (before its owner stops gracefully);
    leases do not hold this back: the DRAM copy stays readable until its move is done.
    Returns (demotions ordered, objects left behind for want of LMDB room)."""
    lmdb = m._tier_of(seg.owner, "lmdb")
    started = left = 0
    for key in list(seg.keys):
        obj = m.objects.get(key)
        rep = obj.replica_on(seg.name) if obj is not None else None
        if obj is None or rep is None or not obj.committed or not rep.complete or obj.busy:
            continue
        if _copy_elsewhere(m, obj, rep):
            continue
        if lmdb is not None and _demote(m, seg, lmdb, obj, rep):
            started += 1
        else:
            left += 1
    return started, left


