"""The store client inside an engine process: lends DRAM and an LMDB tier to the pool, puts
and gets objects, and keeps its segments mounted across master restarts.

This file starts and stops the parts and runs the get path's lookups; the parts do the work:
- puts: writes.py (into places reserved ahead, places_ahead.py; commits behind, commits_behind.py);
- metadata calls to the master, on its fast path or gRPC: master_calls.py;
- reads: reads.py moves the bytes and checks each object's XXH3-64 before handing it over (a
  mismatch is a miss: the object is removed, logged and counted);
- lending: mounts.py keeps our segments mounted across master restarts, tier_worker.py carries out
  the master's moves between DRAM and LMDB (LMDB-held objects are promoted into their owner's DRAM
  first, so a reader always pulls from DRAM), owner_server.py serves our DRAM's objects by key.

A get of an object whose place the client already knows copies it while the lookup is in flight,
and keeps the copy only if it matches the checksum the lookup answers (hints.py); one whose owner
and checksum it knows is asked of that owner by key, without the master, when shared memory does
not reach it; one whose owner on this host lists it in its shared-memory index is copied with no
round trip at all (owner_index.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from mooncaked.security import Security
from mooncaked.startup import listening
from mooncaked.tasks import spawn
from mooncaked.store import heap, owner_index, pinned
from mooncaked.store.commits_behind import CommitsBehind
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import DRAM_REGION, STAGING_REGION, DramSegment, Staging
from mooncaked.store.hints import Hints
from mooncaked.store.reservations import Places
from mooncaked.store.errors import StoreError, StoreUnavailable, from_rpc_error
from mooncaked.store.lmdb_tier import LmdbTier
from mooncaked.store.master_calls import MasterCalls
from mooncaked.store.master_link import MasterLink, host_of
from mooncaked.store.master_watch import MasterWatch
from mooncaked.store.mounts import Mounts
from mooncaked.store.owner_link import OwnerLinks
from mooncaked.store.owner_index import IndexViews, OwnerIndex
from mooncaked.store.owner_server import OwnerServer, ServeWindow
from mooncaked.store.gets import Getter
from mooncaked.store.places_ahead import PlacesAhead
from mooncaked.store.reads import Reader
from mooncaked.store.recent_writes import KEEP_S, RecentWrites
from mooncaked.store.tier_worker import TierWorker
from mooncaked.store.writes import Data, Writer
from mooncaked.transfer import TransferEngine, TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StoreClientConfig:
    """What one client lends and how it talks to the master."""

    master: str  # "host:port" of the store master
    client_id: str  # stable across restarts (the engine's name): its segments are named after it
    dram_bytes: int = 0
    lmdb_path: str | None = None
    lmdb_bytes: int = 0
    staging_bytes: int = 64 << 20
    transfer_backend: str = "tcp"  # of the TransferEngine the client makes when none is handed to it
    replicas: int = 0  # 0: the master's default
    prefer_local: bool = False  # put the first copy in our own DRAM segment when it has room
    get_batch_keys: int = 64  # keys per BatchGetReplicas: what the master promotes and leases at once
    no_room_retry_s: float = 2.0  # a put that found no room is retried this long (the master is demoting)
    fast_path: bool = True  # metadata calls on the master's fast path when it offers one (else gRPC)
    reserve_ahead_bytes: int = 16 << 20  # places reserved ahead for single puts, per object size (0: none)
    location_hints: int = 65536  # objects whose last-seen place is kept, so a get copies during its lookup (0: off)
    owner_reads: bool = True  # serve our DRAM's objects by key, and get others' from their owner in one round trip
    owner_reads_port: int = 0  # where we serve them, on the data plane's host (0: any free port)
    # poll for an owner's answer this long before sleeping (owner_link.py; 0: off). For a client with no busy
    # thread beside its event loop (engines leave it off: the spin holds the GIL their engine thread needs), and
    # no owner on that loop (it could not answer while the client polls)
    owner_read_spin_us: int = 0
    # put() returns once its bytes landed (`bytes`: once handed over) and its commit is sent (commits_behind.py)
    commit_behind: bool = False
    keep_freed_heap: bool = True  # glibc keeps freed get results' memory for reuse, not faulted in again (heap.py)
    pin_staging: bool = False  # page-lock the staging area: a GPU engine's copies to and from it (pinned.py)
    ping_interval_s: float = 1.0
    rpc_timeout_s: float = 5.0
    transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.lmdb_bytes and not self.lmdb_path:
            raise ValueError("lmdb_bytes is set but lmdb_path is not: say where the LMDB tier lives")
        if self.lmdb_bytes and not self.dram_bytes:
            raise ValueError("an LMDB tier needs a DRAM segment too (store_dram_bytes > 0): LMDB objects are "
                             "served by promoting them into this client's DRAM")
        if self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")

    @classmethod
    def from_worker(cls, cfg, **overrides) -> StoreClientConfig:
        """From a `mooncaked.config.WorkerConfig` whose `store` names the master."""
        assert cfg.store is not None, "no store master configured"
        values = dict(master=str(cfg.store), client_id=cfg.name, dram_bytes=cfg.store_dram_bytes,
                      lmdb_path=cfg.store_lmdb_path, lmdb_bytes=cfg.store_lmdb_bytes if cfg.store_lmdb_path else 0,
                      ping_interval_s=cfg.heartbeat_interval_s, pin_staging=str(cfg.device).startswith("cuda"),
                      owner_reads_port=cfg.store_reads_port)
        values.update(overrides)
        return cls(**values)



class StoreClient:
    """One process's handle on the KV pool; `await start()` before use, `await close()` after."""

    def __init__(self, config: StoreClientConfig, transfer: TransferEngine | None = None,
                 security: Security | None = None) -> None:
        self.config = config
        self.security = security or Security()  # TLS and the cluster token toward the master
        self._own_transfer = transfer is None
        self.transfer = transfer or TransferEngine(backend=config.transfer_backend, host="127.0.0.1", port=0,
                                                   token=self.security.token)
        self._link: MasterLink | None = None  # where the master (the leader, under HA) is
        self.stub: store_pb2_grpc.StoreMasterStub | None = None
        self.dram: DramSegment | None = None
        self.staging: Staging | None = None
        self._unpin: Callable[[], None] | None = None  # unlocks the staging area (pin_staging)
        self.lmdb: LmdbTier | None = None
        self.mounts: Mounts | None = None
        self.worker: TierWorker | None = None
        self._tasks: list[asyncio.Task] = []
        self.calls: MasterCalls | None = None  # metadata calls to the master (master_calls.py)
        self.places = Places()  # places reserved ahead for single puts (places_ahead.py)
        self._ahead: PlacesAhead | None = None
        self.writer: Writer | None = None  # the put path (writes.py)
        self.getter: Getter | None = None  # the get path (gets.py)
        self._hints = Hints(config.location_hints)
        self._reader: Reader | None = None
        self._behind = CommitsBehind()  # single puts' commits in flight (commit_behind)
        self.owner_server: OwnerServer | None = None  # our DRAM's objects by key (owner_server.py)
        self._owner_links: OwnerLinks | None = None
        self._shm_host = ""  # our host id when shared memory reaches holders on it (they are read that way)
        self._index: OwnerIndex | None = None  # our DRAM's keys for readers on this host (owner_index.py)
        self._indexes: IndexViews | None = None  # owners' indexes on this host, mapped for our gets
        self._own_key_server = ""
        self._lmdb_thread = ThreadPoolExecutor(1, thread_name_prefix="store-lmdb")  # LMDB work, in order
        self.journal = DramJournal()  # what the master says our DRAM holds (re-reported at a remount)
        self.recent_writes = RecentWrites()  # our recent puts on others' DRAM (re-reported at a leader change)
        self._reporting: asyncio.Task | None = None
        self._watch: MasterWatch | None = None  # holds recent_writes while the master may be gone

    @property
    def dram_segment(self) -> str:
        return f"{self.config.client_id}/dram"

    async def start(self) -> None:
        """Lend the segments and mount them. May be called again after it raised (say, the master
        was not up yet): what the first call set up is kept, not made twice."""
        cfg = self.config
        if cfg.keep_freed_heap:
            heap.keep_freed_memory()
        if self._own_transfer and self.transfer.address is None:
            await self.transfer.start()
        if self.transfer.address is None:
            raise StoreError("the TransferEngine handed to StoreClient must be started first")
        if self.staging is None:
            self.staging = Staging(self.transfer, STAGING_REGION, cfg.staging_bytes)
            if cfg.pin_staging:
                self._unpin = pinned.pin(self.staging.tensor)
            self._owner_links = (OwnerLinks(self.security.token, cfg.transfer_timeout_s, cfg.owner_read_spin_us * 1e-6)
                                 if cfg.owner_reads else None)
            self._reader = Reader(self.transfer, self.staging, cfg.transfer_timeout_s, self.remove, self._owner_links)
            if self.transfer.backend in ("shm", "auto"):
                self._shm_host = self.transfer.info().host_id
                if cfg.owner_reads and owner_index.supported():
                    self._indexes = IndexViews()
        if cfg.dram_bytes and self.dram is None:
            self.dram = DramSegment(self.transfer, DRAM_REGION, cfg.dram_bytes)
            if cfg.owner_reads:
                self.owner_server = OwnerServer(self.dram, self.journal, ServeWindow(), self.security.token)
                host = host_of(self.transfer.address)
                with listening("--store-reads-port", (host, cfg.owner_reads_port)):  # a busy port: one line
                    self._own_key_server = await self.owner_server.start(host, cfg.owner_reads_port)
                self._publish_index()
        if cfg.lmdb_bytes and self.lmdb is None:
            loop = asyncio.get_running_loop()
            self.lmdb = await loop.run_in_executor(self._lmdb_thread, LmdbTier, cfg.lmdb_path, cfg.lmdb_bytes)
        if self._link is None:
            # one master: a plain stub on one channel; masters under HA: the link follows the leader
            self._link = MasterLink(cfg.master, self.security, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
            self.stub = self._link.stub

            def leader_moved(_address: str) -> None:  # remount there now, and reopen the fast path there
                self.places.forget()  # places the old leader reserved are free to the new one: never write them
                self._master_changing()
                if self.mounts is not None:
                    self.mounts.request_remount()
                self._report_soon()
                if self.calls is not None:
                    self.calls.leader_moved()

            self._link.on_change(leader_moved)
            self._watch = MasterWatch(self._link, self.recent_writes, lambda: self.places.epoch,
                                      self._report_now, cfg.client_id, cfg.ping_interval_s, cfg.rpc_timeout_s)
            self.calls = MasterCalls(self._link, self.security, cfg.client_id, self.places, fast_path=cfg.fast_path,
                                     timeout_s=cfg.rpc_timeout_s, suspect=self._watch.suspect)
            self._ahead = PlacesAhead(self.calls, self.places, cfg.client_id, cfg.reserve_ahead_bytes)
        if self.writer is None:
            assert self.calls is not None and self._ahead is not None and self.staging is not None
            self.writer = Writer(cfg, self.transfer, self.staging, self.calls, self._ahead, self._behind, self._hints,
                                 self.journal, self.recent_writes, self.dram_segment if self.dram else "", self.lmdb,
                                 self._lmdb_thread)
        if self.getter is None:
            assert self.calls is not None and self._reader is not None and self.staging is not None
            self.getter = Getter(cfg, self.calls, self._reader, self.staging, self._hints, self._behind,
                                 self._owner_links, self._indexes, self._shm_host, self._own_key_server)
        owner = self.owner_server
        assert self._watch is not None
        self.mounts = Mounts(cfg.client_id, self.stub, self.transfer, self.dram, self.lmdb, cfg.rpc_timeout_s,
                             self._lmdb_thread, self.journal, remounted=self._report_soon,
                             changing=self._master_changing, window=owner.window if owner else None,
                             unreachable=self._watch.suspect,
                             key_server=owner.address if owner else "")
        await self.mounts.mount_all()
        if self.dram is None and self.lmdb is None:
            # it lends nothing, so mounting asked the master nothing: ask it once, so that a master that
            # is not there is found now (a startup error the user can fix), not at the first get
            try:
                described = await self.stub.Describe(store_pb2.DescribeRequest(), timeout=cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e, "describe") from None
            self.places.follow(described.master_epoch)
        else:
            self.places.follow(self.mounts.epoch)  # the master our puts go to (master_watch.py compares)
        if self.dram is not None:  # a client that lends nothing needs no liveness and gets no tasks
            self.worker = TierWorker(cfg.client_id, self.stub, self.dram, self.lmdb, cfg.rpc_timeout_s,
                                     self.mounts.request_remount, self._lmdb_thread, self.journal,
                                     window=owner.window if owner else None)
            self._tasks = [spawn(self.mounts.keep_alive(cfg.ping_interval_s), f"store-ping-{cfg.client_id}"),
                           spawn(self.worker.receive(), f"store-tasks-{cfg.client_id}"),
                           spawn(self.worker.work(), f"store-tier-{cfg.client_id}")]
        logger.info("store client %s: master %s, DRAM %d bytes, LMDB %s (%d bytes), transfer %s", cfg.client_id,
                    cfg.master, cfg.dram_bytes, cfg.lmdb_path, cfg.lmdb_bytes, self.transfer.address)

    async def close(self, evacuate_timeout_s: float = 10.0) -> None:
        """Leave the pool and release everything. With an LMDB tier, what only our DRAM holds is first
        demoted to it (up to `evacuate_timeout_s`), so a restart on the same LMDB path brings it all back."""
        lost = await self._behind.flush()
        if lost:
            logger.warning("store client %s: %d puts were not stored (their commits failed)", self.config.client_id,
                           len(lost))
        if self.lmdb is not None and self.dram is not None and self.worker is not None:
            await self._evacuate(evacuate_timeout_s)
        if self._watch is not None:
            await self._watch.close()
        reporting = [self._reporting] if self._reporting is not None else []
        for t in [*self._tasks, *reporting]:
            t.cancel()
        await asyncio.gather(*self._tasks, *reporting, return_exceptions=True)
        if self._ahead is not None:
            await self._ahead.close()
        if self.owner_server is not None:
            await self.owner_server.close()
            if self._index is not None:
                self.journal.index = self.owner_server.window.index = None
                self._index.close()
                self._index = None
        if self._indexes is not None:
            self._indexes.close()
        if self._owner_links is not None:
            self._owner_links.close()
        if self.mounts is not None:
            await self.mounts.unmount_all()
        if self.calls is not None:
            self.calls.close()
        if self._link is not None:
            await self._link.close()
        if self.lmdb is not None:  # after any LMDB work still running in its thread
            await asyncio.get_running_loop().run_in_executor(self._lmdb_thread, self.lmdb.close)
        self._lmdb_thread.shutdown(wait=False)
        if self._unpin is not None:  # before the staging area's memory goes
            self._unpin()
            self._unpin = None
        if self._own_transfer:
            await self.transfer.close()
        else:
            for name in (DRAM_REGION, STAGING_REGION):
                try:
                    self.transfer.unregister(name)
                except TransferError:
                    pass

    async def _evacuate(self, timeout_s: float) -> None:
        """Ask the master to demote what only our DRAM holds, and wait until it says nothing is left in
        flight: a move it ordered may still be on the Tasks stream, so our own count of finished tasks
        cannot tell when all have landed (and a premature stop would lose them)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        request = store_pb2.EvacuateSegmentRequest(client_id=self.config.client_id, segment=self.dram_segment)
        ordered, reply = 0, None
        while True:
            try:
                reply = await self.calls.call("EvacuateSegment", request)
            except StoreError as e:
                logger.warning("could not move DRAM objects to LMDB before stopping: %s", e)
                return
            ordered = max(ordered, reply.demotions)
            if reply.demotions == 0 or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        logger.info("store client %s: DRAM objects moved to LMDB before stopping (%d moves ordered, %d still in "
                    "flight at the stop, %d left for want of room)", self.config.client_id, ordered,
                    reply.demotions, reply.left)

    # -- put (writes.py) ----------------------------------------------------------------------------
    async def put(self, key: str, data: Data, *, soft_pin: bool = False) -> bool:
        """Store one object; True when it is in the pool (now or already), False when there was no room."""
        return await self._writer().put(key, data, soft_pin=soft_pin)

    async def batch_put(self, items: Sequence[tuple[str, Data]], *, soft_pin: bool = False) -> list[bool]:
        """Store many objects; each True when it is in the pool, False when it found no room (retried for up
        to `no_room_retry_s` while the master moves older objects to LMDB)."""
        return await self._writer().batch_put(items, soft_pin=soft_pin)

    async def flush(self) -> list[str]:
        """Wait for the commits still in flight of puts made with `commit_behind`; returns the keys whose
        commit failed since the last flush (put() said True, but they are not stored)."""
        return await self._behind.flush()

    def _writer(self) -> Writer:
        assert self.writer is not None, "start() first"
        return self.writer

    def _master_changing(self) -> None:
        """A new master: nothing the old one ordered is carried out any more."""
        if self.worker is not None:
            self.worker.drop_queued()

    def _report_soon(self) -> None:
        """The master changed (a new leader, or a restart): re-report recent writes, once at a time."""
        if len(self.recent_writes) and (self._reporting is None or self._reporting.done()):
            self._reporting = spawn(self.report_recent_writes(), f"store-report-{self.config.client_id}")

    async def _report_now(self) -> None:
        """Re-report the recent writes now (master_watch.py), or wait for the re-report under way."""
        self._report_soon()
        if self._reporting is not None:
            await asyncio.shield(self._reporting)

    async def report_recent_writes(self, for_s: float = KEEP_S) -> None:
        """After a leader change: re-report our recent puts on other clients' DRAM (recent_writes.py),
        asking again while their owners have not remounted yet, for up to `for_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + for_s
        while loop.time() < deadline:
            pending = self.recent_writes.by_segment()
            if not pending:
                return
            for segment, writes in pending.items():
                request = store_pb2.ReportWritesRequest(client_id=self.config.client_id, segment=segment, objects=[
                    store_pb2.ObjectRecord(key=w.key, offset=w.offset, size=w.size, checksum=w.checksum)
                    for w in writes])
                try:
                    reply = await self.stub.ReportWrites(request, timeout=self.config.rpc_timeout_s)
                except grpc.aio.AioRpcError as e:
                    logger.debug("store client %s: re-reporting writes on %s: %s", self.config.client_id, segment,
                                 e.code().name)
                    continue
                if reply.segment_mounted:
                    self.recent_writes.settle(segment)
                    if reply.objects_accepted:
                        logger.info("store client %s: the new master took %d of our recent writes on %s back",
                                    self.config.client_id, reply.objects_accepted, segment)
            await asyncio.sleep(0.1)

    # -- get (gets.py) ------------------------------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss (absent, unreachable or failing its checksum)."""
        return await self._getter().get(key)

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each object's bytes or None."""
        return await self._getter().batch_get(keys)

    async def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the object into `out` (any layout, dtype or device; its bytes must equal the object's).
        A contiguous CPU tensor is read into directly (reads.py); on False its contents are undefined."""
        return await self._getter().get_into(key, out)

    async def batch_get_into(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Like get_into for many keys; one round trip to the master per piece, reads pipelined."""
        return await self._getter().batch_get_into(keys, outs)

    def _getter(self) -> Getter:
        assert self.getter is not None, "start() first"
        return self.getter

    def _publish_index(self) -> None:
        """Publish our DRAM's keys and serve window in shared memory, for readers on this host
        (owner_index.py): where shared memory reaches our DRAM and the CPU allows the table."""
        assert self.dram is not None and self.owner_server is not None
        region = self.transfer.info().regions.get(self.dram.name)
        if not region or not region.shm_name or not owner_index.supported():
            return
        try:
            self._index = OwnerIndex(region.shm_name, owner_index.slots_for(self.dram.nbytes))
        except (OSError, TransferError) as e:
            logger.warning("store client %s: no owner index in shared memory (%s); readers here ask the master",
                           self.config.client_id, e)
            return
        self.journal.index = self.owner_server.window.index = self._index

    # -- queries ------------------------------------------------------------------------------------
    async def exist(self, key: str) -> bool:
        await self._behind.sent()
        return (await self.calls.call("Exist", store_pb2.ExistRequest(key=key))).exists

    async def batch_exist(self, keys: Sequence[str]) -> list[bool]:
        await self._behind.sent()
        reply = await self.calls.call("BatchExist", store_pb2.BatchExistRequest(keys=list(keys)))
        return list(reply.exists)

    async def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys of a block-hash chain the pool holds (the reusable prefix, in blocks)."""
        await self._behind.sent()
        reply = await self.calls.call("LongestPrefix", store_pb2.LongestPrefixRequest(keys=list(keys)))
        return reply.num_keys

    async def remove(self, keys: Sequence[str]) -> int:
        await self._behind.sent()
        self._hints.forget(keys)
        reply = await self.calls.call("Remove", store_pb2.RemoveRequest(keys=list(keys)))
        return reply.removed

    async def pool_stats(self) -> store_pb2.PoolStatsReply:
        return await self.calls.call("PoolStats", store_pb2.PoolStatsRequest())



__all__ = ["StoreClient", "StoreClientConfig", "StoreError", "StoreUnavailable"]
