"""The cluster's one screen (`Status`, what `mooncakectl status` shows): the conductor itself,
the store master it follows with the KV pool's figures, and the instances.

The store master is asked for its `PoolStats` with a short deadline on every `Status`; a master
that does not answer shows as unreachable (with why), never as an error of the whole call:
the screen is most needed when something is down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from mooncaked.conductor import metrics
from mooncaked.conductor.registry import DEAD, Registry
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, store_pb2, store_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from mooncaked.security import Security

log = logging.getLogger(__name__)

STORE_STATS_TIMEOUT_S = 2.0
"""How long Status waits for the store master's figures before showing it as unreachable."""
_ROLE_ENUMS = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
_TIER_ORDER = {"dram": 0, "lmdb": 1}


@dataclass(frozen=True)
class ConductorFacts:
    """What the conductor is, as configured and bound (known once its servers listen)."""

    address: str = ""
    http_address: str = ""
    policy: str = ""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    ready_timeout_s: float = 0.0


def conductor_info(facts: ConductorFacts, state: str) -> conductor_pb2.ConductorInfo:
    return conductor_pb2.ConductorInfo(
        address=facts.address, http_address=facts.http_address, policy=facts.policy,
        ttft_slo_s=facts.ttft_slo_s or 0.0, tbt_slo_s=facts.tbt_slo_s or 0.0,
        requests_in_flight=metrics.requests_in_flight(), rejections=metrics.rejections_total(),
        state=state, ready_timeout_s=facts.ready_timeout_s)


def instance_infos(registry: Registry) -> list[conductor_pb2.InstanceInfo]:
    now = time.monotonic()
    return [
        conductor_pb2.InstanceInfo(
            name=i.name, role=_ROLE_ENUMS[i.role], address=i.address,
            state=common_pb2.INSTANCE_STATE_DRAINING if i.drained_by_operator and i.state != DEAD else i.state,
            load=i.load, uptime_s=now - i.registered_at, last_heartbeat_age_s=now - i.last_heartbeat,
            model_id=i.model_id)
        for i in sorted(registry.instances.values(), key=lambda i: (i.role, i.name))
    ]


def store_info(address: str, stats: store_pb2.PoolStatsReply) -> conductor_pb2.StoreInfo:
    """The pool's figures, with segments summed per tier."""
    tiers: dict[str, conductor_pb2.TierUse] = {}
    for seg in stats.segments:
        tier = tiers.setdefault(seg.medium, conductor_pb2.TierUse(medium=seg.medium))
        tier.segments += 1
        tier.used += seg.used
        tier.capacity += seg.capacity
        tier.objects += seg.objects
    ordered = sorted(tiers.values(), key=lambda t: (_TIER_ORDER.get(t.medium, len(_TIER_ORDER)), t.medium))
    return conductor_pb2.StoreInfo(
        address=address, reachable=True, epoch=stats.master_epoch, segments=len(stats.segments),
        objects=stats.objects, tiers=ordered, hits=stats.hits, misses=stats.misses, evictions=stats.evictions,
        clients=stats.clients)


class StoreProbe:
    """A channel to the store master for its figures; `close()` when done."""

    def __init__(self, address: str, timeout_s: float = STORE_STATS_TIMEOUT_S,
                 security: Security | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = (security or Security()).channel(address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.stub = store_pb2_grpc.StoreMasterStub(self.channel)

    async def info(self, with_stats: bool = True) -> conductor_pb2.StoreInfo:
        if not with_stats:
            return conductor_pb2.StoreInfo(address=self.address, error="not asked")
        try:
            stats = await self.stub.PoolStats(store_pb2.PoolStatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            why = ("no answer within %gs" % self.timeout_s if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                   else f"{e.code().name}: {e.details()}")
            log.debug("store master %s unreachable for Status: %s", self.address, why)
            return conductor_pb2.StoreInfo(address=self.address, reachable=False, error=why)
        return store_info(self.address, stats)

    async def close(self) -> None:
        await self.channel.close()
