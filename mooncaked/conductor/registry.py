"""Which instances exist, what state they are in and how loaded they are.

Engines register and heartbeat; an instance whose heartbeats stop for
``heartbeat_timeout_s`` is marked dead, and a dead or draining one gets no new work.
A registration under a known name is a restarted process: it gets a fresh channel at once
(the old one, possibly in gRPC's reconnect backoff, is closed). ``changes`` wakes requests
that wait for an instance or for decode KV room (conductor/waiting.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from mooncaked.conductor.waiting import Changes
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS
from mooncaked.security import Security
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

SERVING = common_pb2.INSTANCE_STATE_SERVING
DRAINING = common_pb2.INSTANCE_STATE_DRAINING
DEAD = common_pb2.INSTANCE_STATE_DEAD
# in-flight calls on a replaced channel (a restarted instance's old process) get this long to end
OLD_CHANNEL_GRACE_S = 1.0
# each instance's channel owns its connections: with gRPC's process-wide subchannel pool a fresh channel
# to a restarted instance shares the old one's subchannel, still in reconnect backoff ("connection refused"
# for seconds after the instance is back). Reconnects are tried within a second, not after gRPC's two
# minutes; the connect timeout stays gRPC's 20 s (a stalled instance is waited for, not failed in 100 ms)
INSTANCE_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 100),
                                              ("grpc.max_reconnect_backoff_ms", 1000),
                                              ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Instance:
    name: str
    role: str  # "prefill" | "decode"
    address: str
    model_id: str
    layout: KVLayout
    transfer: common_pb2.TransferEndpoint
    registered_at: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    state: int = SERVING
    drained_by_operator: bool = False
    load: common_pb2.InstanceLoad = field(default_factory=common_pb2.InstanceLoad)
    channel: grpc.aio.Channel | None = None
    stub: engine_pb2_grpc.EngineStub | None = None
    inflight: int = 0  # requests the conductor has routed here and not yet seen finish
    dead_since: float | None = None  # when it was last marked dead

    @property
    def available(self) -> bool:
        return self.state == SERVING and not self.drained_by_operator


class Registry:
    def __init__(self, heartbeat_timeout_s: float, security: Security | None = None) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.security = security or Security()  # how the conductor dials instances (TLS, token)
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
            if old.channel is not None:
                # a new registration is a new process: the old channel may sit in reconnect backoff
                spawn(old.channel.close(OLD_CHANNEL_GRACE_S), f"close-channel-{old.name}")
        if inst.channel is None:
            inst.channel = self.security.channel(inst.address, options=INSTANCE_CHANNEL_OPTIONS)
            inst.stub = engine_pb2_grpc.EngineStub(inst.channel)
        self.instances[inst.name] = inst
        log.info("registered %s %s at %s", inst.role, inst.name, inst.address)
        self.changes.notify()

    def heartbeat(self, name: str, load: common_pb2.InstanceLoad, state: int) -> Instance | None:
        inst = self.instances.get(name)
        if inst is None:
            return None
        inst.last_heartbeat = time.monotonic()
        was_available, had_free = inst.available, inst.load.free_kv_blocks
        inst.load = load
        if inst.state == DEAD:
            log.info("%s is alive again", name)
        inst.state = state or SERVING
        if (inst.available and not was_available) or load.free_kv_blocks > had_free:
            self.changes.notify()  # requests waiting for an instance or for KV room try again
        return inst

    def remove(self, name: str) -> Instance | None:
        inst = self.instances.pop(name, None)
        if inst is not None:
            log.info("deregistered %s", name)
        return inst

    def mark_dead(self, name: str, why: str) -> None:
        inst = self.instances.get(name)
        if inst is not None and inst.state != DEAD:
            inst.state = DEAD
            inst.dead_since = time.monotonic()
            log.warning("%s marked dead: %s", name, why)

    def mark_lost(self, inst: Instance, why: str) -> None:
        """A call to ``inst`` found it unreachable: mark it dead, unless it has re-registered since
        (a late failure on the old process's channel says nothing about the new one)."""
        if self.instances.get(inst.name) is inst:
            self.mark_dead(inst.name, why)

    def lost_since(self, role: str, window_s: float) -> list[Instance]:
        """Instances of ``role`` marked dead less than ``window_s`` ago: a restart may bring them back."""
        now = time.monotonic()
        return [i for i in self.instances.values()
                if i.role == role and i.state == DEAD and i.dead_since is not None and now - i.dead_since < window_s]

    def sweep(self) -> None:
        """Mark instances dead whose heartbeats stopped."""
        now = time.monotonic()
        for inst in self.instances.values():
            if inst.state != DEAD and now - inst.last_heartbeat > self.timeout_s:
                self.mark_dead(inst.name, f"no heartbeat for {now - inst.last_heartbeat:.1f}s")

    def available(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role and i.available]

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
