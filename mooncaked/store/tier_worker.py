"""Carries out the master's tier moves inside the client that owns the segments.

The master never touches bytes; when it decides that a DRAM copy moves to LMDB (demote),
is copied there too (persist), that an LMDB object is needed in DRAM for a read (promote),
or that an LMDB value goes (delete), it sends a `TierTask` down this client's `Tasks` stream.
Tasks that arrive together run as one batch in a thread (one LMDB transaction) and are
reported with one `TaskDone`. Journal batches (what was committed to or left this client's
DRAM, dram_journal.py) come on the same stream and are applied at once. The stream is
reopened whenever it ends (master restart, deadline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

import grpc

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.store import metrics
from mooncaked.store.convert import TASK_KIND_NAMES
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import DramSegment
from mooncaked.store.lmdb_tier import LmdbTier, LmdbWrite
from mooncaked.store.owner_server import ServeWindow
from mooncaked.store.records import checksum
from mooncaked.tasks import spawn

logger = logging.getLogger(__name__)

STREAM_DEADLINE_S = 60.0
"""The Tasks stream is reopened this often, so even it has a deadline."""
RETRY_S = 0.2


class TierWorker:
    def __init__(self, client_id: str, stub: store_pb2_grpc.StoreMasterStub, dram: DramSegment | None,
                 lmdb: LmdbTier | None, rpc_timeout_s: float, remount_needed: Callable[[], None],
                 lmdb_thread: Executor | None = None, journal: DramJournal | None = None,
                 window: ServeWindow | None = None) -> None:
        self.client_id = client_id
        self._stub = stub
        self._dram = dram
        self._lmdb = lmdb
        self._timeout = rpc_timeout_s
        self._remount_needed = remount_needed
        self._lmdb_thread = lmdb_thread
        self.journal = journal if journal is not None else DramJournal()
        self.window = window  # owner reads by key: a batch taking keys away is acknowledged (owner_server.py)
        self._inbox: asyncio.Queue[store_pb2.TierTask] = asyncio.Queue()
        self.done = 0  # tasks carried out (tests and drain wait on it)

    async def receive(self) -> None:
        """Keep the Tasks stream open and queue what it brings."""
        quiet_failures = 0
        while True:
            try:
                call = self._stub.Tasks(store_pb2.TasksRequest(client_id=self.client_id), timeout=STREAM_DEADLINE_S)
                async for task in call:
                    quiet_failures = 0
                    if task.kind == store_pb2.TierTask.KIND_JOURNAL:
                        self.journal.apply(task.journal)
                        self._applied(task)
                    else:
                        self._inbox.put_nowait(task)
            except Exception as e:  # noqa: BLE001 - the stream is reopened whatever broke it
                if not isinstance(e, grpc.aio.AioRpcError):
                    logger.exception("store tasks stream of %s failed; reopening", self.client_id)
                elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._remount_needed()
                elif e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    quiet_failures += 1
                    if quiet_failures == 1:
                        logger.warning("store tasks stream of %s broke (%s); reopening", self.client_id, e.code().name)
            await asyncio.sleep(RETRY_S)

    def _applied(self, task: store_pb2.TierTask) -> None:
        """A journal batch is in the journal: owner reads stop serving what it took away, so say so
        at once (a Remove waits for it)."""
        if self.window is None or not task.journal_seq:
            return
        self.window.journal_applied(task.master_epoch, task.journal_seq)
        if any(not e.size for e in task.journal):
            spawn(self._ack(task.journal_seq), f"store-journal-ack-{self.client_id}")

    async def _ack(self, seq: int) -> None:
        try:
            await self._stub.TaskDone(store_pb2.TaskDoneRequest(client_id=self.client_id, journal_seq=seq),
                                      timeout=self._timeout)
        except grpc.aio.AioRpcError as e:  # the Remove waiting for it waits out our window instead
            logger.debug("store client %s: journal batch %d not acknowledged: %s", self.client_id, seq, e.code().name)

    def drop_queued(self) -> int:
        """The master changed (a new leader, or a restart): tasks the old one ordered and we have not
        started are void. A promotion among them would write into DRAM the new master may have given
        to a new object, and a delete would remove an LMDB value it knows again."""
        dropped = 0
        while not self._inbox.empty():
            self._inbox.get_nowait()
            dropped += 1
        if dropped:
            logger.info("store client %s: dropped %d tier tasks of the previous store master", self.client_id, dropped)
        return dropped

    async def work(self) -> None:
        """Run queued tasks in batches and report them."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._inbox.get()]
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            try:
                results = await loop.run_in_executor(self._lmdb_thread, self.run_batch, batch)
            except Exception as e:  # noqa: BLE001 - a broken batch fails its tasks, not the worker
                logger.exception("tier tasks failed")
                results = [store_pb2.TaskResult(task_id=t.task_id, ok=False, error=f"client error: {e!r}")
                           for t in batch]
            self.done += len(batch)
            tracked = [r for r, t in zip(results, batch) if t.kind != store_pb2.TierTask.KIND_DELETE]
            if tracked:
                try:
                    await self._stub.TaskDone(store_pb2.TaskDoneRequest(client_id=self.client_id, results=tracked),
                                              timeout=self._timeout)
                except grpc.aio.AioRpcError as e:
                    logger.warning("could not report %d tier tasks to the store master: %s", len(tracked),
                                   e.details())

    def run_batch(self, batch: list[store_pb2.TierTask]) -> list[store_pb2.TaskResult]:
        """Blocking: demotions and persists in one LMDB transaction, then promotions, then deletes."""
        errors: dict[int, str] = {}
        writes: list[tuple[store_pb2.TierTask, LmdbWrite]] = []
        deletes: list[str] = []
        for t in batch:
            kind = TASK_KIND_NAMES.get(t.kind, "?")
            if self._lmdb is None or (kind in ("demote", "promote") and self._dram is None):
                errors[t.task_id] = "this client has no such tier"
            elif kind in ("demote", "persist"):
                data = self._dram.slice(t.src_offset, t.size)
                if checksum(data) != t.checksum:
                    metrics.CHECKSUM_FAILURES.labels("dram").inc()
                    logger.error("DRAM copy of %s at offset %d is corrupt; not demoting it", t.key, t.src_offset)
                    errors[t.task_id] = "checksum mismatch in DRAM"
                else:
                    writes.append((t, LmdbWrite(t.key, data, t.checksum)))
            elif kind == "promote":
                err = self._lmdb.read_into(t.key, self._dram.slice(t.dst_offset, t.size), t.checksum)
                if "checksum" in err:
                    metrics.CHECKSUM_FAILURES.labels("lmdb").inc()
                if err:
                    errors[t.task_id] = err
            elif kind == "delete":
                deletes.append(t.key)
            else:
                errors[t.task_id] = f"unknown task kind {t.kind}"
        if writes:
            for (t, _), err in zip(writes, self._lmdb.write_many([w for _, w in writes])):
                if err:
                    errors[t.task_id] = err
        if deletes:
            self._lmdb.delete_many(deletes)
        out = []
        for t in batch:
            err = errors.get(t.task_id, "")
            metrics.TIER_TASKS.labels(TASK_KIND_NAMES.get(t.kind, "?"), "error" if err else "ok").inc()
            out.append(store_pb2.TaskResult(task_id=t.task_id, ok=not err, error=err))
        return out
