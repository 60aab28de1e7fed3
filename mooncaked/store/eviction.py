"""What leaves a full segment, and where it goes: a decider over the catalog.

Approximate LRU: a round looks at the least recently used end of the segment's key order
(a bounded window, so a round costs O(window), not O(objects)) and takes victims until
about `evict_fraction` of the segment is freed below the high watermark. It never takes a
copy under a read lease, an uncommitted one, or one with a tier task in flight; soft-pinned
and hot objects go only in a second pass. A DRAM victim is demoted to its owner's LMDB tier
(a task; the DRAM bytes stay until the owner reports the copy done) unless another complete
copy exists or the owner has no LMDB tier, in which case it is dropped; LMDB victims are
dropped ("dropped from LMDB last").

Every function here yields `Evict`/`DropPlace` decisions (`decisions.py`) and changes nothing:
the master applies each before the next is decided, as each frees room the next one counts.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from mooncaked.store.catalog import Catalog
from mooncaked.store.decisions import Decision, Decisions, DropPlace, Evict
from mooncaked.store.records import RESERVED_PREFIX, ObjectMeta, Replica, Segment

logger = logging.getLogger(__name__)

SCAN_WINDOW = 1024
"""How many of a segment's least recently used keys one pass looks at."""


def evict_if_needed(cat: Catalog, seg: Segment) -> Iterable[Decision]:
    """One eviction round if the segment (less what is already leaving) is above the high watermark
    (checked here, outside the round's generator: every put asks, and most ask in vain)."""
    if seg.used - seg.leaving_bytes <= cat.policy.high_watermark * seg.capacity:
        return ()
    return _round(cat, seg)


def _round(cat: Catalog, seg: Segment) -> Decisions[None]:
    target = (cat.policy.high_watermark - cat.policy.evict_fraction) * seg.capacity
    yield from drop_places_ahead(cat, seg, lambda: seg.used - seg.leaving_bytes <= target)
    yield from _evict(cat, seg, seg.used - seg.leaving_bytes - target)


def make_room(cat: Catalog, seg: Segment, size: int) -> Decisions[None]:
    """Start moving enough out of a full segment that `size` bytes will fit once the moves finish.
    Counted against the largest hole, not all free bytes: scattered small holes do not fit `size`
    (retries move more out until the holes join)."""
    yield from _evict(cat, seg, size - seg.alloc.largest_free() - seg.leaving_bytes)


def _evict(cat: Catalog, seg: Segment, need: float) -> Decisions[None]:
    if need <= 0:
        return
    freed = 0
    for pinned in (False, True):
        for obj, rep in _candidates(cat, seg, pinned):
            if freed >= need:
                return
            how = yield from _evict_one(cat, seg, obj, rep)
            freed += obj.size if how == "demote" else rep.size
    if freed < need:
        logger.debug("segment %s stays above its watermark: %d bytes leased, busy or uncommitted",
                     seg.name, need - freed)


def drop_places_ahead(cat: Catalog, seg: Segment, enough: Callable[[], bool]) -> Decisions[None]:
    """Give up places reserved ahead on the segment, newest first, until `enough()`: they hold no
    data (their writer falls back to a plain put), so they go before any object."""
    for key in reversed([k for k in cat.pending if k.startswith(RESERVED_PREFIX)]):
        if enough():
            return
        obj = cat.objects[key]
        if obj.replica_on(seg.name) is not None:
            yield DropPlace(obj)


def free_now(cat: Catalog, seg: Segment, size: int) -> Decisions[bool]:
    """Make a `size`-byte hole at once: copies that lose nothing (or that policy drops). Not places
    reserved ahead: a dropped place is free again only after its writer's window (records.
    DROPPED_PLACE_HOLD_S), so it makes no hole now; the watermark's round gives those up first.
    Returns whether the segment has the hole now."""
    lmdb = cat.tier_of(seg.owner, "lmdb") if seg.medium == "dram" else None
    for pinned in (False, True):
        for obj, rep in _candidates(cat, seg, pinned):
            if seg.alloc.fits(size):
                return True
            if lmdb is None or _copy_elsewhere(obj, rep):
                yield Evict(obj, rep, seg)
    return seg.alloc.fits(size)


def _candidates(cat: Catalog, seg: Segment, pinned: bool) -> list[tuple[ObjectMeta, Replica]]:
    now = cat.clock()
    out = []
    for key in itertools.islice(seg.keys, SCAN_WINDOW):
        obj = cat.objects.get(key)
        if obj is None or not obj.committed or obj.busy or obj.lease_until > now:
            continue
        rep = obj.replica_on(seg.name)
        if rep is None or not rep.complete:
            continue
        if (obj.soft_pin or obj.hits >= cat.policy.hot_hits) == pinned:
            out.append((obj, rep))
    return out


def _copy_elsewhere(obj: ObjectMeta, rep: Replica) -> bool:
    return any(r is not rep and r.complete for r in obj.replicas)


def _evict_one(cat: Catalog, seg: Segment, obj: ObjectMeta, rep: Replica) -> Decisions[str]:
    """Drop or demote one victim; returns how."""
    if seg.medium == "dram" and not _copy_elsewhere(obj, rep):
        lmdb = cat.tier_of(seg.owner, "lmdb")
        if lmdb is not None and (yield from _demote(cat, seg, lmdb, obj, rep)):
            return "demote"
    yield Evict(obj, rep, seg)
    return "drop"


def _demote(cat: Catalog, seg: Segment, lmdb: Segment, obj: ObjectMeta, rep: Replica) -> Decisions[bool]:
    """Order the owner to copy `rep` to its LMDB tier; False when the tier has no room."""
    if not (lmdb.alloc.fits(obj.size) or (yield from free_now(cat, lmdb, obj.size))):
        logger.info("LMDB tier %s is full of busy objects; cannot demote %s", lmdb.name, obj.key)
        return False
    yield Evict(obj, rep, seg, "demote", lmdb)
    return True


def evacuate(cat: Catalog, seg: Segment) -> Decisions[tuple[int, int]]:
    """Demote every object that lives only on a DRAM segment (before its owner stops gracefully);
    leases do not hold this back: the DRAM copy stays readable until its move is done.
    Returns (moves to wait for: demotions ordered and persists in flight, objects left behind for
    want of LMDB room)."""
    lmdb = cat.tier_of(seg.owner, "lmdb")
    started = left = 0
    for key in list(seg.keys):
        obj = cat.objects.get(key)
        rep = obj.replica_on(seg.name) if obj is not None else None
        if obj is None or rep is None or not obj.committed or not rep.complete:
            continue
        if obj.busy:
            if lmdb is not None and (dst := obj.replica_on(lmdb.name)) is not None and not dst.complete:
                started += 1  # being persisted there already: the owner's worker is on it
            continue
        if _copy_elsewhere(obj, rep):
            continue
        if lmdb is not None and (yield from _demote(cat, seg, lmdb, obj, rep)):
            started += 1
        else:
            left += 1
    return started, left
