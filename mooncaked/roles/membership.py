"""An engine's side of cluster membership: register with the conductor, then heartbeat with
load and KV events. A conductor that forgot us (restart) answers known=false and we
register again; an unreachable one is retried, never fatal."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RPC_TIMEOUT_S
from mooncaked.security import Security

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 100_000


class Membership:
    def __init__(self, conductor: str, register: Callable[[], conductor_pb2.RegisterRequest],
                 heartbeat: Callable[[], conductor_pb2.HeartbeatRequest], interval_s: float,
                 security: Security | None = None) -> None:
        self.conductor = conductor
        self._register = register
        self._heartbeat = heartbeat
        self.interval_s = interval_s
        self.channel = (security or Security()).channel(conductor, options=CHANNEL_OPTIONS)
        self.stub = conductor_pb2_grpc.ConductorStub(self.channel)
        self.registered = False
        self._pending_events: list[common_pb2.KVEvent] = []
        self._warned = False
        self._refused = ""  # the conductor's last refusal, logged once until it changes

    async def run(self) -> None:
        while True:
            try:
                await self._beat()
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS):
                    # a wrong secret, or our name still held by a live instance elsewhere (a restart
                    # at a new address, before the old one is counted dead): say so once, keep trying
                    level = logging.DEBUG if e.details() == self._refused else logging.WARNING
                    self._refused = e.details() or ""
                    log.log(level, "conductor %s refused us (%s): %s; retrying", self.conductor, e.code().name,
                            e.details())
                elif self.registered:
                    log.warning("heartbeat to %s failed: %s", self.conductor, e.code().name)
                elif not self._warned:  # once: a conductor that starts after us, or restarts, is normal
                    self._warned = True
                    log.warning("conductor %s (--conductor) is not reachable yet (%s); retrying until it is",
                                self.conductor, e.code().name)
                else:
                    log.debug("conductor %s not reachable yet (%s)", self.conductor, e.code().name)
            await asyncio.sleep(self.interval_s)

    async def _beat(self) -> None:
        if not self.registered:
            reply = await self.stub.Register(self._register(), timeout=RPC_TIMEOUT_S)
            self.interval_s = reply.heartbeat_interval_s or self.interval_s
            self.registered = True
            log.info("registered with conductor %s", self.conductor)
        hb = self._heartbeat()
        # events not yet acknowledged go out again, so the conductor's index misses nothing
        self._pending_events.extend(hb.events)
        if len(self._pending_events) > MAX_PENDING_EVENTS:
            log.warning("dropping %d unsent KV events", len(self._pending_events) - MAX_PENDING_EVENTS)
            del self._pending_events[:-MAX_PENDING_EVENTS]
        del hb.events[:]
        hb.events.extend(self._pending_events)
        reply = await self.stub.Heartbeat(hb, timeout=RPC_TIMEOUT_S)
        self._pending_events.clear()
        if not reply.known:
            log.warning("conductor %s does not know us; registering again", self.conductor)
            self.registered = False

    async def deregister(self, name: str) -> None:
        try:
            await self.stub.Deregister(conductor_pb2.DeregisterRequest(name=name), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("deregister from %s failed: %s", self.conductor, e.code().name)

    async def close(self) -> None:
        await self.channel.close()
