"""Where the store master is, and following it when it moves (store masters under HA).

`--store` takes three forms (`mooncaked.config.parse_store`):

- `HOST:PORT`: one master. `MasterLink.stub` is then a plain `StoreMasterStub` on one
  channel: nothing resolves, nothing retries, exactly as without HA.
- `A:PORT,B:PORT`: masters that elect a leader among themselves (through etcd); the leader
  is the one whose `Describe(any_role)` says so.
- `etcd://E1:PORT[,E2:PORT...][/PREFIX]`: etcd's leader key names the leader (leadership.py),
  and a watch on it tells us at once when it moves.

Following, `MasterLink.stub` stands in for a `StoreMasterStub`: `link.stub.Ping(req, timeout=T)`
goes to the current leader; a call that fails UNAVAILABLE (the master is gone, is a standby,
or is a leader unsure of its lease) re-resolves the leader and is tried again until its
deadline T, so `Mounts`, `TierWorker`, the client and the conductor's pool watch follow the
leader without knowing there is one. Streams (`Tasks`, `WatchPool`) open on the current
leader and end UNAVAILABLE when the leader moves; their owners reopen them, as they do
whenever a stream breaks. `on_change` callbacks hear of each new leader (the store client
remounts at once and reopens its fast path there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from mooncaked.config import HostPort, StoreTarget, parse_store
from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS, RPC_TIMEOUT_S
from mooncaked.security import Security
from mooncaked.store import metrics
from mooncaked.store.etcd_gateway import EtcdError, EtcdGateway
from mooncaked.store.leadership import MasterInfo, leader_key, standbys_prefix
from mooncaked.tasks import spawn

logger = logging.getLogger(__name__)

SERVICE = "mooncake.v1.StoreMaster"
_METHODS = store_pb2.DESCRIPTOR.services_by_name["StoreMaster"].methods_by_name
RETRY_S = 0.05  # between tries of a call while the leader is being found (doubling to RETRY_MAX_S)
RETRY_MAX_S = 0.25
ASK_S = 1.0  # how long one master (or etcd) gets to say who leads
WATCH_S = 30.0  # the watch on etcd's leader key is reopened this often (every call has a deadline)
STREAM_RESOLVE_S = 5.0
BOUND_TO_ONE_MASTER = frozenset({"PutEnd", "BatchPutEnd", "PutRevoke", "TaskDone"})
"""Calls that name what one master made (a started put, a reserved place, a tier task): sent to
another master they would commit nothing, or the wrong thing, so they are never retried on a new
leader (nor redirected there from the fast path); they fail, and the caller starts over."""  # how long a stream waits for a leader before it fails (its owner reopens it)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    """An error of the shape the real stubs raise, for callers that catch AioRpcError."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


