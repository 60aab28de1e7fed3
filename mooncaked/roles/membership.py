"""An engine's side of cluster membership on the wire: register with each conductor listed
(`--conductor A,B`), then send it the heartbeats that `instance/heartbeat.py` builds (its
`HeartbeatFeed` decides what each conductor gets). Each conductor has its own loop: one that is down
or slow never delays the others' heartbeats.

A conductor that forgot us (restart) answers known=false and we register again, and it then starts
from a snapshot of the cache. An unreachable conductor is retried, never fatal."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from mooncaked.conductor.engine_link import Heartbeat
from mooncaked.conductor.wire import heartbeat_to_proto
from mooncaked.instance.heartbeat import HeartbeatFeed, Snapshot
from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS, RPC_TIMEOUT_S
from mooncaked.security import Security
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

# Roles started together (`--role all`, or systemd starting every unit at once) come up in any order: an
# engine may try a conductor that is still loading. Only a conductor still away after this long is worth a
# WARNING; before it, the engine's tries are logged at DEBUG.
STARTUP_GRACE_S = 10.0


class Membership:
    """Membership with one conductor: register, then heartbeat its backlog, forever."""

    def __init__(self, conductor: str, register: Callable[[], conductor_pb2.RegisterRequest],
                 feed: HeartbeatFeed, interval_s: float, security: Security | None = None) -> None:
        self.conductor = conductor
        self._register = register
        self.feed = feed
        self.backlog = feed.subscribe(conductor)
        self.interval_s = interval_s
        # a restarted conductor is found again within a second, not after gRPC's backoff of up to 2 minutes
        self.channel = (security or Security()).channel(conductor, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.stub = conductor_pb2_grpc.ConductorStub(self.channel)
        self.registered = False
        self._warned = False
        self._away_since: float | None = None  # first failed try before we registered
        self._failing = False  # heartbeats fail: said once, then quiet until one gets through
        self._refused = ""  # the conductor's last refusal, logged once until it changes
        self.last_error = ""  # why the last try failed, for a startup that gives up (`Memberships.joined`)
        self.registered_event = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                await self._beat()
                if self._failing:
                    log.info("heartbeats reach conductor %s again", self.conductor)
                self._failing = False
            except grpc.aio.AioRpcError as e:
                self.last_error = f"{e.code().name}: {e.details()}" if e.details() else e.code().name
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS):
                    # a wrong secret, or our name still held by a live instance elsewhere (a restart
                    # at a new address, before the old one is counted dead): say so once, keep trying
                    level = logging.DEBUG if e.details() == self._refused else logging.WARNING
                    self._refused = e.details() or ""
                    log.log(level, "conductor %s refused us (%s): %s; retrying", self.conductor, e.code().name,
                            e.details())
                elif self.registered:
                    level = logging.DEBUG if self._failing else logging.WARNING
                    self._failing = True
                    log.log(level, "heartbeat to %s failed: %s; retrying", self.conductor, e.code().name)
                elif not self._warned and self._away_for() >= STARTUP_GRACE_S:
                    self._warned = True  # once: a conductor that starts after us, or restarts, is normal
                    log.warning("conductor %s (--conductor) is not reachable yet (%s, for %.0fs); retrying "
                                "until it is", self.conductor, e.code().name, self._away_for())
                else:
                    log.debug("conductor %s not reachable yet (%s)", self.conductor, e.code().name)
            await asyncio.sleep(self.interval_s)

    def _away_for(self) -> float:
        """Seconds since the first failed try to register (0 at that try)."""
        now = time.monotonic()
        if self._away_since is None:
            self._away_since = now
        return now - self._away_since

    async def _beat(self) -> None:
        if not self.registered:
            reply = await self.stub.Register(self._register(), timeout=RPC_TIMEOUT_S)
            self.interval_s = reply.heartbeat_interval_s or self.interval_s
            self.registered = True
            self._away_since = None
            self.registered_event.set()
            log.info("registered with conductor %s", self.conductor)
            await self.feed.resync(self.backlog)
        hb = self.feed.beat(self.backlog)
        reply = await self.stub.Heartbeat(heartbeat_to_proto(hb), timeout=RPC_TIMEOUT_S)
        self.feed.acknowledged(self.backlog, hb)
        if not reply.known:
            log.warning("conductor %s does not know us; registering again", self.conductor)
            self.registered = False
            self.feed.forget(self.backlog)

    async def deregister(self, name: str) -> None:
        try:
            await self.stub.Deregister(conductor_pb2.DeregisterRequest(name=name), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("deregister from %s failed: %s", self.conductor, e.code().name)

    async def close(self) -> None:
        await self.channel.close()


class Memberships:
    """An engine's membership with every conductor listed, each on its own loop (`start`)."""

    def __init__(self, conductors: Sequence[str], register: Callable[[], conductor_pb2.RegisterRequest],
                 heartbeat: Callable[[], Heartbeat], interval_s: float,
                 security: Security | None = None, snapshot: Snapshot | None = None) -> None:
        if not conductors:
            raise ValueError("at least one conductor is needed")
        self.feed = HeartbeatFeed(heartbeat, snapshot)
        self.members = [Membership(c, register, self.feed, interval_s, security) for c in conductors]

    @property
    def interval_s(self) -> float:
        """The longest heartbeat interval any conductor asked for."""
        return max(m.interval_s for m in self.members)

    def start(self) -> list[asyncio.Task]:
        return [spawn(m.run(), f"membership-{m.conductor}") for m in self.members]

    async def joined(self, timeout_s: float) -> str | None:
        """Wait until some conductor accepted our registration: None, or after ``timeout_s`` the one
        line that says which conductors did not and why (a startup the user can fix: a conductor
        not running, a wrong address or secret). Later losses of a conductor are not startup errors:
        memberships keep retrying for the life of the process."""
        waits = [asyncio.ensure_future(m.registered_event.wait()) for m in self.members]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if done:
            return None
        why = "; ".join(f"{m.conductor} {m.last_error or 'did not answer'}" for m in self.members)
        return (f"no conductor accepted this engine within {timeout_s:g}s (--conductor: {why}); "
                f"start the conductor or fix the address or secret (--join-timeout-s sets the wait)")

    async def deregister(self, name: str, timeout_s: float) -> None:
        """Leave every conductor at once; one that does not answer in ``timeout_s`` delays no other."""

        async def leave(m: Membership) -> None:
            if not m.registered_event.is_set():
                return  # it never took us: nothing to leave, and no warning about a conductor that is not there
            try:
                await asyncio.wait_for(m.deregister(name), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: conductor %s did not answer Deregister in %.0fs", name, m.conductor, timeout_s)

        await asyncio.gather(*(leave(m) for m in self.members))

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.members))
