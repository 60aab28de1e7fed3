"""Tier moves between a client's DRAM and LMDB, as tasks its owner carries out.

The master orders; the owner moves the bytes and reports (`StoreMaster.task_done`). A
promotion copies an LMDB-only object into its owner's DRAM so a reader can pull it through
transfer/; a demotion copies an evicted DRAM object to the owner's LMDB tier and frees the
DRAM copy when the owner says the copy is done; a delete drops an LMDB value (no answer).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mooncaked.store import eviction, metrics
from mooncaked.store.errors import NoRoom
from mooncaked.store.records import ObjectMeta, PromotionPending, Replica, Task, TaskKind

if TYPE_CHECKING:
    from mooncaked.store.master import StoreMaster

logger = logging.getLogger(__name__)


def promote(m: StoreMaster, obj: ObjectMeta) -> PromotionPending:
    """Start (or join) copying an LMDB-only object into its owner's DRAM; NoRoom if none can be made now."""
    if obj.promotion:
        return PromotionPending(obj.promotion)
    for src in obj.replicas:
        seg = m.segments[src.segment]
        dram = m._dram_of(seg.owner)
        if not src.complete or dram is None:
            continue
        offset = dram.alloc.alloc(obj.size)
        if offset is None and eviction.free_now(m, dram, obj.size):
            offset = dram.alloc.alloc(obj.size)
        if offset is None:
            eviction.make_room(m, dram, obj.size)
            continue
        obj.replicas.append(Replica(dram.name, offset, obj.size))
        dram.keys[obj.key] = None
        task = new_task(m, "promote", seg.owner, obj, src, dram.name, offset)
        obj.promotion = task.task_id
        return PromotionPending(task.task_id)
    raise NoRoom(f"{obj.key!r} is on LMDB only and its owner's DRAM has no room to serve it yet (objects are "
                 "being demoted, or leased); retry shortly")


def new_task(m: StoreMaster, kind: TaskKind, client_id: str, obj: ObjectMeta, src: Replica, dst_segment: str = "",
             dst_offset: int = 0) -> Task:
    """Order a move; the object counts as busy (never evicted) until it settles."""
    task = Task(next(m._seq), kind, client_id, obj.key, obj.size, obj.checksum, src.segment, src.offset,
                dst_segment, dst_offset, m.clock() + m.policy.task_timeout_s)
    if kind != "delete":
        m.tasks[task.task_id] = task
        obj.busy += 1
    m.hooks.send_task(task)
    return task


def settle(m: StoreMaster, task: Task, ok: bool, error: str) -> None:
    """A task ended (reported, timed out, or its segment went): apply its outcome."""
    del m.tasks[task.task_id]
    obj = m.objects.get(task.key)
    if obj is not None:
        obj.busy -= 1
    if task.kind == "demote":
        demotion_done(m, task, obj, ok, error)
        return
    # promote
    if obj is not None and obj.promotion == task.task_id:
        obj.promotion = 0
    dst = obj.replica_on(task.dst_segment) if obj is not None else None
    if ok and obj is not None and dst is not None:
        dst.complete = True
        obj.lease_until = max(obj.lease_until, m.clock() + m.policy.lease_s)  # the waiting reader's
        m.promotions += 1
        metrics.PROMOTIONS.labels("ok").inc()
        m._announce(obj)  # back in DRAM
    else:
        metrics.PROMOTIONS.labels("failed").inc()
        logger.warning("promotion of %s from %s failed: %s", task.key, task.src_segment, error or "gone")
        if obj is not None and dst is not None:
            m._drop_replica(obj, dst)
        src = obj.replica_on(task.src_segment) if obj is not None else None
        if obj is not None and src is not None and "checksum" in error:
            m._drop_replica(obj, src, send_delete=False)  # the owner deleted the corrupt value
    m.hooks.promotion_settled(task.task_id, ok and dst is not None)


def demotion_done(m: StoreMaster, task: Task, obj: ObjectMeta | None, ok: bool, error: str) -> None:
    """The owner copied (or failed to copy) a DRAM object to its LMDB tier."""
    src_seg = m.segments.get(task.src_segment)
    if src_seg is not None:
        src_seg.leaving_bytes = max(0, src_seg.leaving_bytes - task.size)
    dst = obj.replica_on(task.dst_segment) if obj is not None else None
    src = obj.replica_on(task.src_segment) if obj is not None else None
    if ok and (obj is None or dst is None):
        lmdb = m.segments.get(task.dst_segment)
        if lmdb is not None:  # removed meanwhile: the value the owner wrote is garbage
            m.send_delete(lmdb.owner, task.key, lmdb.name, task.size)
        return
    if obj is None or dst is None:
        return
    if ok:
        dst.complete = True
        m.demotions += 1
        metrics.EVICTIONS.labels("dram", "demote").inc()
        if src is not None and obj.lease_until <= m.clock():
            m._drop_replica(obj, src)  # announces the move to LMDB
        else:
            m._announce(obj)  # still in DRAM while leased (or its DRAM copy went meanwhile)
        return
    logger.warning("demotion of %s to %s failed: %s", task.key, task.dst_segment, error)
    m._drop_replica(obj, dst)
    if src is not None and error != "segment unmounted" and m.objects.get(obj.key) is obj:
        eviction.drop(m, m.segments[src.segment], obj, src)
