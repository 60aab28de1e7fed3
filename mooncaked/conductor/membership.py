"""The conductor's side of membership: engines register, heartbeat (load, KV events, decode step
times), deregister; operators drain them; silence marks them dead. Plain records in and out,
typed errors (conductor/errors.py) for what a front must refuse; ``Conductor`` (core.py) adds
the request path on top of this state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from mooncaked.conductor.engine_link import DRAINING, REMOVED, STORED, EngineError, Heartbeat, TransferEndpoint
from mooncaked.conductor.errors import AlreadyExists, BadRequest, FailedPrecondition, NotFound
from mooncaked.conductor.policies import LiveElasticShape, make_policy
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.conductor.readiness import ReadyGate
from mooncaked.conductor.registry import DEAD, Connect, Instance, PipelineMember, Registry
from mooncaked.conductor.router import SchedulerState
from mooncaked.conductor.status import ClusterStatus, ConductorFacts, StoreProbe, conductor_info, instance_infos
from mooncaked.engine.kv_cache import KVLayout

log = logging.getLogger(__name__)

DRAIN_CALL_TIMEOUT_S = 3.0  # the instance sets a flag; a stalled one is drained here anyway, and the
# operator's answer (mooncakectl waits 10 s) must not wait on it


@dataclass
class Registration:
    """An engine announcing itself, its KV geometry and its data-plane endpoint."""

    name: str
    role: str  # "prefill" | "decode" (anything else is refused)
    address: str  # where its engine service listens
    model_id: str
    layout: KVLayout
    transfer: TransferEndpoint = field(default_factory=TransferEndpoint)
    pipeline: PipelineMember | None = None  # one stage of a CPP prefill group
    step_tokens: int = 0  # the engine's step budget (0: not said): an elastic pipeline's chunk


def check_member(name: str, role: str, member: PipelineMember, registry: Registry) -> None:
    """A stage's registration must fit its group: prefill, a sane index, the same stage count as the
    others, and no other live instance in its place."""
    if role != "prefill":
        raise BadRequest("only prefill instances form pipeline groups")
    if not member.group or member.stages < 2 or not 0 <= member.stage < member.stages:
        raise BadRequest(f"pipeline stage {member.stage}/{member.stages} of group {member.group!r}: need a group name "
                         "and 0 <= K < N with N >= 2")
    for other in registry.group_members(member.group):
        if other.name == name or other.state == DEAD or other.pipeline is None:
            continue
        if other.pipeline.stages != member.stages:
            raise FailedPrecondition(f"group {member.group!r} has {other.pipeline.stages} stages ({other.name}); "
                                     f"{name} says {member.stages}")
        if other.pipeline.stage == member.stage:
            raise FailedPrecondition(f"stage {member.stage} of group {member.group!r} is {other.name}, alive")


class Membership:
    """The registry, prefix index, scheduler ledgers and readiness gate, kept true by the engines."""

    def __init__(self, model_id: str, block_size: int, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 connect: Connect | None = None, scheduler: SchedulerState | None = None,
                 ready_timeout_s: float = 0.0) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry = Registry(heartbeat_timeout_s, connect)
        self.index = PrefixIndex()
        self.watches_pool = False  # the index's POOL_HOLDER follows the store master (conductor/pool_watch.py)
        # the routing policy and its online time models (fed by heartbeats and prefill results)
        self.scheduler = scheduler or SchedulerState(make_policy("mooncake"))
        self.started = time.monotonic()
        # requests wait for a serving prefill and decode while the cluster starts (readiness.py)
        self.gate = ReadyGate(ready_timeout_s)
        self.facts = ConductorFacts(ready_timeout_s=ready_timeout_s)  # filled in once the fronts listen
        self.store: StoreProbe | None = None  # the store master whose figures status shows

    def register(self, r: Registration) -> float:
        """Admit an instance (a known name: a restart, with a fresh link); the heartbeat interval it must keep."""
        if r.role not in ("prefill", "decode"):
            raise BadRequest("only prefill and decode instances register")
        if not r.name or not r.address:
            raise BadRequest("name and address are required")
        if r.name == POOL_HOLDER:
            raise BadRequest(f"the name {POOL_HOLDER!r} is reserved for the KV pool in the prefix index; "
                             "give the instance another --name")
        holder = self.registry.taken(r.name, r.address)
        if holder is not None:
            raise AlreadyExists(f"{r.name} is registered and alive at {holder.address}; a name cannot be taken "
                                "over (a restarted instance at a new address is accepted once the old one is "
                                "counted dead)")
        if r.layout.block_size != self.block_size:
            raise FailedPrecondition(f"{r.name} uses block_size {r.layout.block_size}; this cluster uses "
                                     f"{self.block_size} (one block size per cluster)")
        if r.model_id != self.model_id:
            raise FailedPrecondition(f"{r.name} serves model {r.model_id!r}; this conductor serves {self.model_id!r}")
        if r.pipeline is not None:
            check_member(r.name, r.role, r.pipeline, self.registry)
        shape = getattr(self.scheduler.policy, "shape_for", None)
        if isinstance(shape, LiveElasticShape) and r.role == "prefill" and r.pipeline is None and r.step_tokens:
            shape.chunk_tokens = r.step_tokens  # (one engine config per cluster: the last one registered)
        self.index.drop_instance(r.name)  # a (re)started instance reports its cache afresh
        self.scheduler.forget(r.name)
        self.registry.register(Instance(r.name, r.role, r.address, r.model_id, r.layout, r.transfer,
                                        pipeline=r.pipeline))
        self.gate.note(self.registry)
        return self.heartbeat_interval_s

    def heartbeat(self, hb: Heartbeat) -> bool:
        """Record liveness, load and KV events; False: the instance is unknown (it must register again)."""
        inst = self.registry.heartbeat(hb.name, hb.load, hb.state, hb.drain_seq)
        if inst is None:
            return False
        self.gate.note(self.registry)
        for s in hb.decode_samples:
            self.scheduler.observe_decode(hb.name, s.batch, s.context_tokens, s.seconds)
        # a later CPP stage's cache is its layers of blocks the group's head also reports: the index keeps
        # the head's, so the group is one holder (and no peer is sent to a stage's partial blocks)
        events = hb.events if inst.pipeline is None or inst.pipeline.stage == 0 else []
        for e in events:
            holder = e.instance or hb.name
            if holder == POOL_HOLDER:
                continue  # the store master alone reports what the pool holds (pool_watch.py)
            if e.kind == STORED:
                self.index.stored(holder, list(e.block_hashes), e.medium or "dram")
            elif e.kind == REMOVED:
                self.index.removed(holder, list(e.block_hashes))
        self.scheduler.heard(hb.name)  # its events are in the index: prefills it finished settle
        return True

    def deregister(self, name: str) -> bool:
        """An instance leaves (clean shutdown); whether it was known."""
        inst = self.registry.remove(name)
        self.index.drop_instance(name)
        self.scheduler.forget(name)
        return inst is not None

    async def set_drain(self, name_or_address: str, drain: bool) -> tuple[str, str]:
        """Drain (or undrain) an instance by name or address: ``(its name, its state after)``."""
        inst = self.registry.resolve(name_or_address)
        if inst is None:
            known = ", ".join(f"{i.name} at {i.address}" for i in self.registry.instances.values()) or "none"
            raise NotFound(f"no instance named or at {name_or_address!r} (known: {known})")
        inst.drained_by_operator = drain
        if inst.link is not None:
            try:
                state, seq = await inst.link.drain(drain, DRAIN_CALL_TIMEOUT_S)
                if seq >= inst.drain_seq:  # (two drains at once: the later call's answer stands)
                    inst.state, inst.drain_seq = state, seq
            except EngineError as e:
                log.warning("could not tell %s to drain: %s", inst.name, e.kind)
        self.gate.note(self.registry)
        return inst.name, DRAINING if drain else inst.state

    async def status(self, with_pool_stats: bool = True) -> ClusterStatus:
        """The cluster's one screen; the store master's figures are asked for with a short deadline and
        show as unreachable when they do not come."""
        out = ClusterStatus(instance_infos(self.registry), self.model_id, time.monotonic() - self.started,
                            conductor_info(self.facts, self.gate.state(self.registry)))
        if self.store is not None:
            out.store = await self.store.info(with_stats=with_pool_stats)
        return out

    async def sweep_forever(self) -> None:
        """Mark instances dead whose heartbeats stopped, every heartbeat interval."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            stalled = now - last - self.heartbeat_interval_s
            last = now
            if stalled > self.heartbeat_interval_s:
                # this process did not run (SIGSTOP, a starved host): the heartbeats it could not read meanwhile
                # wait in its sockets, no instance's fault; silence is counted without the stall, or every
                # instance would be marked dead at once when it runs again
                for inst in self.registry.instances.values():
                    inst.last_heartbeat = min(now, inst.last_heartbeat + stalled)
            for inst in self.registry.sweep():
                self.index.drop_instance(inst.name)

    async def close(self) -> None:
        """Close every instance's link and the store probe (the conductor is stopping)."""
        await self.registry.close()
        if self.store is not None:
            await self.store.close()
