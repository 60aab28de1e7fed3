"""Records <-> protobuf messages of store.proto, in one place."""

from __future__ import annotations

import functools
import logging

from mooncaked.proto.mooncake.v1 import common_pb2, store_pb2, transfer_pb2
from mooncaked.store.records import Endpoint, ObjectRecord, ObjectView, Placed, PoolStats, SegmentSpec, Task

logger = logging.getLogger(__name__)

TASK_KINDS = {
    "demote": store_pb2.TierTask.KIND_DEMOTE,
    "promote": store_pb2.TierTask.KIND_PROMOTE,
    "delete": store_pb2.TierTask.KIND_DELETE,
    "persist": store_pb2.TierTask.KIND_PERSIST,
}
TASK_KIND_NAMES = {v: k for k, v in TASK_KINDS.items()}


@functools.lru_cache(maxsize=4096)
def endpoint_to_proto(e: Endpoint) -> common_pb2.TransferEndpoint:
    """Made once per endpoint (every replica in every lookup reply carries one); callers copy it
    into their message and never change it."""
    return common_pb2.TransferEndpoint(address=e.address, backend=e.backend, region=e.region,
                                       same_host_id=e.same_host_id, shm_name=e.shm_name,
                                       key_server=e.key_server)


def endpoint_from_proto(p: common_pb2.TransferEndpoint) -> Endpoint:
    return Endpoint(p.address, p.backend, p.region, p.same_host_id, p.shm_name, p.key_server)


def segment_to_proto(spec: SegmentSpec, owner: str) -> transfer_pb2.SegmentInfo:
    return transfer_pb2.SegmentInfo(name=spec.name, owner=owner, endpoint=endpoint_to_proto(spec.endpoint),
                                    nbytes=spec.capacity, medium=spec.medium)


def segment_from_proto(p: transfer_pb2.SegmentInfo) -> SegmentSpec:
    return SegmentSpec(p.name, p.medium, p.nbytes, endpoint_from_proto(p.endpoint))


def record_to_proto(r: ObjectRecord) -> store_pb2.ObjectRecord:
    return store_pb2.ObjectRecord(key=r.key, offset=r.offset, size=r.size, checksum=r.checksum)


def record_from_proto(p: store_pb2.ObjectRecord) -> ObjectRecord:
    return ObjectRecord(p.key, p.offset, p.size, p.checksum)


def journal_to_proto(entries: list[tuple[str, int, int, int]], seq: int = 0, epoch: int = 0) -> store_pb2.TierTask:
    """A batch of (key, offset, size, checksum) journal entries as one KIND_JOURNAL message, numbered
    `seq` by master `epoch` (the owner acknowledges it: owner_server.py)."""
    return store_pb2.TierTask(kind=store_pb2.TierTask.KIND_JOURNAL, journal_seq=seq, master_epoch=epoch, journal=[
        store_pb2.JournalEntry(key=k, offset=o, size=n, checksum=c) for k, o, n, c in entries])


def placed_to_proto(p: Placed) -> store_pb2.Replica:
    return store_pb2.Replica(segment=p.segment.name, offset=p.replica.offset, size=p.replica.size,
                             endpoint=endpoint_to_proto(p.segment.endpoint), medium=p.segment.medium)


def view_to_proto(v: ObjectView) -> store_pb2.ObjectReplicas:
    return store_pb2.ObjectReplicas(key=v.key, replicas=[placed_to_proto(p) for p in v.replicas],
                                    checksum=v.checksum, size=v.size)


def task_to_proto(t: Task) -> store_pb2.TierTask:
    return store_pb2.TierTask(task_id=t.task_id, kind=TASK_KINDS[t.kind], key=t.key, size=t.size,
                              checksum=t.checksum, src_segment=t.src_segment, src_offset=t.src_offset,
                              dst_segment=t.dst_segment, dst_offset=t.dst_offset)


def stats_to_proto(s: PoolStats) -> store_pb2.PoolStatsReply:
    return store_pb2.PoolStatsReply(
        segments=[store_pb2.SegmentStats(name=u.name, owner=u.owner, medium=u.medium, capacity=u.capacity,
                                         used=u.used, objects=u.objects) for u in s.segments],
        objects=s.objects, hits=s.hits, misses=s.misses, evictions=s.evictions, demotions=s.demotions,
        promotions=s.promotions, master_epoch=s.epoch, clients=s.clients)
