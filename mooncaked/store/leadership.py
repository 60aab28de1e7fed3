"""Store master leadership through etcd: campaign with a lease, keep it alive, step down.

etcd does the consensus; we only follow its rules. Each master holds one lease (TTL
`--etcd-lease-ttl-s`) and keeps it alive. The leader key (`PREFIX/leader`) is created only
when it does not exist (one txn on its create revision) and is attached to the creator's
lease, so at most one master holds it, and it vanishes when that master stops keeping its
lease alive (dead, frozen, cut off). Standbys publish themselves under `PREFIX/standbys/NAME`
(on their own leases) and watch the leader key; when it goes, they campaign again.

The leader key's value is the leader's `MasterInfo` (JSON): its gRPC address, fast path and
epoch, which is how clients following `--store etcd://...` find it (master_link.py).

Fencing (fencing.py): the leader writes only until the send time of its last successful
keepalive plus the TTL, less a margin; a keepalive that finds the lease gone deposes it at
once: it forgets every object (a new epoch) and stands by. A new leader starts empty and
learns the pool back from the clients' remounts and re-reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from mooncaked.store import metrics
from mooncaked.store.etcd_gateway import EtcdError, EtcdGateway
from mooncaked.store.fencing import Gate

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/mooncaked/store"
RETRY_S = 0.5  # after etcd failed us, before the next round
WATCH_S = 30.0  # a standby's watch of the leader key is reopened this often (every call has a deadline)


@dataclass(frozen=True)
class MasterInfo:
    """What a master publishes about itself in etcd."""

    name: str
    address: str  # gRPC HOST:PORT
    epoch: int = 0
    fast_path_port: int = 0
    fast_path_unix: str = ""
    host_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> MasterInfo | None:
        """None for a value that is not a master's (written by hand, or by something else)."""
        try:
            data = json.loads(raw)
            return cls(name=str(data.get("name", "")), address=str(data["address"]),
                       epoch=int(data.get("epoch", 0)), fast_path_port=int(data.get("fast_path_port", 0)),
                       fast_path_unix=str(data.get("fast_path_unix", "")), host_id=str(data.get("host_id", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def leader_key(prefix: str = DEFAULT_PREFIX) -> str:
    return prefix.rstrip("/") + "/leader"


def standbys_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return prefix.rstrip("/") + "/standbys/"


def fence_margin(ttl_s: float) -> float:
    """How long before the lease could expire the leader stops writing (clock rates, scheduling)."""
    return max(0.1, 0.2 * ttl_s)


class Leadership:
    """Campaigns for one master; `run()` as a background task, `resign()` when stopping.

    `gate`: what the master serves (moved between leader and standby here); `info()`: what
    to publish now (its epoch changes when it forgets); `forget()`: drop every object and
    client and end every stream (a deposed leader's metadata is stale); `on_lead()`: called as it
    starts to lead (the master holds back fresh DRAM places for a moment: StoreMaster.hold_dram_places)."""

    def __init__(self, etcd: EtcdGateway, gate: Gate, info: Callable[[], MasterInfo], forget: Callable[[], None],
                 prefix: str = DEFAULT_PREFIX, ttl_s: int = 2, on_lead: Callable[[], None] = lambda: None) -> None:
        self.etcd = etcd
        self.gate = gate
        self._info = info
        self._forget = forget
        self._on_lead = on_lead
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._lease = 0
        self._ttl = float(ttl_s)
        self._alive_from = 0.0  # send time of the lease's last confirmed grant or keepalive (monotonic)
        self.leading = False
        self.elections = 0
        self.elected_at = 0.0  # monotonic
        self.leader: MasterInfo | None = None  # the leader as last seen (ourselves when leading)
        self._etcd_down_since: float | None = None

    @property
    def name(self) -> str:
        return self._info().name

    async def run(self) -> None:
        metrics.IS_LEADER.set(0)
        while True:
            try:
                await self._round()
                self._etcd_up()
            except EtcdError as e:
                if "lease not found" in str(e):
                    self._lease = 0  # expired while we looked away: a new one, at once
                    continue
                self._etcd_failed(e)
                await asyncio.sleep(RETRY_S)

    def _etcd_failed(self, e: Exception) -> None:
        if self._etcd_down_since is None:
            self._etcd_down_since = time.monotonic()
            logger.warning("store master %s: etcd failed (%s); %s", self.name, e,
                           "serving reads, writes stop when the lease's margin runs out" if self.leading
                           else "standing by")

    def _etcd_up(self) -> None:
        if self._etcd_down_since is not None:
            logger.info("store master %s: etcd answers again (after %.1fs)", self.name,
                        time.monotonic() - self._etcd_down_since)
            self._etcd_down_since = None

    async def _grant(self) -> None:
        sent = time.monotonic()
        self._lease, ttl = await self.etcd.grant(self.ttl_s)
        self._ttl = float(ttl)
        self._alive_from = sent

    async def _round(self) -> None:
        """Campaign once; lead or stand by until that changes."""
        if not self._lease:
            await self._grant()
        me = self._info()
        won, holder = await self.etcd.create(leader_key(self.prefix), me.to_json(), self._lease)
        if won:
            await self._lead(me)
            return
        info = MasterInfo.from_json(holder.value) if holder is not None else None
        if holder is None:
            return  # it went between the compare and the read: campaign again
        await self._stand_by(me, info, holder.mod_revision)

    # -- standing by ---------------------------------------------------------------------------------
    async def _stand_by(self, me: MasterInfo, leader: MasterInfo | None, revision: int) -> None:
        self._follow(leader)
        await self.etcd.put(standbys_prefix(self.prefix) + me.name, me.to_json(), self._lease)
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep(self._ttl / 3, lost), name="store-lease-standby")
        try:
            while True:
                watching = asyncio.create_task(self._leader_gone(revision))
                await asyncio.wait([watching, keeper], return_when=asyncio.FIRST_COMPLETED)
                if not watching.done():
                    watching.cancel()
                    self._lease = 0  # our lease is gone: a new one, then campaign
                    return
                revision = watching.result()  # raises what the watch raised (etcd down: a new round)
                if revision < 0:
                    return  # the leader key went: campaign
        finally:
            keeper.cancel()

    async def _leader_gone(self, revision: int) -> int:
        """Watch the leader key from `revision` on (within WATCH_S); -1 once it is deleted, else the
        revision to watch from next."""
        key = leader_key(self.prefix)
        async for events in self.etcd.watch(key, revision + 1, WATCH_S):
            for e in events:
                revision = max(revision, e.kv.mod_revision)
                if e.kind == "delete":
                    logger.info("store master %s: the leader's key is gone; campaigning", self.name)
                    return -1
                self._follow(MasterInfo.from_json(e.kv.value))
        kv, rev = await self.etcd.get(key)
        if kv is None:
            return -1
        self._follow(MasterInfo.from_json(kv.value))
        return rev

    def _follow(self, leader: MasterInfo | None) -> None:
        if leader != self.leader or self.gate.leading:
            logger.info("store master %s: standing by; the leader is %s", self.name,
                        f"{leader.name} at {leader.address} (epoch {leader.epoch})" if leader else "unknown")
        self.leader = leader
        self.gate.stand_by(leader.address if leader else "")

    # -- leading ---------------------------------------------------------------------------------------
    async def _lead(self, me: MasterInfo) -> None:
        margin = fence_margin(self._ttl)
        self._on_lead()
        self.gate.lead(me.address, self._alive_from + self._ttl - margin)
        self.leading = True
        self.leader = me
        self.elections += 1
        self.elected_at = time.monotonic()
        metrics.IS_LEADER.set(1)
        metrics.LEADER_CHANGES.labels("elected").inc()
        logger.info("store master %s: leading at %s (epoch %d, etcd lease TTL %gs)", me.name, me.address, me.epoch,
                    self._ttl)
        try:
            await self.etcd.delete(standbys_prefix(self.prefix) + me.name)
        except EtcdError as e:
            logger.info("store master %s: could not remove its standby key (%s); it goes with the old lease",
                        me.name, e)
        lost = asyncio.Event()
        await self._keep(self._ttl / 4, lost)  # returns only when etcd says the lease is gone
        if self.leading:
            self._depose("its etcd lease is gone (expired while it was frozen or cut off)")

    def _depose(self, why: str) -> None:
        self.leading = False
        self._lease = 0
        self.gate.stand_by("")
        metrics.IS_LEADER.set(0)
        metrics.LEADER_CHANGES.labels("deposed").inc()
        logger.warning("store master %s: no longer the leader: %s; forgetting its metadata and standing by",
                       self.name, why)
        self._forget()

    async def _keep(self, interval_s: float, lost: asyncio.Event) -> None:
        """Keep the lease alive every `interval_s`; sets `lost` (and returns) when etcd says it is gone.
        While leading, each success moves the write fence forward."""
        margin = fence_margin(self._ttl)
        failing = False
        while True:
            await asyncio.sleep(interval_s)
            sent = time.monotonic()
            try:
                ttl = await self.etcd.keepalive(self._lease, timeout_s=max(interval_s, 0.2))
            except EtcdError as e:
                if not failing:
                    logger.warning("store master %s: lease keepalive failed (%s)%s", self.name, e,
                                   "; writes stop in %.1fs unless etcd answers" % max(
                                       0.0, self.gate.write_until - time.monotonic()) if self.leading else "")
                    failing = True
                continue
            if failing:
                logger.info("store master %s: lease keepalive works again%s", self.name,
                            "; writes resume" if self.leading else "")
                failing = False
            if ttl <= 0:
                lost.set()
                return
            self._alive_from = sent
            if self.leading:
                self.gate.confirm(sent + self._ttl - margin)

    async def resign(self, timeout_s: float = 1.0) -> None:
        """Stop leading (or standing by) now and drop our lease, so a standby takes over at once."""
        was = self.leading
        if was:
            self.leading = False
            self.gate.stand_by("")
            metrics.IS_LEADER.set(0)
            metrics.LEADER_CHANGES.labels("resigned").inc()
        if self._lease:
            try:
                await self.etcd.revoke(self._lease, timeout_s=timeout_s)
                logger.info("store master %s: %s; its etcd lease is revoked", self.name,
                            "resigned the leadership" if was else "left the standbys")
            except EtcdError as e:
                logger.warning("store master %s: could not revoke its etcd lease (%s); a standby takes over "
                               "when it expires", self.name, e)
            self._lease = 0
