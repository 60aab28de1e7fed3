"""The store client inside an engine process: lends DRAM and an LMDB tier to the pool, puts
and gets objects, and keeps its segments mounted across master restarts.

Bytes move only through `transfer/`: a put gathers the object in the staging area and
writes it into the segments the master picked; a get reads it from a DRAM copy into the
staging area and checks its XXH3-64 before handing it over (a mismatch is a miss: the
object is removed, logged and counted). LMDB-held objects are promoted by their owner
into its DRAM segment first (see tier_worker.py), so a reader always pulls from DRAM.
A get of an object whose place the client already knows copies it while the lookup is in
flight, and keeps the copy only if it matches the checksum the lookup answers (hints.py); one
whose owner and checksum it knows is asked of that owner by key, without the master, when shared
memory does not reach it (owner_server.py serves our own DRAM that way); the get path's reads
(by key, early, pipelined, straight into a caller's tensor) are reads.py's. A batch put into
places reserved ahead commits each group of objects once its bytes landed, while the next group's
bytes move; with commit_behind a single put's commit does too (commits_behind.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from mooncaked.security import Security
from mooncaked.startup import listening
from mooncaked.tasks import spawn
from mooncaked.store import heap, metrics, owner_index, pinned
from mooncaked.store.commits_behind import CommitsBehind
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import DRAM_REGION, STAGING_REGION, DramSegment, Staging, nbytes_of
from mooncaked.store.fast_channel import FastChannel
from mooncaked.store.fast_wire import RequestTooBig
from mooncaked.store.hints import Hint, Hints
from mooncaked.store.reservations import Place, Places, Shape
from mooncaked.store.errors import InvalidArgument, NoRoom, StoreError, StoreUnavailable, from_rpc_error
from mooncaked.store.lmdb_tier import LmdbTier, LmdbWrite
from mooncaked.store.master_link import MasterLink, host_of
from mooncaked.store.mounts import Mounts
from mooncaked.store.owner_link import OwnerLinks
from mooncaked.store.owner_index import IndexView, IndexViews, OwnerIndex
from mooncaked.store.owner_server import OwnerServer, ServeWindow
from mooncaked.store.reads import PIPELINE_GROUP, GetCall, Reader, chunks, settle
from mooncaked.store.recent_writes import KEEP_S, RecentWrites
from mooncaked.store.records import PLACE_USE_S, checksum
from mooncaked.store.tier_worker import TierWorker
from mooncaked.transfer import TransferEngine, TransferError, TransferOp, host_id

logger = logging.getLogger(__name__)

Data = bytes | bytearray | memoryview | torch.Tensor
T = TypeVar("T")
MAX_AHEAD = 64  # most places of one shape kept
REFILL_STEPS = 8  # a refill tops up about 1/8 of the places kept
FAST_RETRY_S = 1.0  # after the fast path failed to open, gRPC carries the calls this long (doubling to the max)
FAST_RETRY_MAX_S = 30.0
FAST_CONNECT_TIMEOUT_S = 1.0  # the master answered Describe: its fast port answers at once or not at all


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
        self._channel: grpc.aio.Channel | MasterLink | None = None
        self._link: MasterLink | None = None  # where the master (the leader, under HA) is
        self.stub: store_pb2_grpc.StoreMasterStub | None = None
        self.dram: DramSegment | None = None
        self.staging: Staging | None = None
        self._unpin: Callable[[], None] | None = None  # unlocks the staging area (pin_staging)
        self.lmdb: LmdbTier | None = None
        self.mounts: Mounts | None = None
        self.worker: TierWorker | None = None
        self._tasks: list[asyncio.Task] = []
        self._fast: FastChannel | None = None
        self._fast_retry_at = 0.0  # after a fast-path failure, gRPC until then
        self._fast_backoff = FAST_RETRY_S
        self._fast_lock = asyncio.Lock()
        self._places = Places()
        self._hints = Hints(config.location_hints)
        self._reader: Reader | None = None
        self._behind = CommitsBehind()  # single puts' commits in flight (commit_behind)
        self.owner_server: OwnerServer | None = None  # our DRAM's objects by key (owner_server.py)
        self._owner_links: OwnerLinks | None = None
        self._shm_host = ""  # our host id when shared memory reaches holders on it (they are read that way)
        self._index: OwnerIndex | None = None  # our DRAM's keys for readers on this host (owner_index.py)
        self._indexes: IndexViews | None = None  # owners' indexes on this host, mapped for our gets
        self._own_key_server = ""
        self._refilling: dict[Shape, asyncio.Task] = {}
        self._lmdb_thread = ThreadPoolExecutor(1, thread_name_prefix="store-lmdb")  # LMDB work, in order
        self.journal = DramJournal()  # what the master says our DRAM holds (re-reported at a remount)
        self.recent_writes = RecentWrites()  # our recent puts on others' DRAM (re-reported at a leader change)
        self._reporting: asyncio.Task | None = None

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
            self._owner_links = OwnerLinks(self.security.token, cfg.transfer_timeout_s) if cfg.owner_reads else None
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
        if self._channel is None:
            # one master: a plain stub on one channel; masters under HA: the link follows the leader
            self._link = self._channel = MasterLink(cfg.master, self.security, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
            self.stub = self._link.stub

            def leader_moved(_address: str) -> None:  # remount there now, and reopen the fast path there
                self._places.forget()  # places the old leader reserved are free to the new one: never write them
                self._master_changing()
                if self.mounts is not None:
                    self.mounts.request_remount()
                self._report_soon()
                self._fast_retry_at, self._fast_backoff = 0.0, FAST_RETRY_S
                if self._fast is not None:
                    self._fast.fail("the store master leader moved")

            self._link.on_change(leader_moved)
        owner = self.owner_server
        self.mounts = Mounts(cfg.client_id, self.stub, self.transfer, self.dram, self.lmdb, cfg.rpc_timeout_s,
                             self._lmdb_thread, self.journal, remounted=self._report_soon,
                             changing=self._master_changing, window=owner.window if owner else None,
                             key_server=owner.address if owner else "")
        await self.mounts.mount_all()
        if self.dram is None and self.lmdb is None:
            # it lends nothing, so mounting asked the master nothing: ask it once, so that a master that
            # is not there is found now (a startup error the user can fix), not at the first get
            try:
                await self.stub.Describe(store_pb2.DescribeRequest(), timeout=cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e, "describe") from None
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
        reporting = [self._reporting] if self._reporting is not None else []
        for t in [*self._tasks, *self._refilling.values(), *reporting]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._refilling.values(), *reporting, return_exceptions=True)
        await self._give_back(self._places.drain())
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
        if self._fast is not None:
            self._fast.close()
        if self._channel is not None:
            await self._channel.close()
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
                reply = await self._call("EvacuateSegment", self.stub.EvacuateSegment, request)
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

    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], request) -> T:
        """One metadata call: on the fast path when the master offers it, else (or while it is down) gRPC."""
        fast = self._fast
        if fast is not None and not fast.closed:
            try:
                return await fast.call(what, request, self.config.rpc_timeout_s)  # type: ignore[return-value]
            except RequestTooBig:  # over the fast path's frame limit: this one goes by gRPC
                return await self._grpc_reply(what, fn(request, timeout=self.config.rpc_timeout_s))
        return await (await self._send(what, fn, request))

    async def _send(self, what: str, fn: Callable[..., Awaitable[T]], request) -> Awaitable[T]:
        """Put a metadata call on the wire now; the returned awaitable gives its reply."""
        fast = self._fast if self._fast is not None and not self._fast.closed else await self._open_fast()
        if fast is not None:
            try:
                return fast.send(what, request, self.config.rpc_timeout_s)  # type: ignore[return-value]
            except RequestTooBig:  # over the fast path's frame limit: this one goes by gRPC
                pass
        return self._grpc_reply(what, fn(request, timeout=self.config.rpc_timeout_s))  # the call starts here

    @staticmethod
    async def _grpc_reply(what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, what) from None

    async def _open_fast(self) -> FastChannel | None:
        """A fresh fast-path channel (asked for with Describe), or None to use gRPC for now.

        Calls never wait for an opening in progress (they take gRPC meanwhile), and failed openings
        back off from FAST_RETRY_S up to FAST_RETRY_MAX_S, so a firewalled fast port costs nothing.
        """
        loop = asyncio.get_running_loop()
        if not self.config.fast_path or loop.time() < self._fast_retry_at or self._fast_lock.locked():
            return None
        async with self._fast_lock:
            try:
                address, reply = await self._link.describe(self.config.rpc_timeout_s)  # the leader's, under HA
                if not reply.fast_path_port:
                    self._fast_retry_at = loop.time() + FAST_RETRY_MAX_S  # this master has none (maybe the next)
                    return None
                host = host_of(address)
                link = self._link if self._link.following else None  # calls it no longer serves go on by gRPC
                # a master lost (killed, restarted, deposed): its reserved places are another master's to give
                lost = self._places.forget
                timeout = min(self.config.rpc_timeout_s, FAST_CONNECT_TIMEOUT_S)
                self._fast = None
                if reply.fast_path_unix and reply.host_id == host_id():  # same host: the cheaper socket
                    try:
                        self._fast = await FastChannel.connect(host, 0, timeout, unix=reply.fast_path_unix,
                                                               token=self.security.token, link=link, on_lost=lost)
                    except StoreUnavailable as e:
                        logger.info("store client %s: %s; using TCP", self.config.client_id, e)
                if self._fast is None:
                    self._fast = await FastChannel.connect(host, reply.fast_path_port, timeout,
                                                           token=self.security.token, link=link, on_lost=lost)
                self._places.follow(reply.master_epoch)
                self._fast_backoff = FAST_RETRY_S
                return self._fast
            except (grpc.aio.AioRpcError, StoreError) as e:
                self._fast_retry_at = loop.time() + self._fast_backoff
                self._fast_backoff = min(2 * self._fast_backoff, FAST_RETRY_MAX_S)
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                logger.info("store client %s: no fast path to the master for now (%s); using gRPC",
                            self.config.client_id, detail)
                return None

    # -- put ----------------------------------------------------------------------------------------
    async def put(self, key: str, data: Data, *, soft_pin: bool = False) -> bool:
        """Store one object; True when it is in the pool (now or already), False when there was no room.

        Into a place reserved ahead when one is at hand (the write and one commit); else, or when
        that fails for a reason a fresh PutStart may not have, the batch path (PutStart, write, PutEnd).
        """
        if self.config.reserve_ahead_bytes > 0 and self.staging is not None:
            done = await self._put_reserved(key, data, soft_pin)
            if done is not None:
                return done
        return (await self.batch_put([(key, data)], soft_pin=soft_pin))[0]

    async def _put_reserved(self, key: str, data: Data, soft_pin: bool) -> bool | None:
        """One put into a reserved place; None to take the batch path instead (no place, no room, or
        the place was unknown to the master)."""
        assert self.staging is not None
        size = nbytes_of(data)
        if size <= 0 or not self.staging.fits([size]):
            return None  # the batch path says what is wrong
        loop = asyncio.get_running_loop()
        shape = Shape(size, self.config.replicas, self.dram_segment if self.config.prefer_local and self.dram else "")
        place = self._places.take(shape, loop.time())
        if place is not None:
            self._refill_soon(shape)  # now: the master reserves while this put writes, not during its commit
        # out of stock: a few places now (a big reservation holds the master up), the rest in the background
        reserving = None if place is not None else await self._send(
            "ReservePlaces", self.stub.ReservePlaces,
            self._reserve_request(shape, 1 + self._refill_step(shape), for_a_put=True))
        # a caller's bytes are checksummed as they are: while the master reserves, if it does; else
        # while they travel (_write_place)
        csum = None if reserving is None or isinstance(data, torch.Tensor) else checksum(data)
        if reserving is not None:
            try:
                got = self._stock(shape, await reserving)
            except NoRoom:
                return None
            if not got:
                return None
            place = got[0]
            self._places.add(shape, got[1:])
            self._refill_soon(shape)
        assert place is not None
        fast = self._fast
        if self.config.commit_behind and isinstance(data, bytes) and fast is not None and not fast.closed:
            return await self._put_behind(key, data, place, csum, soft_pin)
        try:
            csum = await self._write_place(data, size, place, csum)
        except TransferError as e:
            await self._write_failed(key, place, e)
            return False
        end = _commit_request(place, key, csum, soft_pin)
        if self.config.commit_behind and fast is not None and not fast.closed:  # ordered before our next call
            done_csum = csum
            await self._behind.sent()  # after the commits of the puts before it
            await self._behind.add(key, fast.send("BatchPutEnd", end, self.config.rpc_timeout_s),
                                   lambda ok: self._settled(key, place, size, done_csum, ok))
            return True
        await self._behind.sent()
        reply = await self._call("BatchPutEnd", self.stub.BatchPutEnd, end)
        if not reply.reserved_ok or not reply.reserved_ok[0]:
            self._places.forget()  # the master did not know the place: it restarted, or the place lapsed
            return None
        self._settled(key, place, size, csum, True)
        return True

    async def _put_behind(self, key: str, data: bytes, place: Place, csum: int | None, soft_pin: bool) -> bool:
        """A single put of immutable bytes with commit_behind: it returns once they are handed to the data
        plane (transfer.send_from; checksummed while they travel); each copy's acknowledgement and then
        the commit follow behind, while the caller's next put moves (commits_behind.py)."""
        size = len(data)
        acks: list[Awaitable[object]] = []
        staged: list[store_pb2.Replica] = []
        try:
            for rep in place.replicas:
                ack = await self.transfer.send_from(data, rep.endpoint.address, rep.endpoint.region, rep.offset,
                                                    self.config.transfer_timeout_s)
                if ack is None:
                    staged.append(rep)
                else:
                    acks.append(ack)
            if csum is None:
                csum = checksum(data)
            if staged:
                await self._write_staged(data, size, staged, csum)
        except TransferError as e:
            await asyncio.gather(*acks, return_exceptions=True)  # nothing of ours may land in a place given back
            await self._write_failed(key, place, e)
            return False
        end = _commit_request(place, key, csum, soft_pin)
        done_csum = csum  # an int by now, for the callback
        await self._behind.add_landing(key, acks, lambda: self._send("BatchPutEnd", self.stub.BatchPutEnd, end),
                                       lambda ok: self._settled(key, place, size, done_csum, ok),
                                       lambda e: self._write_failed(key, place, e))
        return True

    async def _write_failed(self, key: str, place: Place, error: BaseException) -> None:
        logger.warning("store put of %s failed on the data plane (%s); giving its place back", key, error)
        await self._give_back([place.reservation])
        metrics.client_op("put", "failed").inc()

    def _settled(self, key: str, place: Place, size: int, csum: int, ok: bool) -> None:
        """A single put's commit was answered (ok: taken)."""
        if not ok:
            self._places.forget()  # the master did not know the place: it restarted, or the place lapsed
            metrics.client_op("put", "lost").inc()
            return
        self._committed(key, place.replicas, size, csum)
        metrics.client_op("put", "ok").inc()
        metrics.client_bytes("put").inc(size)

    async def flush(self) -> list[str]:
        """Wait for the commits still in flight of puts made with `commit_behind`; returns the keys whose
        commit failed since the last flush (put() said True, but they are not stored)."""
        return await self._behind.flush()

    async def _write_place(self, data: Data, size: int, place: Place, csum: int | None) -> int:
        """Write one object into every copy of its place; returns its checksum (`csum` when given).

        A caller's bytes go to each copy straight from their buffer where the data plane can
        (transfer.write_from: shared memory, one memcpy; in-process tcp, no copy on this side),
        checksummed while the first copy travels when `csum` is not given yet. Tensors, and copies
        the data plane cannot reach that way (rdma, the tcp I/O process), go through the staging area.
        """
        assert self.staging is not None
        staged = place.replicas
        if not isinstance(data, torch.Tensor):
            sums = [] if csum is None else [csum]

            def hash_meanwhile() -> None:
                if not sums:
                    sums.append(checksum(data))

            staged = [rep for rep in place.replicas
                      if not await self.transfer.write_from(data, rep.endpoint.address, rep.endpoint.region,
                                                            rep.offset, self.config.transfer_timeout_s, hash_meanwhile)]
            if not staged:
                return sums[0] if sums else checksum(data)
            csum = sums[0] if sums else None
        return await self._write_staged(data, size, staged, csum)

    async def _write_staged(self, data: Data, size: int, replicas: list[store_pb2.Replica], csum: int | None) -> int:
        """Write one object into these copies through the staging area; returns its checksum."""
        assert self.staging is not None
        async with self.staging.lease([size]) as (off,):
            self.staging.stage(off, data)
            if csum is None:
                csum = checksum(self.staging.slice(off, size))
            ops = [TransferOp("write", STAGING_REGION, off, rep.endpoint.address, rep.endpoint.region, rep.offset, size)
                   for rep in replicas]
            await self.transfer.submit(ops, timeout_s=self.config.transfer_timeout_s)
        return csum

    def _ahead(self, shape: Shape) -> int:
        """How many places of this shape to keep: reserve_ahead_bytes' worth, within [2, 64]."""
        return max(2, min(MAX_AHEAD, self.config.reserve_ahead_bytes // shape.size))

    def _refill_step(self, shape: Shape) -> int:
        return max(1, self._ahead(shape) // REFILL_STEPS)

    def _reserve_request(self, shape: Shape, count: int, for_a_put: bool = False) -> store_pb2.ReservePlacesRequest:
        return store_pb2.ReservePlacesRequest(client_id=self.config.client_id, size=shape.size, count=count,
                                              replicas=shape.replicas, preferred_segment=shape.preferred,
                                              first_for_a_put=for_a_put)

    def _stock(self, shape: Shape, reply: store_pb2.ReservePlacesReply) -> list[Place]:
        """The places of a ReservePlaces reply, usable for half the master's timeout."""
        self._places.follow(reply.master_epoch)
        use_by = asyncio.get_running_loop().time() + min(reply.timeout_s / 2, PLACE_USE_S)
        return [Place(r.id, list(r.replicas), use_by) for r in reply.reservations]

    def _refill_soon(self, shape: Shape) -> None:
        """Top the stock up in the background, a few places at a time (one refill per shape at a time).

        Small steps, asked for at once (on the fast path the request is written before this
        returns): the master reserves in one go, so a big refill, or one sent behind a commit,
        would hold up the next commit; a few places are reserved while a put is still writing."""
        ahead = self._ahead(shape)
        have = self._places.count(shape)
        if have > ahead - self._refill_step(shape) or shape in self._refilling:
            return
        request = self._reserve_request(shape, ahead - have)
        fast = self._fast
        sent = fast.send("ReservePlaces", request, self.config.rpc_timeout_s) if fast and not fast.closed else None
        task = spawn(self._refill(shape, request, sent), f"store-reserve-{self.config.client_id}")
        self._refilling[shape] = task
        task.add_done_callback(lambda _: self._refilling.pop(shape, None))

    async def _refill(self, shape: Shape, request: store_pb2.ReservePlacesRequest,
                      sent: Awaitable[store_pb2.ReservePlacesReply] | None) -> None:
        try:
            if sent is not None:
                reply = await sent
            else:
                reply = await self._call("ReservePlaces", self.stub.ReservePlaces, request)
        except StoreError as e:  # no room now, master away: single puts take the batch path meanwhile
            logger.debug("store client %s: could not reserve places ahead: %s", self.config.client_id, e)
            return
        got = self._stock(shape, reply)
        await self._give_back(self._places.add(shape, got))

    async def _give_back(self, reservations: list[int]) -> None:
        if not reservations:
            return
        try:
            await self._call("BatchPutEnd", self.stub.BatchPutEnd,
                             store_pb2.BatchPutEndRequest(revoke_reservations=reservations))
        except StoreError as e:  # the master discards them after its timeout anyway
            logger.info("store client %s: could not give back %d reserved places: %s", self.config.client_id,
                        len(reservations), e)

    async def batch_put(self, items: Sequence[tuple[str, Data]], *, soft_pin: bool = False) -> list[bool]:
        """Store many objects with one PutStart/PutEnd round trip per staging-area's worth.

        Objects that found no room are retried for up to `no_room_retry_s` while the master
        moves older objects to LMDB; what still finds none is reported False (a cache may drop).
        """
        await self._behind.sent()  # commits in put order
        out = [False] * len(items)
        todo = list(range(len(items)))
        if self.config.reserve_ahead_bytes > 0 and self.staging is not None and items:
            for i, done in enumerate(await self._put_reserved_many(items, soft_pin)):
                if done is not None:
                    out[i] = done
            todo = [i for i in todo if not out[i]]
        deadline = asyncio.get_running_loop().time() + self.config.no_room_retry_s
        pause = 0.02
        while True:
            for chunk in self._chunks([nbytes_of(items[i][1]) for i in todo]):
                results = await self._put_chunk([items[todo[j]] for j in chunk], soft_pin)
                for j, ok in zip(chunk, results):
                    out[todo[j]] = ok
            todo = [i for i in todo if not out[i]]
            if not todo or asyncio.get_running_loop().time() + pause > deadline:
                return out
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def _put_reserved_many(self, items: Sequence[tuple[str, Data]], soft_pin: bool) -> list[bool | None]:
        """The items that find a place reserved ahead, written and committed pipelined (see
        _write_and_commit); None for the others (the PutStart path takes them)."""
        assert self.staging is not None
        results: list[bool | None] = [None] * len(items)
        now = asyncio.get_running_loop().time()
        pref = self.dram_segment if self.config.prefer_local and self.dram else ""
        sizes = [nbytes_of(d) for _, d in items]
        taken: list[tuple[int, Place]] = []
        for i, size in enumerate(sizes):
            if size <= 0 or not self.staging.fits([size]):
                continue  # the PutStart path says what is wrong
            shape = Shape(size, self.config.replicas, pref)
            place = self._places.take(shape, now)
            if place is not None:
                self._refill_soon(shape)
                taken.append((i, place))
        for chunk in self._chunks([sizes[i] for i, _ in taken]):
            part = [taken[j] for j in chunk]
            for (i, _), ok in zip(part, await self._write_and_commit(items, part, sizes, soft_pin)):
                results[i] = ok
        return results

    async def _write_and_commit(self, items: Sequence[tuple[str, Data]], part: list[tuple[int, Place]],
                                sizes: list[int], soft_pin: bool) -> list[bool | None]:
        """Write objects into their reserved places in groups of PIPELINE_GROUP, each group's bytes
        moving while the next is staged and hashed, and commit each group as soon as its bytes are in
        place, while later groups still move (a commit names only objects whose every byte landed).
        True: committed; False: the write failed (its places given back); None: the master did not
        know the place (the PutStart path tries again)."""
        assert self.staging is not None
        out: list[bool | None] = [False] * len(part)
        sums = [0] * len(part)
        groups = [list(range(s, min(s + PIPELINE_GROUP, len(part)))) for s in range(0, len(part), PIPELINE_GROUP)]
        commits: list[tuple[list[int], Awaitable[store_pb2.BatchPutEndReply]]] = []
        async with self.staging.lease([sizes[i] for i, _ in part]) as offsets:
            writes: list[asyncio.Future] = []
            try:
                for g in groups:
                    ops = []
                    for j in g:
                        (i, place), off = part[j], offsets[j]
                        self.staging.stage(off, items[i][1])
                        sums[j] = checksum(self.staging.slice(off, sizes[i]))
                        ops += [TransferOp("write", STAGING_REGION, off, r.endpoint.address, r.endpoint.region,
                                           r.offset, sizes[i]) for r in place.replicas]
                    writes.append(asyncio.ensure_future(self.transfer.submit(ops, self.config.transfer_timeout_s)))
                    await asyncio.sleep(0)  # its bytes go onto the wire while the next group is staged
                for g, writing in zip(groups, writes):
                    try:
                        await writing
                    except TransferError as e:
                        logger.warning("store put of %d objects failed on the data plane (%s); giving their places "
                                       "back", len(g), e)
                        await self._give_back([part[j][1].reservation for j in g])
                        continue
                    end = store_pb2.BatchPutEndRequest(reserved=[store_pb2.ReservedPut(
                        reservation=part[j][1].reservation, key=items[part[j][0]][0], checksum=sums[j],
                        soft_pin=soft_pin) for j in g])
                    commits.append((g, await self._send("BatchPutEnd", self.stub.BatchPutEnd, end)))
            finally:  # cancelled: nothing may read the staging area once it is given back
                await settle(writes)
        replies = await asyncio.gather(*(c for _, c in commits), return_exceptions=True)
        for (g, _), reply in zip(commits, replies):
            if isinstance(reply, BaseException):
                raise reply
            for j, ok in zip(g, reply.reserved_ok):
                i, place = part[j]
                if not ok:  # the master did not know the place: it restarted, or the place lapsed
                    self._places.forget()
                    out[j] = None
                    continue
                out[j] = True
                self._committed(items[i][0], place.replicas, sizes[i], sums[j])
                metrics.client_bytes("put").inc(sizes[i])
        for ok in out:
            if ok is not None:
                metrics.client_op("put", "ok" if ok else "failed").inc()
        return out

    async def _put_chunk(self, items: Sequence[tuple[str, Data]], soft_pin: bool) -> list[bool]:
        assert self.staging is not None, "start() first"
        sizes = [nbytes_of(d) for _, d in items]
        async with self.staging.lease(sizes) as offsets:
            pref = self.dram_segment if self.config.prefer_local and self.dram else ""
            req = store_pb2.BatchPutStartRequest(items=[
                store_pb2.PutStartRequest(key=k, size=n, replicas=self.config.replicas, preferred_segment=pref,
                                          soft_pin=soft_pin)
                for (k, _), n in zip(items, sizes)], client_id=self.config.client_id)
            placing = await self._send("BatchPutStart", self.stub.BatchPutStart, req)
            # while the master places them: gather the bytes and hash them (the checksums go with PutEnd)
            sums = []
            for (_, data), off, size in zip(items, offsets, sizes):
                self.staging.stage(off, data)
                sums.append(checksum(self.staging.slice(off, size)))
            reply = await placing
            ok = [it.exists for it in reply.items]
            writing = [i for i, it in enumerate(reply.items) if it.replicas]
            bad = await self._write_placed(reply, writing, items, offsets, sizes, sums)
        good = [i for i in writing if i not in bad]
        if writing:
            end = store_pb2.BatchPutEndRequest(keys=[items[i][0] for i in good], checksums=[sums[i] for i in good],
                                               revoke_keys=[items[i][0] for i in writing if i in bad])
            done = await self._call("BatchPutEnd", self.stub.BatchPutEnd, end)
            if done.committed < len(good):  # the master that placed them is gone (restarted, or a new leader)
                logger.warning("store put of %d objects: the master committed %d (it did not place them: a "
                               "restart or a new leader); reporting them not stored", len(good), done.committed)
                good = []
            for i in good:
                ok[i] = True
                self._committed(items[i][0], reply.items[i].replicas, sizes[i], sums[i])
        for i, good_one in enumerate(ok):
            metrics.client_op("put", "ok" if good_one else "no_room" if i not in bad else "failed").inc()
            if good_one and i in writing:
                metrics.client_bytes("put").inc(sizes[i])
        return ok

    def _committed(self, key: str, replicas: Sequence[store_pb2.Replica], size: int, csum: int) -> None:
        """A put of ours is in the pool: note where its DRAM copy is (a location hint), and journal a
        copy on our own DRAM at once. The master's journal batch for it comes up to JOURNAL_FLUSH_S
        later; a master lost in between would otherwise forget an object it had committed."""
        dram = next((r for r in replicas if r.medium != "lmdb"), None)
        if dram is not None:
            self._hints.note(key, dram, size, csum)
        for r in replicas:
            if r.segment == self.dram_segment and self.dram is not None:
                self.journal.note(key, r.offset, size, csum)
            elif r.medium == "dram":
                self.recent_writes.note(r.segment, key, r.offset, size, csum)

    def _master_changing(self) -> None:
        """A new master: nothing the old one ordered is carried out any more."""
        if self.worker is not None:
            self.worker.drop_queued()

    def _report_soon(self) -> None:
        """The master changed (a new leader, or a restart): re-report recent writes, once at a time."""
        if len(self.recent_writes) and (self._reporting is None or self._reporting.done()):
            self._reporting = spawn(self.report_recent_writes(), f"store-report-{self.config.client_id}")

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

    async def _write_placed(self, reply: store_pb2.BatchPutStartReply, writing: list[int],
                            items: Sequence[tuple[str, Data]], offsets: list[int], sizes: list[int],
                            sums: list[int]) -> set[int]:
        """Write the staged objects where the master placed them: DRAM copies through transfer/, a place
        on our own LMDB tier (no DRAM had room) into it, both at once. Returns the items that failed."""
        own_lmdb = f"{self.config.client_id}/lmdb"
        ops: list[TransferOp] = []
        remote: list[int] = []  # items with a DRAM copy to write
        local: list[int] = []  # items placed on our LMDB tier
        bad: set[int] = set()
        for i in writing:
            for rep in reply.items[i].replicas:
                if rep.medium != "lmdb":
                    ops.append(TransferOp("write", STAGING_REGION, offsets[i], rep.endpoint.address,
                                          rep.endpoint.region, rep.offset, sizes[i]))
                    if not remote or remote[-1] != i:
                        remote.append(i)
                elif rep.segment == own_lmdb and self.lmdb is not None:
                    local.append(i)
                else:  # only the writer can store on an LMDB tier
                    logger.warning("store put of %s: placed on LMDB tier %s, which is not ours; revoking it",
                                   items[i][0], rep.segment)
                    bad.add(i)
        storing = None
        if local:
            assert self.lmdb is not None and self.staging is not None
            writes = [LmdbWrite(items[i][0], self.staging.slice(offsets[i], sizes[i]), sums[i]) for i in local]
            storing = asyncio.get_running_loop().run_in_executor(self._lmdb_thread, self.lmdb.write_many, writes)
        try:
            if ops:
                try:
                    await self.transfer.submit(ops, timeout_s=self.config.transfer_timeout_s)
                except TransferError as e:
                    bad.update(remote)
                    logger.warning("store put of %d objects failed on the data plane (%s); revoking them",
                                   len(remote), e)
        finally:
            if storing is not None:  # the staged bytes stay leased until LMDB has them
                for i, err in zip(local, await storing):
                    if err:
                        logger.warning("store put of %s on our LMDB tier failed (%s); revoking it", items[i][0], err)
                        bad.add(i)
        return bad

    def _chunks(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices grouped so each group fits the staging area."""
        assert self.staging is not None, "start() first"
        return chunks(self.staging, sizes)

    # -- get ----------------------------------------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss (absent, unreachable or failing its checksum)."""
        await self._behind.sent()  # our puts that returned are visible to our own gets
        reader = self._reader
        if reader is not None and reader.owners is not None:  # by key from its owner, if we know it
            h = self._hints.get(key)
            # no staging used, but the same limit as every other get
            if h is not None and self._owner_serves(h) and self.staging is not None and self.staging.fits([h.size]):
                data, gone = await reader.one_from_owner(key, h)
                if data is not None:
                    metrics.client_op("get", "hit").inc()
                    return data
                if gone:
                    self._hints.forget((key,))
                out: list[bytes | None] = [None]
                await self._fetch(GetCall((key,), {key: 0}, [False], out=out), ask_owners=False)  # asked already
                return out[0]
        return (await self.batch_get([key]))[0]

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

    def _vouched(self, piece: list[str]) -> list[tuple[str, Hint, IndexView, tuple[int, int]]]:
        """The keys of `piece` an owner on this host lists in its index exactly as we last saw them."""
        assert self._indexes is not None
        out = []
        for key, h in self._hints.pick(piece):
            if h.shm_name and h.checksum and h.host_id == self._shm_host:
                view = self._indexes.get(owner_index.index_name(h.shm_name))
                token = view.vouch(key, h.offset, h.size, h.checksum) if view is not None else None
                if token is not None:
                    out.append((key, h, view, token))
        return out

    def _owner_serves(self, h: Hint) -> bool:
        """Whether a get by key from this hint's owner is worth asking (not ourselves; shared memory does
        not reach it, where the early copy is cheaper; not skipped after a failure)."""
        assert self._owner_links is not None
        return (bool(h.key_server) and bool(h.checksum) and h.key_server != self._own_key_server
                and (not self._shm_host or h.host_id != self._shm_host) and self._owner_links.reachable(h.key_server))

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each object's bytes or None. A copy on this host is read straight into the returned bytes
        (one copy, transfer.read_bytes); the others, and reads that fail, go through staging."""
        out: list[bytes | None] = [None] * len(keys)
        await self._fetch(GetCall(keys, {k: i for i, k in enumerate(keys)}, [False] * len(keys), out=out))
        return out

    def _release_soon(self, lease: int, keys: list[str]) -> None:
        """Give a lease back without waiting for the answer (it only frees room sooner)."""
        request = store_pb2.BatchGetReplicasRequest(client_id=self.config.client_id, release_lease=lease,
                                                    release_keys=keys)

        async def send() -> None:
            try:
                await self._call("BatchGetReplicas", self.stub.BatchGetReplicas, request)
            except Exception as e:  # noqa: BLE001 - best effort (closing, master away): the lease lapses by itself
                logger.debug("store client %s: could not give a read lease back: %s", self.config.client_id, e)

        spawn(send(), f"store-release-{self.config.client_id}")

    async def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the object into `out` (any layout, dtype or device; its bytes must equal the object's).
        A contiguous CPU tensor is read into directly (reads.py); on False its contents are undefined."""
        return (await self.batch_get_into([key], [out]))[0]

    async def batch_get_into(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Like get_into for many keys; one round trip to the master per piece, reads pipelined."""
        if len(keys) != len(outs):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output tensors")
        call = GetCall(keys, {k: i for i, k in enumerate(keys)}, [False] * len(keys), outs=outs)
        return await self._fetch(call)

    async def _fetch(self, call: GetCall, ask_owners: bool = True) -> list[bool]:
        """Look keys up and read them (reads.py moves, checks and hands the bytes over); objects whose
        owner we know are asked of it by key first (`ask_owners`)."""
        assert self._reader is not None, "start() first"
        await self._behind.sent()
        reader, got, index = self._reader, call.got, call.index
        step = max(1, self.config.get_batch_keys)
        todo = list(call.keys)
        release: tuple[int, list[str]] = (0, [])  # the last piece's lease, when the master wants it back
        while todo:
            piece, todo = todo[:step], todo[step:]
            if self._indexes is not None:  # owners on this host that list it: no round trip at all
                vouched = self._vouched(piece)
                if vouched:
                    served = await reader.from_index(call, vouched)
                    piece = [k for k in piece if k not in served]
                    if not piece:
                        continue
            if ask_owners and reader.owners is not None:  # one round trip to the owners that hold what we know of
                piece = await self._from_owners(call, piece)
                if not piece:
                    continue
            req = store_pb2.BatchGetReplicasRequest(keys=piece, client_id=self.config.client_id,
                                                    release_lease=release[0], release_keys=release[1])
            hinted = self._hints.pick(req.keys)
            async with AsyncExitStack() as stack:  # what early copies landed in is held until they are served
                if hinted:  # copy from where the objects were last seen while the master answers (hints.py)
                    lookup = await self._send("BatchGetReplicas", self.stub.BatchGetReplicas, req)
                    early = await reader.start_early(call, hinted, stack)
                    reply = await lookup
                else:
                    reply = await self._call("BatchGetReplicas", self.stub.BatchGetReplicas, req)
                objs = [o for o in reply.objects if o.key in index and o.replicas]
                self._hints.note_objects(objs)
                if hinted:
                    objs = await reader.keep_early(call, objs, early)
            if call.out is not None:
                objs = await reader.read_direct(call, objs)
            await reader.read(call, objs)
            # DRAM is short: give this piece's lease back with the next request, so its copies make room
            release = (reply.lease_id, [o.key for o in reply.objects]) if reply.lease_id else (0, [])
            if reply.later_keys:  # what did not fit its owner's DRAM yet comes next, in chain order
                if not reply.objects:
                    break  # the master found no room at all before the deadline
                todo = list(reply.later_keys) + todo
        if release[0]:
            self._release_soon(*release)
        for ok in got:
            metrics.client_op("get", "hit" if ok else "miss").inc()
        return got

    async def _from_owners(self, call: GetCall, piece: list[str]) -> list[str]:
        """Get what we know the owner, size and checksum of from the owner by key (owner_server.py),
        unless shared memory reaches it (then the early copy is cheaper); returns the keys left."""
        assert self._reader is not None and self._owner_links is not None
        picked = [(k, h) for k, h in self._hints.pick(piece) if self._owner_serves(h)]
        if not picked:
            return piece
        served, gone = await self._reader.from_owners(call, picked)
        if gone:  # removed, moved or rewritten: no early copy from there either
            self._hints.forget(gone)
        return [k for k in piece if k not in served] if served else piece

    # -- queries ------------------------------------------------------------------------------------
    async def exist(self, key: str) -> bool:
        await self._behind.sent()
        return (await self._call("Exist", self.stub.Exist, store_pb2.ExistRequest(key=key))).exists

    async def batch_exist(self, keys: Sequence[str]) -> list[bool]:
        await self._behind.sent()
        reply = await self._call("BatchExist", self.stub.BatchExist, store_pb2.BatchExistRequest(keys=list(keys)))
        return list(reply.exists)

    async def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys of a block-hash chain the pool holds (the reusable prefix, in blocks)."""
        await self._behind.sent()
        reply = await self._call("LongestPrefix", self.stub.LongestPrefix,
                                 store_pb2.LongestPrefixRequest(keys=list(keys)))
        return reply.num_keys

    async def remove(self, keys: Sequence[str]) -> int:
        await self._behind.sent()
        self._hints.forget(keys)
        reply = await self._call("Remove", self.stub.Remove, store_pb2.RemoveRequest(keys=list(keys)))
        return reply.removed

    async def pool_stats(self) -> store_pb2.PoolStatsReply:
        return await self._call("PoolStats", self.stub.PoolStats, store_pb2.PoolStatsRequest())


def _commit_request(place: Place, key: str, csum: int, soft_pin: bool) -> store_pb2.BatchPutEndRequest:
    """The commit of one put into a place reserved ahead."""
    return store_pb2.BatchPutEndRequest(reserved=[store_pb2.ReservedPut(reservation=place.reservation, key=key,
                                                                        checksum=csum, soft_pin=soft_pin)])


__all__ = ["StoreClient", "StoreClientConfig", "StoreError", "StoreUnavailable"]
