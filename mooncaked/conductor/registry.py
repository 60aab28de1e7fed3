"""Which instances exist, what state they are in and how loaded they are.

Engines register and heartbeat; an instance whose heartbeats stop for
``heartbeat_timeout_s`` is marked dead, and a dead or draining one gets no new work.
A registration under a known name is a restarted process: it gets a fresh link at once
(the old one, possibly in its transport's reconnect backoff, is closed). ``changes`` wakes
requests that wait for an instance or for decode KV room (conductor/waiting.py). A prefill
instance lent to another's elastic CPP prefill (``lend``) takes no work of its own until the
lead's prefill ends (``give_back``).

The records are plain data; how an instance is reached is its ``EngineLink``, made by the
``connect`` function the registry is given (gRPC in the daemon, in-process in tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncaked.conductor.engine_link import DEAD, DRAINING, SERVING, STARTING, EngineLink, InstanceLoad, TransferEndpoint
from mooncaked.conductor.waiting import Changes
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.tasks import spawn

__all__ = ["DEAD", "DRAINING", "SERVING", "STARTING", "Connect", "Instance", "PipelineMember",
           "Registry"]

log = logging.getLogger(__name__)

# in-flight calls on a replaced link (a restarted instance's old process) get this long to end
OLD_LINK_GRACE_S = 1.0

Connect = Callable[[str, str], EngineLink]
"""``(name, address) -> link``: how the registry reaches a newly registered instance."""


@dataclass(frozen=True)
class PipelineMember:
    """An instance's place in a chunked-pipeline (CPP) prefill group: stage ``stage`` of ``stages``."""

    group: str
    stage: int
    stages: int
    chunk_tokens: int = 0  # the stages' --cpp-chunk-tokens (0: not said), for the group's time model


@dataclass
class Instance:
    name: str
    role: str  # "prefill" | "decode"
    address: str
    model_id: str
    layout: KVLayout
    transfer: TransferEndpoint = field(default_factory=TransferEndpoint)
    registered_at: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    state: str = SERVING
    drained_by_operator: bool = False
    drain_seq: int = 0  # the engine's number of our last Drain call: a heartbeat composed before it is stale
    load: InstanceLoad = field(default_factory=InstanceLoad)
    link: EngineLink | None = None
    inflight: int = 0  # requests the conductor has routed here and not yet seen finish
    dead_since: float | None = None  # when it was last marked dead
    pipeline: PipelineMember | None = None  # a stage of a CPP prefill group (the head, stage 0, is routed to)
    lent_to: str = ""  # elastic CPP: the request whose lead borrowed this instance for its prefill ("": none)

    @property
    def available(self) -> bool:
        return self.state == SERVING and not self.drained_by_operator

    @property
    def shown_state(self) -> str:
        """What status screens show: DRAINING while an operator drained it, unless it is dead."""
        return DRAINING if self.drained_by_operator and self.state != DEAD else self.state