class MasterLink:
    """The current store master (leader) for one `--store` target; `await close()` when done."""

    def __init__(self, target: str | HostPort | StoreTarget, security: Security | None = None,
                 options: list[tuple[str, Any]] | None = None) -> None:
        parsed = parse_store(str(target))
        self.target = str(parsed)
        self.security = security or Security()
        self._options = options if options is not None else CHANNEL_OPTIONS + RECONNECT_OPTIONS
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, store_pb2_grpc.StoreMasterStub] = {}
        self._raw: dict[tuple[str, str], Any] = {}
        self.etcd: EtcdGateway | None = None
        self.prefix = ""
        self.epoch = 0  # the leader's, as resolved (0: not known from the resolution)
        self.gen = 0  # counts leader changes
        self._callbacks: list[Callable[[str], None]] = []
        self._resolving: asyncio.Future | None = None
        self._suspect = False  # the current leader failed a call: ask who leads before the next
        self._watcher: asyncio.Task | None = None
        self._streams: set[_Stream] = set()
        self._trouble: tuple[float, int] | None = None  # (when calls began failing, gen then)
        self._closed = False
        if isinstance(parsed, StoreTarget):
            self.following = True
            self.masters = [str(m) for m in parsed.masters]
            if parsed.etcd:
                self.etcd = EtcdGateway([str(e) for e in parsed.etcd], self.security, timeout_s=ASK_S)
                self.prefix = parsed.prefix
            self.address = ""  # the current leader's gRPC address ("": not known yet)
            self.stub: Any = _FollowingStub(self)
        else:
            self.following = False
            self.masters = [str(parsed)]
            self.address = str(parsed)
            self.stub = self._stub_for(self.address)

    # -- channels ------------------------------------------------------------------------------------
    def _channel_for(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.security.channel(address, options=self._options)
        return channel

    def _stub_for(self, address: str) -> store_pb2_grpc.StoreMasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = store_pb2_grpc.StoreMasterStub(self._channel_for(address))
        return stub

    def _raw_method(self, address: str, name: str) -> Any:
        """`name` on `address` taking and giving bytes as they are (the fast path's redirect)."""
        fn = self._raw.get((address, name))
        if fn is None:
            fn = self._raw[(address, name)] = self._channel_for(address).unary_unary(f"/{SERVICE}/{name}")
        return fn

    def on_change(self, callback: Callable[[str], None]) -> None:
        """`callback(new leader address)` after each change of leader (not for a single master)."""
        self._callbacks.append(callback)

    async def close(self) -> None:
        self._closed = True
        for task in (self._watcher, self._resolving):
            if task is not None:
                task.cancel()
        for channel in self._channels.values():
            await channel.close()
        if self.etcd is not None:
            await self.etcd.close()

    # -- calls ---------------------------------------------------------------------------------------
    async def call(self, name: str, request: Any, timeout: float | None = None, raw: bool = False,
                   **kw: Any) -> Any:
        return (await self.call_at(name, request, timeout, raw, **kw))[0]

    async def call_at(self, name: str, request: Any, timeout: float | None = None, raw: bool = False,
                      **kw: Any) -> tuple[Any, str]:
        """(reply, the address that answered): on the leader, re-resolved and retried on UNAVAILABLE
        until `timeout` is spent. `raw`: `request` and the reply are bytes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else RPC_TIMEOUT_S)
        if not self.following:
            fn = self._raw_method(self.address, name) if raw else getattr(self.stub, name)
            return await fn(request, timeout=timeout, **kw), self.address
        self._watch_leader()
        pause = RETRY_S
        last: grpc.aio.AioRpcError | None = None
        first_gen = -1
        while True:
            if not self.address or self._suspect:
                await self._resolve(deadline)
            address, gen = self.address, self.gen
            if first_gen < 0 and address:
                first_gen = gen
            elif gen != first_gen and name in BOUND_TO_ONE_MASTER and last is not None:
                raise last  # the master this call was for is gone
            left = deadline - loop.time()
            if address and left > 0:
                fn = self._raw_method(address, name) if raw else getattr(self._stub_for(address), name)
                try:
                    reply = await fn(request, timeout=left, **kw)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    self._failed(gen)
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise  # its time is spent (a frozen master?): the next call asks who leads first
                    last = e
                else:
                    self._answered(gen)
                    return reply, address
            if loop.time() + pause >= deadline:
                raise last or _unavailable(f"no store master leads at {self.target} (none found within "
                                           f"{timeout if timeout is not None else RPC_TIMEOUT_S:g}s)")
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_MAX_S)

    async def describe(self, timeout: float) -> tuple[str, store_pb2.DescribeReply]:
        """The leader's Describe and its address (where its fast path listens)."""
        reply, address = await self.call_at("Describe", store_pb2.DescribeRequest(), timeout)
        return address, reply

    def suspect(self) -> None:
        """Something went wrong with the leader (a fast-path call got no answer): ask who leads
        before the next call, and in the background now."""
        if self.following and not self._closed:
            self._failed(self.gen)
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return
            self._start_resolve()

    def _failed(self, gen: int) -> None:
        if gen == self.gen:
            self._suspect = True
        if self._trouble is None:
            self._trouble = (time.monotonic(), gen)

    def _answered(self, gen: int) -> None:
        if self._trouble is not None:
            since, then = self._trouble
            self._trouble = None
            if gen != then:  # a new leader answered: the failover as this client saw it
                metrics.FAILOVER_SECONDS.observe(time.monotonic() - since)

    # -- finding the leader ----------------------------------------------------------------------------
    async def leader(self, timeout_s: float = ASK_S) -> str:
        """The leader's address, resolved now if not known ("" when none was found in time)."""
        if self.following and (not self.address or self._suspect):
            await self._resolve(asyncio.get_running_loop().time() + timeout_s)
        return self.address

    def _start_resolve(self) -> asyncio.Future:
        if self._resolving is None or self._resolving.done():
            self._resolving = asyncio.ensure_future(self._resolve_once())
        return self._resolving

    async def _resolve(self, deadline: float) -> None:
        """Ask who leads (one question in flight for all callers), waiting at most until `deadline`."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._start_resolve()), left)
        except asyncio.TimeoutError:
            pass

    async def _resolve_once(self) -> None:
        try:
            found = await self._find()
        except EtcdError as e:  # etcd is away: keep calling the leader we knew
            logger.debug("store master link %s: etcd did not say who leads (%s)", self.target, e)
            self._suspect = False
            return
        if found is not None:
            self._suspect = False
            self._switch(*found)

    async def _find(self) -> tuple[str, int] | None:
        """(address, epoch) of the leader now, or None when none leads."""
        if self.etcd is not None:
            kv, _ = await self.etcd.get(leader_key(self.prefix), timeout_s=ASK_S)
            info = MasterInfo.from_json(kv.value) if kv is not None else None
            return (info.address, info.epoch) if info is not None else None
        replies = await asyncio.gather(*(self._ask(a) for a in self.masters))
        leaders = [(a, r) for a, r in zip(self.masters, replies) if r is not None and r.role != "standby"]
        if not leaders:
            return None
        leaders.sort(key=lambda ar: not ar[1].writable)  # a leader sure of its lease first
        return leaders[0][0], leaders[0][1].master_epoch

    async def _ask(self, address: str) -> store_pb2.DescribeReply | None:
        try:
            return await self._stub_for(address).Describe(store_pb2.DescribeRequest(any_role=True), timeout=ASK_S)
        except grpc.aio.AioRpcError:
            return None

    def _switch(self, address: str, epoch: int) -> None:
        if address == self.address and (epoch == self.epoch or not epoch):
            return
        old = self.address
        self.address, self.epoch = address, epoch
        self.gen += 1
        if old:
            metrics.LEADER_FOLLOWS.inc()
            logger.warning("store master leader moved: %s -> %s (epoch %d)", old, address, epoch)
        else:
            logger.info("store master leader: %s (epoch %d), found through %s", address, epoch, self.target)
        for stream in list(self._streams):
            if stream.gen != self.gen:
                stream.move()
        for callback in self._callbacks:
            try:
                callback(address)
            except Exception:  # noqa: BLE001 - one owner's bug must not stop the others hearing
                logger.exception("store master link: a leader-change callback failed")

    def _watch_leader(self) -> None:
        """With etcd: a watch on the leader key, so a new leader is known at once (started lazily:
        it needs the running loop)."""
        if self.etcd is not None and self._watcher is None and not self._closed:
            self._watcher = spawn(self._watch(), f"store-leader-watch-{self.target}")

    async def _watch(self) -> None:
        assert self.etcd is not None
        key = leader_key(self.prefix)
        failing = False
        while not self._closed:
            try:
                kv, revision = await self.etcd.get(key, timeout_s=ASK_S)
                self._apply(kv.value if kv is not None else None)
                async for events in self.etcd.watch(key, revision + 1, WATCH_S):
                    for e in events:
                        self._apply(e.kv.value if e.kind == "put" else None)
                if failing:
                    logger.info("store master link %s: etcd answers again", self.target)
                    failing = False
            except EtcdError as e:
                if not failing:
                    logger.warning("store master link %s: cannot watch the leader in etcd (%s); retrying",
                                   self.target, e)
                    failing = True
                await asyncio.sleep(1.0)

    def _apply(self, value: bytes | None) -> None:
        info = MasterInfo.from_json(value) if value else None
        if info is not None:
            self._suspect = False
            self._switch(info.address, info.epoch)
        elif value is None and self.address:
            logger.info("store master link %s: the leader %s left; waiting for the next", self.target, self.address)


class _FollowingStub:
    """Stands in for a StoreMasterStub: each method goes through the link."""

    def __init__(self, link: MasterLink) -> None:
        self._link = link

    def __getattr__(self, name: str) -> Any:
        method = _METHODS.get(name)
        if method is None:
            raise AttributeError(f"StoreMaster has no method {name!r}")
        link = self._link
        if method.server_streaming:
            def fn(request: Any, **kw: Any) -> _Stream:
                return _Stream(link, name, request, kw)
        else:
            def fn(request: Any, timeout: float | None = None, **kw: Any) -> Any:
                return link.call(name, request, timeout, **kw)
        setattr(self, name, fn)  # looked up once
        return fn


class _Stream:
    """A server stream on the current leader: iterate it, `cancel()` it. When the leader moves, it
    ends with UNAVAILABLE (its owner reopens it, now on the new leader)."""

    def __init__(self, link: MasterLink, name: str, request: Any, kw: dict[str, Any]) -> None:
        self._link = link
        self._name = name
        self._request = request
        self._kw = kw
        self._call: Any = None
        self._moved = False
        self._cancelled = False
        self.gen = -1

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        link = self._link
        link._watch_leader()
        if not link.address or link._suspect:
            await link._resolve(asyncio.get_running_loop().time() + min(self._kw.get("timeout") or STREAM_RESOLVE_S,
                                                                        STREAM_RESOLVE_S))
        if not link.address:
            raise _unavailable(f"no store master leads at {link.target}")
        if self._cancelled:
            return
        self.gen = link.gen
        self._call = getattr(link._stub_for(link.address), self._name)(self._request, **self._kw)
        link._streams.add(self)
        try:
            async for msg in self._call:
                yield msg
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                link._failed(self.gen)
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._moved and not self._cancelled and (task is None or not task.cancelling()):
                raise _unavailable(f"the store master leader moved to {link.address}") from None
            raise
        finally:
            link._streams.discard(self)

    def cancel(self) -> bool:
        self._cancelled = True
        return self._call.cancel() if self._call is not None else False

    def move(self) -> None:
        self._moved = True
        if self._call is not None:
            self._call.cancel()


async def survey(target: str, security: Security | None = None, timeout_s: float = ASK_S) -> dict[str, Any]:
    """Who leads, who stands by and how etcd is, for `mooncakectl store` (plain data, JSON-ready).

    {"mode": "single" | "masters" | "etcd", "leader": {...} | None, "standbys": [{...}], "etcd": [...] | None};
    a master is {"name", "address", "epoch", "role", "writable"} plus "error" when it did not answer."""
    link = MasterLink(target, security)
    try:
        async def ask(address: str) -> dict[str, Any]:
            try:
                d = await link._stub_for(address).Describe(store_pb2.DescribeRequest(any_role=True), timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                return {"address": address, "role": "?", "error": f"{e.code().name}: {e.details()}"}
            return {"name": d.name, "address": address, "epoch": d.master_epoch, "role": d.role or "single",
                    "writable": d.writable if d.role else True, "leader": d.leader}

        if link.etcd is not None:
            etcd_state = await link.etcd.status(timeout_s)
            leader = standbys = None
            try:
                kv, _ = await link.etcd.get(leader_key(link.prefix), timeout_s)
                found = [MasterInfo.from_json(s.value)
                         for s in await link.etcd.get_prefix(standbys_prefix(link.prefix), timeout_s)]
            except EtcdError as e:
                return {"mode": "etcd", "leader": None, "standbys": [], "etcd": etcd_state, "error": str(e)}
            info = MasterInfo.from_json(kv.value) if kv is not None else None
            if info is not None:
                leader = {**await ask(info.address), "name": info.name, "epoch": info.epoch}
            standbys = [{**await ask(s.address), "name": s.name} for s in found if s is not None]
            return {"mode": "etcd", "leader": leader, "standbys": standbys, "etcd": etcd_state}
        masters = list(await asyncio.gather(*(ask(a) for a in link.masters)))
        leaders = [m for m in masters if m["role"] in ("leader", "single")]
        leaders.sort(key=lambda m: not m.get("writable"))
        leader = leaders[0] if leaders else None
        named = next((m["leader"] for m in masters if m.get("leader") and m["leader"] not in link.masters), "")
        if leader is None and named:  # a standby named at --store says who leads
            leader = await ask(named)
        return {"mode": "masters" if link.following else "single", "leader": leader,
                "standbys": [m for m in masters if m is not leader], "etcd": None}
    finally:
        await link.close()
