"""Tier moves between a client's DRAM and LMDB, as tasks its owner carries out: a decider.

The master orders; the owner moves the bytes and reports (`StoreMaster.task_done`). A
promotion copies an LMDB-only object into its owner's DRAM so a reader can pull it through
transfer/; a demotion copies an evicted DRAM object to the owner's LMDB tier and frees the
DRAM copy when the owner says the copy is done; a persist makes the same copy right after the
object is committed but keeps the DRAM copy (which then leaves DRAM at no cost, and the
object survives its process); a delete drops an LMDB value (no answer).

Functions here yield `TierMove`s to start and, for a task that ended, the changes it brings
(`Complete`, `Drop`, `Evict`, `DeleteValue`); they change nothing themselves.
"""

from __future__ import annotations

import logging

from mooncaked.store import eviction
from mooncaked.store.catalog import Catalog
from mooncaked.store.decisions import Complete, Decisions, DeleteValue, Drop, Evict, TierMove
from mooncaked.store.errors import NoRoom
from mooncaked.store.records import ObjectMeta, Replica, Segment, Task

logger = logging.getLogger(__name__)


def promote(cat: Catalog, obj: ObjectMeta) -> Decisions[None]:
    """Copy an LMDB-only object into its owner's DRAM (the master then reads the task id off
    `obj.promotion`); NoRoom if no room can be made now (demotions started for a retry)."""
    for src in obj.replicas:
        seg = cat.segments[src.segment]
        dram = cat.tier_of(seg.owner, "dram")
        if not src.complete or dram is None:
            continue
        if not (dram.alloc.fits(obj.size) or (yield from eviction.free_now(cat, dram, obj.size))):
            yield from eviction.make_room(cat, dram, obj.size)
            continue
        yield TierMove("promote", obj, src, seg, dram)
        return
    raise NoRoom(f"{obj.key!r} is on LMDB only and its owner's DRAM has no room to serve it yet (objects are "
                 "being demoted, or leased); retry shortly")


def persist(cat: Catalog, obj: ObjectMeta, rep: Replica, seg: Segment) -> Decisions[None]:
    """Have the owner of DRAM copy `rep` copy it to its LMDB tier too; nothing when it has none, the
    object has an LMDB copy already, or the tier has no room that loses nothing."""
    lmdb = cat.tier_of(seg.owner, "lmdb")
    if lmdb is None or any(cat.segments[r.segment].medium == "lmdb" for r in obj.replicas if r.segment in cat.segments):
        return
    if not (lmdb.alloc.fits(obj.size) or (yield from eviction.free_now(cat, lmdb, obj.size))):
        logger.debug("LMDB tier %s has no room to persist %s; it stays in DRAM only", lmdb.name, obj.key)
        return
    yield TierMove("persist", obj, rep, seg, lmdb)


def settle(cat: Catalog, task: Task, obj: ObjectMeta | None, ok: bool, error: str) -> Decisions[None]:
    """What a task that ended (reported, timed out, or its segment went) changes; `obj`: its object,
    None if it is gone."""
    if task.kind in ("demote", "persist"):
        yield from _copy_done(cat, task, obj, ok, error)
        return
    dst = obj.replica_on(task.dst_segment) if obj is not None else None
    if ok and obj is not None and dst is not None:
        yield Complete(obj, dst, lease=-task.task_id)  # the waiting readers', until their lookups take their own
        return
    logger.warning("promotion of %s from %s failed: %s", task.key, task.src_segment, error or "gone")
    if obj is not None and dst is not None:
        yield Drop(obj, dst)
    src = obj.replica_on(task.src_segment) if obj is not None else None
    if obj is not None and src is not None and ("checksum" in error or "missing" in error):
        yield Drop(obj, src, send_delete=False)  # the owner deleted the corrupt value (or has none)


def _copy_done(cat: Catalog, task: Task, obj: ObjectMeta | None, ok: bool, error: str) -> Decisions[None]:
    """The owner copied (or failed to copy) a DRAM object to its LMDB tier: a demotion then frees the
    DRAM copy, a persist keeps it."""
    dst = obj.replica_on(task.dst_segment) if obj is not None else None
    src = obj.replica_on(task.src_segment) if obj is not None else None
    if ok and (obj is None or dst is None):
        lmdb = cat.segments.get(task.dst_segment)
        if lmdb is not None:  # removed meanwhile: the value the owner wrote is garbage
            yield DeleteValue(lmdb, task.key, task.size)
        return
    if obj is None or dst is None:
        return
    if ok:
        yield Complete(obj, dst)  # (a persist's: still in DRAM, nothing changes for readers)
        if task.kind == "demote" and src is not None and obj.lease_until <= cat.clock():
            yield Drop(obj, src)  # the move to LMDB is announced
        return
    logger.log(logging.INFO if error == "segment unmounted" else logging.WARNING, "%s of %s to %s failed: %s",
               "persisting" if task.kind == "persist" else "demotion", task.key, task.dst_segment, error)
    yield Drop(obj, dst)
    if task.kind == "persist":
        return  # the DRAM copy stays, as it was
    if src is not None and error != "segment unmounted" and cat.objects.get(obj.key) is obj:
        yield Evict(obj, src, cat.segments[src.segment])