class Registry:
    def __init__(self, heartbeat_timeout_s: float, connect: Connect | None = None) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.connect = connect  # None: instances come with their link (or need none)
        self.instances: dict[str, Instance] = {}
        self.changes = Changes()

    def taken(self, name: str, address: str) -> Instance | None:
        """The live instance that holds `name` at another address, if any: a name that is registered
        and alive cannot be taken over (a restart at a new address waits until the old one is dead)."""
        old = self.instances.get(name)
        if old is not None and old.state != DEAD and old.address != address:
            return old
        return None

    def register(self, inst: Instance) -> None:
        old = self.instances.get(inst.name)
        if old is not None:
            inst.drained_by_operator = old.drained_by_operator
            if old.link is not None and old.link is not inst.link:
                # a new registration is a new process: the old link may sit in reconnect backoff
                spawn(old.link.close(OLD_LINK_GRACE_S), f"close-link-{old.name}")
        if inst.link is None and self.connect is not None:
            inst.link = self.connect(inst.name, inst.address)
        self.instances[inst.name] = inst
        log.info("registered %s %s at %s", inst.role, inst.name, inst.address)
        self.changes.notify()

    def heartbeat(self, name: str, load: InstanceLoad, state: str, drain_seq: int = 0) -> Instance | None:
        """Liveness and load; the state too, unless the heartbeat was composed before our last Drain call's
        answer (it can arrive after it, and its state would undo that call until the next heartbeat)."""
        inst = self.instances.get(name)
        if inst is None:
            return None
        inst.last_heartbeat = time.monotonic()
        was_available, had_free = inst.available, inst.load.free_kv_blocks
        inst.load = load
        if inst.state == DEAD:
            log.info("%s is alive again", name)
        if drain_seq >= inst.drain_seq or inst.state == DEAD:
            inst.state = state or SERVING
        if (inst.available and not was_available) or load.free_kv_blocks > had_free:
            self.changes.notify()  # requests waiting for an instance or for KV room try again
        return inst

    def remove(self, name: str) -> Instance | None:
        inst = self.instances.pop(name, None)
        if inst is not None:
            log.info("deregistered %s", name)
            if inst.link is not None:
                spawn(inst.link.close(OLD_LINK_GRACE_S), f"close-link-{name}")
        return inst

    def mark_dead(self, name: str, why: str) -> None:
        inst = self.instances.get(name)
        if inst is not None and inst.state != DEAD:
            inst.state = DEAD
            inst.dead_since = time.monotonic()
            log.warning("%s marked dead: %s", name, why)

    def mark_lost(self, inst: Instance, why: str) -> None:
        """A call to ``inst`` found it unreachable: mark it dead, unless it has re-registered since
        (a late failure on the old process's link says nothing about the new one)."""
        if self.instances.get(inst.name) is inst:
            self.mark_dead(inst.name, why)

    def lost_since(self, role: str, window_s: float) -> list[Instance]:
        """Instances of ``role`` marked dead less than ``window_s`` ago: a restart may bring them back."""
        now = time.monotonic()
        return [i for i in self.instances.values()
                if i.role == role and i.state == DEAD and i.dead_since is not None and now - i.dead_since < window_s]

    def sweep(self) -> list[Instance]:
        """Mark instances dead whose heartbeats stopped; the ones marked now."""
        now = time.monotonic()
        died = []
        for inst in self.instances.values():
            if inst.state != DEAD and now - inst.last_heartbeat > self.timeout_s:
                self.mark_dead(inst.name, f"no heartbeat for {now - inst.last_heartbeat:.1f}s")
                died.append(inst)
        return died

    def available(self, role: str) -> list[Instance]:
        """Instances of ``role`` that take work now. A CPP group is one prefill unit, its head: only while
        every stage of it serves (a group missing a stage gets no work). A lent instance takes none."""
        out = []
        for i in self.instances.values():
            if i.role != role or not i.available or i.lent_to:
                continue
            if i.pipeline is not None and (i.pipeline.stage != 0 or self.stage_addresses(i) is None):
                continue
            out.append(i)
        return out

    def lend(self, names: tuple[str, ...] | list[str], request_id: str) -> bool:
        """Lend these single prefill instances to ``request_id``'s elastic prefill, all or none: False (and
        nothing lent) when one of them is gone, not serving, a group's stage, already lent, or has a prefill
        of its own on the way (``inflight``: routed, its booking may not have reached the policy's view)."""
        helpers = [self.instances.get(n) for n in names]
        if not all(h is not None and h.role == "prefill" and h.available and h.pipeline is None and not h.lent_to
                   and h.inflight == 0 for h in helpers):
            return False
        for h in helpers:
            h.lent_to = request_id  # type: ignore[union-attr]
        return True

    def give_back(self, request_id: str) -> None:
        """The lead's prefill of ``request_id`` ended (done, failed or cancelled): its helpers take work again."""
        back = [i for i in self.instances.values() if i.lent_to == request_id]
        for i in back:
            i.lent_to = ""
        if back:
            self.changes.notify()  # a request waiting for a prefill instance may go now

    def group_members(self, group: str) -> list[Instance]:
        """The registered stages of a CPP group, in stage order."""
        members = [i for i in self.instances.values() if i.pipeline is not None and i.pipeline.group == group]
        return sorted(members, key=lambda i: i.pipeline.stage)  # type: ignore[union-attr]

    def stage_addresses(self, head: Instance) -> list[str] | None:
        """The Engine addresses of a group head's later stages in order, or None unless every stage serves."""
        p = head.pipeline
        if p is None:
            return []
        members = {i.pipeline.stage: i for i in self.group_members(p.group)
                   if i.pipeline is not None and i.pipeline.stages == p.stages and i.available}
        if sorted(members) != list(range(p.stages)):
            return None
        return [members[k].address for k in range(1, p.stages)]

    def find(self, name: str) -> Instance | None:
        return self.instances.get(name)

    def resolve(self, name_or_address: str) -> Instance | None:
        """The instance with this name, else the one registered at this address (HOST:PORT) — what an
        operator reads off `mooncakectl status`. Several entries at one address (a restart under a new
        name) resolve to the live one registered last."""
        inst = self.instances.get(name_or_address)
        if inst is not None:
            return inst
        at = [i for i in self.instances.values() if i.address == name_or_address]
        return max(at, key=lambda i: (i.state != DEAD, i.registered_at), default=None)

    async def close(self) -> None:
        """Close every instance's link (the conductor is stopping)."""
        for inst in self.instances.values():
            if inst.link is not None:
                await inst.link.close()
