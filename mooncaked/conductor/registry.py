"""Which instances exist, what state they are in and how loaded they are.

Engines register and heartbeat; an instance whose heartbeats stop for
``heartbeat_timeout_s`` is marked dead, and a dead or draining one gets no new work.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from mooncaked.engine.kv_cache import KVLayout
from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

SERVING = common_pb2.INSTANCE_STATE_SERVING
DRAINING = common_pb2.INSTANCE_STATE_DRAINING
DEAD = common_pb2.INSTANCE_STATE_DEAD


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

    @property
    def available(self) -> bool:
        return self.state == SERVING and not self.drained_by_operator


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.instances: dict[str, Instance] = {}

    def register(self, inst: Instance) -> None:
        old = self.instances.get(inst.name)
        if old is not None:
            inst.drained_by_operator = old.drained_by_operator
            if old.channel is not None and old.address != inst.address:
                spawn(old.channel.close(), f"close-channel-{old.name}")
            elif old.channel is not None:
                inst.channel, inst.stub = old.channel, old.stub
        if inst.channel is None:
            inst.channel = grpc.aio.insecure_channel(inst.address, options=CHANNEL_OPTIONS)
            inst.stub = engine_pb2_grpc.EngineStub(inst.channel)
        self.instances[inst.name] = inst
        log.info("registered %s %s at %s", inst.role, inst.name, inst.address)

    def heartbeat(self, name: str, load: common_pb2.InstanceLoad, state: int) -> Instance | None:
        inst = self.instances.get(name)
        if inst is None:
            return None
        inst.last_heartbeat = time.monotonic()
        inst.load = load
        if inst.state == DEAD:
            log.info("%s is alive again", name)
        inst.state = state or SERVING
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
            log.warning("%s marked dead: %s", name, why)

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
