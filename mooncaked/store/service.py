"""The `StoreMaster` gRPC service over the state machine (master_runner.py serves it).

Typed store errors become gRPC statuses here and nowhere else. The service is also the
master's hooks: it queues tier tasks for each client's `Tasks` stream, resolves the
reads waiting on a promotion and fans pool events out to `WatchPool` streams (pool_events.py). A
housekeeping task ticks the state machine (silent clients, stale puts, overdue tasks, lease-held frees,
eviction).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.transfer import host_id
from mooncaked.store import convert, metrics
from mooncaked.store.fencing import Gate
from mooncaked.store.errors import FailedPrecondition, InvalidArgument, NoRoom, NotFound, StoreError, StoreUnavailable
from mooncaked.store.master import StoreMaster
from mooncaked.store.owner_acks import OwnerAcks
from mooncaked.store.pool_events import PoolEventHub
from mooncaked.store.records import ObjectView, Policy, PoolEventKind, PromotionPending, Task

logger = logging.getLogger(__name__)

SERVICE_NAME = "mooncake.v1.StoreMaster"
HOST_ID = host_id()  # clients with the same id may take the fast path's Unix socket
TICK_S = 0.1
JOURNAL_FLUSH_S = 0.01
"""Journal entries (what was committed to a client's DRAM) go out batched this long after the first."""
MAX_JOURNAL_ENTRIES = 4096  # per message (~200 KB)
SERVE_WINDOW_S = 2.5
"""How long after a Ping was sent its owner may serve reads by key (owner_server.py): a Remove waits at
most this (and ACK_MARGIN_S) for an owner that does not acknowledge the batch taking the keys away."""
ACK_MARGIN_S = 0.25
# Messages queued for one client's Tasks stream before the master gives up on it: a client that
# stopped reading (hung, or hostile) would otherwise grow the master's memory without bound. At the
# journal's pace (one message per JOURNAL_FLUSH_S while it is written to) this is minutes of silence.
MAX_QUEUED_TASKS = 20_000


def _rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map StoreError to its status; log anything else as a bug and answer INTERNAL. A call the
    gate refuses (a standby, or a fenced leader's write: fencing.py) is answered UNAVAILABLE."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: StoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        why = self.gate.refusal(name)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        try:
            return await fn(self, request, context)
        except StoreError as e:
            await context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - the master keeps serving; the bug is logged
            if isinstance(e, asyncio.CancelledError) or type(e).__name__ == "AbortError":
                raise
            logger.exception("StoreMaster.%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"store master bug in {fn.__name__}: {e!r}")

    return wrapper


def _now(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A handler that answers at once: a reply message, or (rarely) an awaitable of the reply
    when part of it must wait. gRPC gets the usual async handler (with _rpc's error mapping);
    the fast path calls `.now` itself and writes the reply without scheduling a task."""

    @functools.wraps(fn)
    async def answer(self: StoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        reply = fn(self, request, context)
        return reply if isinstance(reply, Message) else await reply

    handler = _rpc(answer)
    handler.now = fn  # type: ignore[attr-defined]
    return handler


class StoreService(store_pb2_grpc.StoreMasterServicer):
    """StoreMaster over gRPC; one per master process."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic) -> None:
        self.master = StoreMaster(policy, hooks=self, clock=clock)
        self.gate = Gate()  # who may be served: everyone, unless HA makes this master a standby (fencing.py)
        self.name = ""  # this master's instance name (Describe)
        self._queues: dict[str, asyncio.Queue[Task | store_pb2.TierTask | None]] = {}
        self._journal: dict[str, list[tuple[str, int, int, int]]] = {}  # client -> entries not sent yet
        self._journal_timer: asyncio.TimerHandle | None = None
        self._promotions: dict[int, asyncio.Future[bool]] = {}
        self.max_queued_tasks = MAX_QUEUED_TASKS
        self.fast_path_port = 0  # set by MasterRunner once the fast path listens
        self.fast_path_unix = ""  # and its Unix socket, for clients on this host
        self.pool_events = PoolEventHub(self.master)
        self._owners = OwnerAcks()  # journal numbering and acknowledgements of owners serving by key

    # -- hooks of the state machine ------------------------------------------------------------
    def send_task(self, task: Task) -> None:
        if task.client_id in self.master.clients:  # a dead client's LMDB is cleaned at its remount
            self._enqueue(task.client_id, task)

    def promotion_settled(self, task_id: int, ok: bool) -> None:
        fut = self._promotions.pop(task_id, None)
        if fut is not None and not fut.done():
            fut.set_result(ok)

    def client_dropped(self, client_id: str) -> None:
        self._journal.pop(client_id, None)
        self._owners.dropped(client_id)  # it remounts (its journal numbering starts again) or is gone
        q = self._queues.pop(client_id, None)
        if q is not None:
            q.put_nowait(None)  # ends its Tasks stream; the client remounts and reopens it

    def pool_event(self, kind: PoolEventKind, keys: Sequence[str], medium: str) -> None:
        self.pool_events.add(kind, keys, medium)

    def journal(self, client_id: str, key: str, offset: int, size: int, checksum: int) -> None:
        entries = self._journal.get(client_id)
        if entries is None:
            entries = self._journal[client_id] = []
        entries.append((key, offset, size, checksum))
        if not size:
            self._owners.left.add(client_id)
        if self._journal_timer is None:
            try:
                self._journal_timer = asyncio.get_running_loop().call_later(JOURNAL_FLUSH_S, self.flush_journal)
            except RuntimeError:  # no loop (a master driven by hand): nobody to tell
                self._journal.clear()

    def flush_journal(self) -> None:
        """Send each client what changed in its DRAM since the last flush, on its Tasks stream, in
        batches numbered per client (an owner serving by key acknowledges those that take keys away)."""
        if self._journal_timer is not None:
            self._journal_timer.cancel()
        self._journal_timer = None
        pending, self._journal = self._journal, {}
        self._owners.left.clear()
        for client_id, entries in pending.items():
            if client_id not in self.master.clients:
                continue  # dropped: it remounts with what its own journal holds
            for start in range(0, len(entries), MAX_JOURNAL_ENTRIES):
                chunk = entries[start:start + MAX_JOURNAL_ENTRIES]
                seq = self._owners.number(client_id, any(not e[2] for e in chunk))
                self._enqueue(client_id, convert.journal_to_proto(chunk, seq, self.master.epoch))

    def _enqueue(self, client_id: str, item: Task | store_pb2.TierTask) -> None:
        """Queue for a client's Tasks stream; a client that has left MAX_QUEUED_TASKS unread is dropped
        (its segments unmounted, as for one that stopped pinging: it remounts when it comes back)."""
        q = self._queue(client_id)
        if q.qsize() < self.max_queued_tasks:
            q.put_nowait(item)
        elif q.qsize() == self.max_queued_tasks:  # once: dropped after the decision being applied is done
            q.put_nowait(item)
            why = f"{self.max_queued_tasks} messages on its Tasks stream left unread"
            asyncio.get_running_loop().call_soon(self.master.drop_client, client_id, why)

    def _queue(self, client_id: str) -> asyncio.Queue[Task | store_pb2.TierTask | None]:
        q = self._queues.get(client_id)
        if q is None:
            q = self._queues[client_id] = asyncio.Queue()
        return q

    async def housekeeping(self, tick_s: float = TICK_S) -> None:
        while True:
            if self.gate.writable():  # a standby or fenced leader moves nothing
                self.master.tick()
            await asyncio.sleep(tick_s)

    def close_streams(self) -> None:
        for q in self._queues.values():
            q.put_nowait(None)
        self.pool_events.close()

    def took_over(self) -> None:
        """This master starts to lead (leadership.py): hold back fresh DRAM places for a moment."""
        self.master.hold_dram_places()

    def forget(self) -> None:
        """Drop every object, client and stream and take a new epoch: what a deposed leader does
        (leadership.py), its metadata being stale once another master may have led."""
        self.close_streams()
        self._queues.clear()
        self._journal.clear()
        self._owners = OwnerAcks()
        for fut in self._promotions.values():
            if not fut.done():
                fut.set_result(False)
        self._promotions.clear()
        metrics.MASTERS.unwatch(self.master)
        self.master = StoreMaster(self.master.policy, hooks=self, clock=self.master.clock)
        self.pool_events = PoolEventHub(self.master)
        metrics.MASTERS.watch(self.master)

    # -- segments ---------------------------------------------------------------------------------
    @_now
    def MountSegment(self, request, context):
        self.master.mount(request.client_id, convert.segment_from_proto(request.segment))
        self._owners.mounted(request.client_id, request.segment.endpoint.key_server)
        return store_pb2.MountSegmentReply(ok=True, master_epoch=self.master.epoch)

    @_now
    def RemountSegment(self, request, context):
        # the messages as they are: they read as ObjectRecords (a remount may re-report millions)
        accepted, rejected = self.master.mount(request.client_id, convert.segment_from_proto(request.segment),
                                               request.objects)
        self._owners.mounted(request.client_id, request.segment.endpoint.key_server)
        metrics.OBJECTS_REBUILT.inc(accepted)
        return store_pb2.RemountSegmentReply(objects_accepted=accepted, master_epoch=self.master.epoch,
                                             rejected_keys=rejected)

    @_now
    def EvacuateSegment(self, request, context):
        demotions, left = self.master.evacuate(request.client_id, request.segment)
        return store_pb2.EvacuateSegmentReply(demotions=demotions, left=left)

    @_now
    def ReportWrites(self, request, context):
        accepted, rejected, mounted = self.master.report_writes(request.client_id, request.segment, request.objects)
        return store_pb2.ReportWritesReply(objects_accepted=accepted, rejected_keys=rejected, segment_mounted=mounted)

    @_now
    def UnmountSegment(self, request, context):
        return store_pb2.UnmountSegmentReply(objects_removed=self.master.unmount(request.client_id,
                                                                                 request.segment))

    @_now
    def Ping(self, request, context):
        client = request.client_id
        if request.touched:
            self.master.touched(request.touched)
        if client in self._journal:  # the reply names every batch made so far (owner_server.py's window)
            self.flush_journal()
        owners = self._owners
        return store_pb2.PingReply(known=self.master.ping(client), master_epoch=self.master.epoch,
                                   journal_seq=owners.seq.get(client, 0),
                                   serve_window_s=SERVE_WINDOW_S if client in owners.serving else 0.0)

    # -- put ----------------------------------------------------------------------------------------
    def _put_start(self, r: store_pb2.PutStartRequest) -> store_pb2.PutStartReply:
        plan = self.master.put_start(r.key, r.size, r.checksum, r.replicas, r.preferred_segment, r.soft_pin,
                                     writer=r.client_id)
        return store_pb2.PutStartReply(replicas=[convert.placed_to_proto(p) for p in plan.replicas],
                                       exists=plan.exists)

    @_now
    def PutStart(self, request, context):
        return self._put_start(request)

    @_now
    def BatchPutStart(self, request, context):
        plans = self.master.put_start_many([(r.key, r.size, r.checksum, r.replicas, r.preferred_segment, r.soft_pin)
                                            for r in request.items], writer=request.client_id)
        return store_pb2.BatchPutStartReply(items=[
            store_pb2.PutStartReply(replicas=[convert.placed_to_proto(p) for p in plan.replicas], exists=plan.exists)
            if plan is not None else store_pb2.PutStartReply() for plan in plans])

    @_now
    def PutEnd(self, request, context):
        self.master.put_end(request.key, request.checksum or None)
        return store_pb2.PutEndReply(ok=True)

    @_now
    def PutRevoke(self, request, context):
        self.master.put_revoke(request.key)
        return store_pb2.PutRevokeReply(ok=True)

    @_now
    def BatchPutEnd(self, request, context):
        committed = revoked = 0
        keys, sums = request.keys, request.checksums  # each field read once: a single put's commit is hot
        if sums and len(sums) != len(keys):
            raise InvalidArgument(f"BatchPutEnd: {len(sums)} checksums for {len(keys)} keys "
                                  "(send none, or one per key)")
        for i, key in enumerate(keys):
            try:
                self.master.put_end(key, (sums[i] if sums else 0) or None)
                committed += 1
            except FailedPrecondition as e:
                logger.info("batch PutEnd: %s", e)
        for key in request.revoke_keys:
            try:
                self.master.put_revoke(key)
                revoked += 1
            except FailedPrecondition:
                pass
        reserved_ok = [self.master.put_reserved(r.reservation, r.key, r.checksum, r.soft_pin)
                       for r in request.reserved]
        committed += sum(reserved_ok)
        for rid in request.revoke_reservations:
            revoked += self.master.revoke_reserved(rid)
        return store_pb2.BatchPutEndReply(committed=committed, revoked=revoked, reserved_ok=reserved_ok)

    @_now
    def ReservePlaces(self, request, context):
        if request.size <= 0:
            raise InvalidArgument(f"ReservePlaces: size must be positive, got {request.size}")
        places = self.master.reserve(request.size, request.count, request.replicas, request.preferred_segment,
                                     first_evicts=request.first_for_a_put)
        return store_pb2.ReservePlacesReply(
            reservations=[store_pb2.Reservation(id=rid, replicas=[convert.placed_to_proto(p) for p in plan.replicas])
                          for rid, plan in places],
            timeout_s=self.master.policy.put_timeout_s, master_epoch=self.master.epoch)

    # -- get ----------------------------------------------------------------------------------------
    async def _promoted(self, task_id: int, deadline: float) -> bool:
        fut = self._promotions.get(task_id)
        if fut is None:
            fut = self._promotions[task_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError:
            return False

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """When waiting for promotions must end: the task timeout, or just before the caller's deadline."""
        wait = self.master.policy.task_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining - 0.25)
        return asyncio.get_running_loop().time() + max(0.0, wait)

    async def _get(self, key: str, deadline: float) -> ObjectView:
        """Replicas of a key; waits (until `deadline`) for a promotion and for DRAM room to promote into."""
        loop = asyncio.get_running_loop()
        pause = 0.01
        while True:
            try:
                res = self.master.get_replicas(key)
            except NoRoom:
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)  # demotions are making room
                pause = min(2 * pause, 0.2)
                continue
            if isinstance(res, ObjectView):
                return res
            if not await self._promoted(res.task_id, deadline):
                raise NotFound(f"{key!r} could not be read back from its LMDB tier (corrupt, gone or its owner "
                               "did not answer)")

    def _renew(self, key: str, lease: int = 0) -> ObjectView | PromotionPending | None:
        try:
            return self.master.get_replicas(key, count=False, lease=lease)
        except (NotFound, NoRoom):
            return None

    @_rpc
    async def GetReplicas(self, request, context):
        view = await self._get(request.key, self._deadline(context))
        return store_pb2.GetReplicasReply(object=convert.view_to_proto(view), lease_s=view.lease_s)

    @_now
    def BatchGetReplicas(self, request, context):
        """Replies at once unless an object must first come back from LMDB (or wait for DRAM room).

        A chain longer than its owners' DRAM is read in pieces: what fits now is promoted and
        answered, the rest is named in later_keys, and the reader asks again after reading this
        piece and giving its lease back (release_lease, on that next request)."""
        master = self.master
        if request.release_lease:
            master.release(request.release_lease, request.release_keys)
        if not request.keys:
            return store_pb2.BatchGetReplicasReply(lease_s=master.policy.lease_s)
        lease = master.new_lease()
        views: list[ObjectView | None] = []
        pending: dict[int, int] = {}  # key index -> promotion task id
        short: list[int] = []  # keys whose promotion found no DRAM room now
        for i, key in enumerate(request.keys):
            try:
                res = master.get_replicas(key, lease=lease)
            except NotFound:
                res = None
            except NoRoom:
                res = None
                short.append(i)
            if isinstance(res, PromotionPending):
                pending[i] = res.task_id
                res = None
            views.append(res)
        if pending or short:
            return self._after_promotions(request, context, views, pending, short, lease)
        return self._replicas_reply(views)

    async def _after_promotions(self, request, context, views: list[ObjectView | None], pending: dict[int, int],
                                short: list[int], lease: int) -> store_pb2.BatchGetReplicasReply:
        deadline = self._deadline(context)
        keys = request.keys
        if short and not pending and all(v is None for v in views):
            short = await self._wait_for_room(keys, views, pending, short, lease, deadline)
        ok = await asyncio.gather(*(self._promoted(task_id, deadline) for task_id in pending.values()))
        later = [keys[i] for i in short]
        for i, promoted in zip(pending, ok):
            if not promoted:
                logger.info("%r could not be read back from its LMDB tier (corrupt, gone, or its owner did not "
                            "answer in time)", keys[i])
                continue
            res = self._renew(keys[i], lease)
            self.master.release(-pending[i], (keys[i],))  # the promotion's own lease (tiering.settle)
            if isinstance(res, PromotionPending):  # its promoted copy left already: next time
                later.append(keys[i])
            else:
                views[i] = res
        # the waits took a while: renew every lease now, at reply time
        for i, v in enumerate(views):
            if v is not None and i not in pending:
                res = self._renew(v.key, lease)
                views[i] = res if isinstance(res, ObjectView) else None
        reply = self._replicas_reply(views)
        reply.lease_id = lease
        if later:
            order = {k: i for i, k in enumerate(keys)}
            reply.later_keys.extend(sorted(later, key=order.__getitem__))
        return reply

    async def _wait_for_room(self, keys: Sequence[str], views: list[ObjectView | None], pending: dict[int, int],
                             short: list[int], lease: int, deadline: float) -> list[int]:
        """Nothing of the batch is readable yet: retry until some promotion starts (others' leases
        end, demotions finish) or the deadline; returns the keys still short of room."""
        loop = asyncio.get_running_loop()
        pause = 0.01
        while short and loop.time() + pause <= deadline:
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.2)
            still = []
            for i in short:
                try:
                    res = self.master.get_replicas(keys[i], count=False, lease=lease)
                except NotFound:  # removed meanwhile
                    continue
                except NoRoom:
                    still.append(i)
                    continue
                if isinstance(res, PromotionPending):
                    pending[i] = res.task_id
                else:
                    views[i] = res
            short = still
            if pending or any(v is not None for v in views):
                break
        return short

    def _replicas_reply(self, views: list[ObjectView | None]) -> store_pb2.BatchGetReplicasReply:
        return store_pb2.BatchGetReplicasReply(objects=[convert.view_to_proto(v) for v in views if v is not None],
                                               lease_s=self.master.policy.lease_s)

    @_now
    def Exist(self, request, context):
        return store_pb2.ExistReply(exists=self.master.exist(request.key))

    @_now
    def BatchExist(self, request, context):
        return store_pb2.BatchExistReply(exists=[self.master.exist(k) for k in request.keys])

    @_now
    def LongestPrefix(self, request, context):
        return store_pb2.LongestPrefixReply(num_keys=self.master.longest_prefix(request.keys))

    @_now
    def Remove(self, request, context):
        """Answered once no owner serves the removed keys by key any more (owner_server.py): each owner
        they left acknowledged the journal batch saying so, or its serve window has run out."""
        reply = store_pb2.RemoveReply(removed=self.master.remove(request.keys))
        owners = self._owners
        if not owners.left & owners.serving:
            return reply
        self.flush_journal()
        waits = owners.unacked()
        return owners.wait(waits, SERVE_WINDOW_S + ACK_MARGIN_S, reply) if waits else reply

    @_now
    def PoolStats(self, request, context):
        return convert.stats_to_proto(self.master.stats())

    @_now
    def Describe(self, request, context):
        gate = self.gate
        if not gate.leading:  # a standby: only to who asks for any role, and without its fast path
            if not request.any_role:
                raise StoreUnavailable(gate.standby_message())
            return store_pb2.DescribeReply(role=gate.role, leader=gate.leader, name=self.name, host_id=HOST_ID)
        return store_pb2.DescribeReply(fast_path_port=self.fast_path_port, master_epoch=self.master.epoch,
                                       fast_path_unix=self.fast_path_unix, host_id=HOST_ID, role=gate.role,
                                       leader=gate.leader, name=self.name, writable=gate.writable())

    # -- tier tasks ---------------------------------------------------------------------------------
    async def Tasks(self, request, context) -> AsyncIterator[store_pb2.TierTask]:
        why = self.gate.refusal("Tasks")
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        if request.client_id not in self.master.clients:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"client {request.client_id!r} is not known to this master: mount a segment first")
        q = self._queue(request.client_id)
        while True:
            task = await q.get()
            if task is None:
                return
            if isinstance(task, store_pb2.TierTask):  # a journal batch
                yield task
                continue
            if task.kind != "delete" and task.task_id not in self.master.tasks:
                continue  # settled while queued (its segment went, or it timed out): moving bytes now would harm
            yield convert.task_to_proto(task)

    # -- pool events ----------------------------------------------------------------------------------
    async def WatchPool(self, request, context) -> AsyncIterator[store_pb2.PoolEvents]:
        """The snapshot, then live events; a subscriber cut off for lagging gets RESOURCE_EXHAUSTED."""
        why = self.gate.refusal("WatchPool")
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        sub, snapshot = self.pool_events.subscribe(request.key_prefix, context.peer())
        try:
            for msg in snapshot:
                yield msg
            while True:
                msg = await sub.queue.get()
                if msg is None:
                    if sub.dropped:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"pool watcher cut off: {sub.dropped}; resubscribe")
                    return
                yield msg
        finally:
            self.pool_events.unsubscribe(sub)

    @_now
    def TaskDone(self, request, context):
        if request.client_id not in self.master.clients:
            raise FailedPrecondition(f"client {request.client_id!r} is not known (declared dead?): remount")
        accepted = self.master.task_done(request.client_id, [(r.task_id, r.ok, r.error) for r in request.results])
        if request.journal_seq:
            self._owners.acked(request.client_id, request.journal_seq)
        return store_pb2.TaskDoneReply(accepted=accepted)
