"""Keeping a client's segments mounted: mount at start, ping, remount when the master
forgot us (it restarted, or declared us dead), unmount at close.

A remount of the LMDB tier re-reports every object it holds (from its metadata), which is
how a restarted master, or a restarted engine on the same LMDB path, gets them back; a remount
of the DRAM segment re-reports what its journal says is there and still matches its checksum
(dram_journal.py), so a restarted master gets the DRAM objects of live engines back too. The
LMDB tier mounts first: the master then knows which DRAM objects LMDB holds already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

import grpc

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.store.convert import segment_to_proto
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import DramSegment
from mooncaked.store.errors import from_rpc_error
from mooncaked.store.lmdb_tier import LmdbTier
from mooncaked.store.owner_server import ServeWindow
from mooncaked.store.records import Endpoint, SegmentSpec
from mooncaked.transfer import TransferEngine

logger = logging.getLogger(__name__)


class Mounts:
    def __init__(self, client_id: str, stub: store_pb2_grpc.StoreMasterStub, transfer: TransferEngine,
                 dram: DramSegment | None, lmdb: LmdbTier | None, rpc_timeout_s: float,
                 lmdb_thread: Executor | None = None, journal: DramJournal | None = None,
                 remounted: Callable[[], None] = lambda: None, changing: Callable[[], None] = lambda: None,
                 window: ServeWindow | None = None, key_server: str = "",
                 unreachable: Callable[[], None] = lambda: None) -> None:
        self.client_id = client_id
        self._changing = changing  # before a remount at a new master (the tier worker drops the old one's tasks)
        self._remounted = remounted  # after a remount at a new master (the client re-reports its recent writes)
        self._unreachable = unreachable  # a ping found no master (the client holds its recent writes)
        self._stub = stub
        self._transfer = transfer
        self._dram = dram
        self._lmdb = lmdb
        self._timeout = rpc_timeout_s
        self._lmdb_thread = lmdb_thread
        self.journal = journal if journal is not None else DramJournal()
        self.window = window  # owner reads by key: kept open by our pings (owner_server.py)
        self.key_server = key_server  # where we serve them, told to the master with the DRAM segment
        self.reported = 0  # objects the master accepted at the last mount_all (both tiers)
        self.epoch = 0  # the master's, as of our last mount
        self.remounts = 0
        self._remount = asyncio.Event()

    def specs(self) -> list[SegmentSpec]:
        out = []
        if self._dram is not None:
            info = self._transfer.info()
            region = info.regions.get(self._dram.name)
            endpoint = Endpoint(self._transfer.address or "", self._transfer.backend, self._dram.name, info.host_id,
                                (region.shm_name or "") if region else "", self.key_server)
            out.append(SegmentSpec(f"{self.client_id}/dram", "dram", self._dram.nbytes, endpoint))
        if self._lmdb is not None:
            out.append(SegmentSpec(f"{self.client_id}/lmdb", "lmdb", self._lmdb.capacity))
        return out

    async def mount_all(self) -> None:
        """Mount every segment, each with the objects it holds: the LMDB tier first, then DRAM."""
        loop = asyncio.get_running_loop()
        reported = 0
        if self.window is not None:  # the master numbers our journal afresh once it (re)mounts us
            self.window.restart()
        try:
            for spec in sorted(self.specs(), key=lambda s: s.medium != "lmdb"):
                info = segment_to_proto(spec, self.client_id)
                if spec.medium == "dram":
                    assert self._dram is not None
                    records = await loop.run_in_executor(self._lmdb_thread, self.journal.records, self._dram.view)
                else:
                    assert self._lmdb is not None
                    records = await loop.run_in_executor(self._lmdb_thread, self._lmdb.records)
                request = store_pb2.RemountSegmentRequest(client_id=self.client_id, segment=info)
                add = request.objects.add  # (the fastest way to build 10^5..10^6 of them)
                for r in records:
                    add(key=r.key, offset=r.offset, size=r.size, checksum=r.checksum)
                reply = await self._stub.RemountSegment(request, timeout=max(self._timeout, 1e-4 * len(records)))
                self.epoch = reply.master_epoch
                reported += reply.objects_accepted
                if spec.medium == "dram":
                    self.journal.forget(reply.rejected_keys)
                    if records:
                        logger.info("DRAM segment %s re-reported %d objects (%d refused)", spec.name,
                                    reply.objects_accepted, len(reply.rejected_keys))
                    continue
                if reply.rejected_keys:
                    logger.warning("master rejected %d of the %d objects on LMDB (conflicting copies, or removed "
                                   "while it was away); deleting them", len(reply.rejected_keys), len(records))
                    await loop.run_in_executor(self._lmdb_thread, self._lmdb.delete_many, list(reply.rejected_keys))
                logger.info("LMDB tier %s re-reported %d objects", spec.name, reply.objects_accepted)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "mount") from None
        self.reported = reported

    def request_remount(self) -> None:
        self._remount.set()

    async def keep_alive(self, interval_s: float) -> None:
        """Ping; remount when the master does not know us or its epoch changed."""
        down = False
        first = self.window is not None  # the first ping at once: it opens our window for owner reads
        while True:
            try:
                if not first:
                    await asyncio.wait_for(self._remount.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
            first = False
            # a remount request only brings this ping forward; the ping decides. (A request made while
            # a remount was under way, e.g. by the Tasks stream reopening too early, must not remount
            # a second time: that would unmount the segments again and fail their tier moves.)
            self._remount.clear()
            try:
                sent_ns = time.monotonic_ns()  # before the send: the window starts no later than the master's
                touched = self.window.take_touched() if self.window is not None else []
                reply = await self._stub.Ping(store_pb2.PingRequest(client_id=self.client_id, touched=touched),
                                              timeout=self._timeout)
                if self.window is not None:
                    self.window.pinged(sent_ns, reply.known and reply.master_epoch == self.epoch, reply.master_epoch,
                                       reply.journal_seq, reply.serve_window_s)
                if down:
                    logger.info("store master reachable again")
                    down = False
                if not reply.known or reply.master_epoch != self.epoch:
                    logger.warning("store master %s us (epoch %d, ours %d): remounting",
                                   "does not know" if not reply.known else "restarted under", reply.master_epoch,
                                   self.epoch)
                    self._changing()
                    await self.mount_all()
                    self.remounts += 1
                    self._remounted()
            except grpc.aio.AioRpcError as e:
                if not down:
                    logger.warning("store master unreachable (%s); retrying", e.code().name)
                    down = True
                self._unreachable()
            except Exception:  # noqa: BLE001 - keep pinging; a failed remount is retried next round
                logger.exception("store client %s: remount failed", self.client_id)

    async def unmount_all(self) -> None:
        for spec in self.specs():
            try:
                await self._stub.UnmountSegment(store_pb2.UnmountSegmentRequest(client_id=self.client_id,
                                                                                segment=spec.name),
                                                timeout=self._timeout)
            except grpc.aio.AioRpcError as e:
                logger.info("unmount of %s: %s", spec.name, e.details())
