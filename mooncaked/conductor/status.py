"""The cluster's one screen (`Status`, what `mooncakectl status` shows): the conductor itself,
the store master it follows with the KV pool's figures, and the instances.

The store master is asked for its `PoolStats` with a short deadline on every `Status`; a master
that does not answer shows as unreachable (with why), never as an error of the whole call:
the screen is most needed when something is down. Plain records: the gRPC front turns them
into a `StatusReply` (conductor/wire.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from mooncaked.conductor import metrics
from mooncaked.conductor.engine_link import InstanceLoad
from mooncaked.conductor.registry import PipelineMember, Registry
from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from mooncaked.security import Security
from mooncaked.store.master_link import MasterLink

log = logging.getLogger(__name__)

STORE_STATS_TIMEOUT_S = 2.0
"""How long Status waits for the store master's figures before showing it as unreachable."""
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


@dataclass
class ConductorInfo:
    """The conductor itself: where it listens, how it routes, what it is doing."""

    address: str = ""
    http_address: str = ""
    policy: str = ""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    requests_in_flight: int = 0
    rejections: int = 0
    state: str = ""  # readiness.py: "ready" | "starting" | "unavailable"
    ready_timeout_s: float = 0.0


@dataclass
class InstanceInfo:
    """One instance as the conductor sees it."""

    name: str
    role: str
    address: str
    state: str
    load: InstanceLoad
    uptime_s: float
    last_heartbeat_age_s: float
    model_id: str
    pipeline: PipelineMember | None = None  # a CPP group's stage
    lent_to: str = ""  # elastic CPP: the request whose lead borrowed it now ("": none)


@dataclass
class TierUse:
    """One tier of the KV pool (DRAM or LMDB), summed over its segments."""

    medium: str
    segments: int = 0
    used: int = 0
    capacity: int = 0
    objects: int = 0


@dataclass
class StoreInfo:
    """The store master the conductor follows, and the pool's figures (unset unless ``reachable``)."""

    address: str
    reachable: bool = False
    error: str = ""
    epoch: int = 0
    segments: int = 0
    objects: int = 0
    tiers: list[TierUse] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    clients: int = 0


@dataclass
class ClusterStatus:
    """The cluster's one screen."""

    instances: list[InstanceInfo]
    model_id: str
    uptime_s: float
    conductor: ConductorInfo
    store: StoreInfo | None = None  # None: the conductor knows no store master


def conductor_info(facts: ConductorFacts, state: str) -> ConductorInfo:
    return ConductorInfo(facts.address, facts.http_address, facts.policy, facts.ttft_slo_s, facts.tbt_slo_s,
                         metrics.requests_in_flight(), metrics.rejections_total(), state, facts.ready_timeout_s)


def instance_infos(registry: Registry) -> list[InstanceInfo]:
    now = time.monotonic()
    return [InstanceInfo(i.name, i.role, i.address, i.shown_state, i.load, now - i.registered_at,
                         now - i.last_heartbeat, i.model_id, i.pipeline, i.lent_to)
            for i in sorted(registry.instances.values(), key=lambda i: (i.role, i.name))]


def store_info(address: str, stats: store_pb2.PoolStatsReply) -> StoreInfo:
    """The pool's figures, with segments summed per tier."""
    tiers: dict[str, TierUse] = {}
    for seg in stats.segments:
        tier = tiers.setdefault(seg.medium, TierUse(medium=seg.medium))
        tier.segments += 1
        tier.used += seg.used
        tier.capacity += seg.capacity
        tier.objects += seg.objects
    ordered = sorted(tiers.values(), key=lambda t: (_TIER_ORDER.get(t.medium, len(_TIER_ORDER)), t.medium))
    return StoreInfo(address=address, reachable=True, epoch=stats.master_epoch, segments=len(stats.segments),
                     objects=stats.objects, tiers=ordered, hits=stats.hits, misses=stats.misses,
                     evictions=stats.evictions, clients=stats.clients)


class StoreProbe:
    """A channel to the store master for its figures; `close()` when done."""

    def __init__(self, address: str, timeout_s: float = STORE_STATS_TIMEOUT_S,
                 security: Security | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        # under HA (`etcd://...` or a list of masters) the link asks the leader (store/master_link.py)
        self.channel = MasterLink(address, security, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.stub = self.channel.stub

    async def info(self, with_stats: bool = True) -> StoreInfo:
        if not with_stats:
            return StoreInfo(address=self.address, error="not asked")
        try:
            stats = await self.stub.PoolStats(store_pb2.PoolStatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            why = ("no answer within %gs" % self.timeout_s if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                   else f"{e.code().name}: {e.details()}")
            log.debug("store master %s unreachable for Status: %s", self.address, why)
            return StoreInfo(address=self.address, reachable=False, error=why)
        return store_info(self.address, stats)

    async def close(self) -> None:
        await self.channel.close()
