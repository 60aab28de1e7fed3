"""The store master's metadata: clients, segments, objects with their copies and LRU order, tier tasks.

Why one class: every change to what the pool holds goes through one of its public operations, so
what must follow a change is done in one place (pool events, the DRAM owners' journal, LMDB
deletes, space given back when a read lease ends), and a replay of the metadata (HA's op log) has
one place to hook. The deciders (`placement`, `eviction`, `tiering`) only read it; `master.py`
checks requests, asks the deciders and applies their decisions here.

Pool events (`hooks.pool_event`) tell prefix indexes what is readable where: "stored" with the
object's best medium when it is committed or adopted at a remount, and again whenever that medium
changes (a demotion left it on LMDB only, a promotion brought it back to DRAM); "removed" when it
stops being readable, by whatever path (`forget` is the only way out). `_announce` after any
change to a committed object's copies keeps those events exact.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from mooncaked.store.free_order import FreeOrder
from mooncaked.store.records import (
    Client, ObjectMeta, ObjectRecord, Placed, Policy, PoolEventKind, Replica, Segment, Task, TaskKind,
)

logger = logging.getLogger(__name__)


class MasterHooks(Protocol):
    """What the master tells the world: tasks to send, promotions settled, clients gone, pool events."""

    def send_task(self, task: Task) -> None: ...
    def promotion_settled(self, task_id: int, ok: bool) -> None: ...
    def client_dropped(self, client_id: str) -> None: ...
    def pool_event(self, kind: PoolEventKind, keys: Sequence[str], medium: str) -> None:
        """`keys` became readable on `medium` ("dram" | "lmdb"), or ("removed", medium "") stopped being
        readable. Called on the hot path: an implementation only records it."""
    def journal(self, client_id: str, key: str, offset: int, size: int, checksum: int) -> None:
        """A complete copy of `key` is now at `offset` of `client_id`'s DRAM segment (size 0: the copy
        there left). Called on the hot path: an implementation only records it."""


class NoHooks:
    """For a master nobody listens to (unit tests): tasks wait in `master.tasks`."""

    def send_task(self, task: Task) -> None:
        pass

    def promotion_settled(self, task_id: int, ok: bool) -> None:
        pass

    def client_dropped(self, client_id: str) -> None:
        pass

    def pool_event(self, kind: PoolEventKind, keys: Sequence[str], medium: str) -> None:
        pass

    def journal(self, client_id: str, key: str, offset: int, size: int, checksum: int) -> None:
        pass


class Catalog:
    """The metadata and the operations that change it. Its dicts are read freely; only its methods
    write them (and the records in them)."""

    def __init__(self, policy: Policy, hooks: MasterHooks, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.hooks = hooks
        self.clock = clock
        self.segments: dict[str, Segment] = {}
        self.free_order = FreeOrder()  # the DRAM segments, by free bytes (placement asks)
        self.objects: dict[str, ObjectMeta] = {}
        self.committed = 0  # objects readers can get (PoolStats: not a walk over a million)
        self.clients: dict[str, Client] = {}
        self.tasks: dict[int, Task] = {}
        self.pending: dict[str, None] = {}  # uncommitted keys, oldest PutStart first
        # (due, seq, seg, offset, size, held): bytes freed later (a read lease; or held: a dropped place's
        # writer may still write, counted as leaving the segment meanwhile)
        self._deferred: list[tuple[float, int, Segment, int, int, bool]] = []
        # task ids unlike any other master's: one that a master now gone (restarted, or deposed under
        # HA) handed out must be unknown here, never taken for one of ours
        self._seq = itertools.count(random.SystemRandom().randrange(1, 1 << 62))

    # -- reads ---------------------------------------------------------------------------------------
    def tier_of(self, client_id: str, medium: str) -> Segment | None:
        """The client's segment of that medium (a client lends at most one of each)."""
        client = self.clients.get(client_id)
        for name in client.segments if client else ():
            seg = self.segments.get(name)
            if seg is not None and seg.medium == medium:
                return seg
        return None

    def medium_of(self, obj: ObjectMeta) -> str:
        """Where a reader finds the object at best: "dram" if any complete copy is in DRAM, else "lmdb"
        if one is on LMDB, else "" (no complete copy)."""
        best = ""
        for r in obj.replicas:
            seg = self.segments.get(r.segment) if r.complete else None
            if seg is not None:
                if seg.medium == "dram":
                    return "dram"
                best = seg.medium
        return best

    # -- clients and segments ------------------------------------------------------------------------
    def touch(self, client_id: str, create: bool) -> Client | None:
        """A client was heard from now (`create`: a new one is added)."""
        client = self.clients.get(client_id)
        if client is None and create:
            client = self.clients[client_id] = Client(client_id, self.clock())
        if client is not None:
            client.last_seen = self.clock()
        return client

    def remove_client(self, client_id: str) -> Client | None:
        """Forget a client (its segments are unmounted first by the caller)."""
        return self.clients.pop(client_id, None)

    def add_segment(self, seg: Segment) -> None:
        self.segments[seg.name] = seg
        if seg.medium == "dram":
            self.free_order.add(seg)
        client = self.clients.get(seg.owner)
        if client is not None:
            client.segments.add(seg.name)

    def adopt(self, seg: Segment, rec: ObjectRecord, fresh: list[str]) -> tuple[ObjectMeta, Replica] | None:
        """Take a re-reported object into the metadata; None when it conflicts or does not fit. An object
        new to the master is listed in `fresh`, not announced (a remount re-reports up to millions: the
        caller announces them together)."""
        key = rec.key
        if not key or rec.size <= 0:
            return None
        obj = self.objects.get(key)
        if obj is not None and (not obj.committed or obj.size != rec.size or obj.checksum != rec.checksum
                                or obj.replica_on(seg.name)):
            return None
        if not seg.alloc.take(rec.offset, rec.size):
            return None
        self.free_order.changed(seg)
        rep = Replica(seg.name, rec.offset if seg.medium == "dram" else 0, rec.size, True)
        seg.keys[key] = None
        seg.held += 1
        if obj is None:
            obj = self.objects[key] = ObjectMeta(key, rec.size, rec.checksum, [rep], True, self.clock(),
                                                 medium=seg.medium)
            self.committed += 1
            fresh.append(key)
        else:
            obj.replicas.append(rep)
            self._announce(obj)
        return obj, rep

    def remove_segment(self, seg: Segment) -> int:
        """Forget a segment and every copy on it (its tasks settled first by the caller); returns how many
        objects went with it."""
        del self.segments[seg.name]
        self.free_order.remove(seg)
        client = self.clients.get(seg.owner)
        if client is not None:
            client.segments.discard(seg.name)
        removed = 0
        for key in list(seg.keys):
            obj = self.objects.get(key)
            rep = obj.replica_on(seg.name) if obj else None
            if obj is None or rep is None:
                continue
            obj.replicas.remove(rep)
            if not any(r.complete for r in obj.replicas) and obj.committed or not obj.replicas:
                removed += obj.committed
                self.forget(obj)
            else:
                self._announce(obj)  # its DRAM copy went with the segment: LMDB only now
        return removed

    # -- objects -------------------------------------------------------------------------------------
    def take_space(self, seg: Segment, size: int) -> Placed:
        """Allocate a new copy's bytes on a segment a decider found room on."""
        offset = seg.alloc.alloc(size)
        assert offset is not None, f"no room for {size} bytes on {seg.name} that a decider found"
        self.free_order.changed(seg)
        return Placed(Replica(seg.name, offset, size), seg)

    def new_object(self, key: str, size: int, checksum: int, placed: Sequence[Placed], soft_pin: bool) -> ObjectMeta:
        """A put started: an uncommitted object with its places (readers see nothing of it yet)."""
        obj = ObjectMeta(key, size, checksum, [p.replica for p in placed], False, self.clock(), soft_pin=soft_pin)
        self.objects[key] = obj
        self.pending[key] = None
        for p in placed:
            p.segment.keys[key] = None
        return obj

    def rename(self, obj: ObjectMeta, key: str, soft_pin: bool) -> None:
        """A place reserved ahead takes its object's key (newest in its segments' LRU order)."""
        del self.objects[obj.key]
        self.pending.pop(obj.key, None)
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None:
                seg.keys.pop(obj.key, None)
                seg.keys[key] = None
        obj.key, obj.soft_pin = key, soft_pin
        self.objects[key] = obj

    def commit(self, obj: ObjectMeta, checksum: int | None) -> None:
        """Readers get the object from now on (the caller journals its DRAM copies: `landed`)."""
        if checksum is not None:
            obj.checksum = checksum
        obj.committed = True
        self.committed += 1
        for r in obj.replicas:
            if not r.complete:
                r.complete = True
                self._held(r, 1)
        self.pending.pop(obj.key, None)
        self.touch_lru(obj)
        self._announce(obj)

    def landed(self, obj: ObjectMeta, rep: Replica, seg: Segment) -> None:
        """A complete copy is now on a DRAM segment: its owner journals it (re-reported at a remount)."""
        self.hooks.journal(seg.owner, obj.key, rep.offset, rep.size, obj.checksum)

    def touch_lru(self, obj: ObjectMeta) -> None:
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None and obj.key in seg.keys:
                seg.keys.move_to_end(obj.key)

    def add_copy(self, obj: ObjectMeta, seg: Segment) -> Replica:
        """A copy of `obj` being written to `seg` (a tier move's target; complete once the move is done)."""
        offset = seg.alloc.alloc(obj.size)
        assert offset is not None, f"no room for {obj.size} bytes on {seg.name} that a decider found"
        self.free_order.changed(seg)
        rep = Replica(seg.name, offset, obj.size)
        obj.replicas.append(rep)
        seg.keys[obj.key] = None
        return rep

    def complete(self, obj: ObjectMeta, rep: Replica) -> None:
        """A tier move wrote this copy: readers may use it."""
        if not rep.complete:
            rep.complete = True
            self._held(rep, 1)
        self._announce(obj)
        seg = self.segments.get(rep.segment)
        if seg is not None and seg.medium == "dram":
            self.landed(obj, rep, seg)

    def _held(self, rep: Replica, by: int) -> None:
        seg = self.segments.get(rep.segment)
        if seg is not None:
            seg.held += by

    def drop_copy(self, obj: ObjectMeta, rep: Replica, send_delete: bool = True, hold_until: float = 0.0) -> None:
        """Remove one copy (a leased DRAM copy's bytes stay reserved until the lease ends, and a DRAM place
        dropped while its writer may still write into it until ``hold_until``); the object goes with its
        last complete copy."""
        obj.replicas.remove(rep)
        seg = self.segments.get(rep.segment)
        if seg is not None:
            seg.keys.pop(obj.key, None)
            seg.held -= rep.complete
            if seg.medium == "dram" and rep.complete:
                self.hooks.journal(seg.owner, obj.key, rep.offset, 0, 0)
            now = self.clock()
            if seg.medium == "dram" and hold_until > now:
                seg.leaving_bytes += rep.size  # freed at hold_until: eviction counts it as on its way out
                heapq.heappush(self._deferred, (max(hold_until, obj.lease_until), next(self._seq), seg, rep.offset,
                                                rep.size, True))
            elif seg.medium == "dram" and obj.lease_until > now:
                heapq.heappush(self._deferred, (obj.lease_until, next(self._seq), seg, rep.offset, rep.size, False))
            else:
                seg.alloc.free(rep.offset, rep.size)
                self.free_order.changed(seg)
            if seg.medium == "lmdb" and rep.complete and send_delete:
                self.send_delete(seg.owner, obj.key, seg.name, rep.size)
        if obj.committed and not any(r.complete for r in obj.replicas):
            self.forget(obj)
        else:
            self._announce(obj)  # e.g. a demoted object's DRAM copy went: LMDB only now

    def forget(self, obj: ObjectMeta, hold_until: float = 0.0) -> None:
        """Remove an object and every copy of it (DRAM bytes held until ``hold_until``: see drop_copy)."""
        if self.objects.get(obj.key) is not obj:
            return
        del self.objects[obj.key]
        self.pending.pop(obj.key, None)
        for rep in list(obj.replicas):
            self.drop_copy(obj, rep, hold_until=hold_until)
        if obj.committed:
            self.committed -= 1
        if obj.medium:
            obj.medium = ""
            self.hooks.pool_event("removed", (obj.key,), "")

    def free_lapsed(self, now: float) -> None:
        """Give back the bytes of dropped copies whose read leases have ended."""
        while self._deferred and self._deferred[0][0] <= now:
            _, _, seg, offset, size, held = heapq.heappop(self._deferred)
            if self.segments.get(seg.name) is seg:
                seg.alloc.free(offset, size)
                self.free_order.changed(seg)
                if held:
                    seg.leaving_bytes = max(0, seg.leaving_bytes - size)

    def _announce(self, obj: ObjectMeta) -> None:
        """Tell pool watchers where a committed object is readable, if that changed (after its copies did)."""
        if not obj.committed or self.objects.get(obj.key) is not obj:
            return
        medium = self.medium_of(obj)
        if medium and medium != obj.medium:
            obj.medium = medium
            self.hooks.pool_event("stored", (obj.key,), medium)

    # -- reads and their leases ----------------------------------------------------------------------
    def lend(self, obj: ObjectMeta, lease: int, now: float, count: bool) -> None:
        """A reader got the object's copies: they are leased to it, the object is the newest in its
        segments' LRU order, and (`count`) one read hotter."""
        self.grant_lease(obj, lease, now)
        if count:
            obj.hits += 1
        self.touch_lru(obj)

    def grant_lease(self, obj: ObjectMeta, lease: int = 0, now: float | None = None) -> None:
        """Hold the object's copies for a reader for `lease_s` (or until it releases lease id `lease`)."""
        now = self.clock() if now is None else now
        until = now + self.policy.lease_s
        if obj.lease_until <= now:
            obj.leases = None  # every earlier lease lapsed
        if lease or obj.leases is not None:
            leases = obj.leases
            if leases is None:
                leases = obj.leases = {0: obj.lease_until} if obj.lease_until > now else {}
            elif len(leases) > 16:
                for k in [k for k, end in leases.items() if end <= now]:
                    del leases[k]
            leases[lease] = until
        if until > obj.lease_until:
            obj.lease_until = until

    def release(self, lease: int, keys: Iterable[str]) -> int:
        """End lease `lease` on these objects; returns how many leases ended."""
        now = self.clock()
        ended = 0
        for key in keys:
            obj = self.objects.get(key)
            leases = obj.leases if obj is not None else None
            if not leases or leases.pop(lease, None) is None:
                continue
            ended += 1
            live = [end for end in leases.values() if end > now]
            if live:
                obj.lease_until = max(live)
            else:
                obj.leases = None
                obj.lease_until = min(obj.lease_until, now)
        return ended

    # -- tier tasks ----------------------------------------------------------------------------------
    def open_task(self, kind: TaskKind, obj: ObjectMeta, src: Replica, source: Segment, dst: Replica) -> Task:
        """Order `source`'s owner to copy `src` to `dst`; the object counts as busy (never evicted) until
        the task settles (`close_task`), a demotion's bytes as leaving `source`."""
        task = Task(next(self._seq), kind, source.owner, obj.key, obj.size, obj.checksum, src.segment, src.offset,
                    dst.segment, dst.offset, self.clock() + self.policy.task_timeout_s)
        self.tasks[task.task_id] = task
        obj.busy += 1
        if kind == "promote":
            obj.promotion = task.task_id
        elif kind == "demote":
            source.leaving_bytes += obj.size
        self.hooks.send_task(task)
        return task

    def close_task(self, task: Task) -> ObjectMeta | None:
        """A task ended (reported, timed out, or its segment went); returns its object if still known."""
        del self.tasks[task.task_id]
        obj = self.objects.get(task.key)
        if obj is not None:
            obj.busy -= 1
        if task.kind == "demote":
            src_seg = self.segments.get(task.src_segment)
            if src_seg is not None:
                src_seg.leaving_bytes = max(0, src_seg.leaving_bytes - task.size)
        elif task.kind == "promote" and obj is not None and obj.promotion == task.task_id:
            obj.promotion = 0
        return obj

    def send_delete(self, client_id: str, key: str, segment: str, size: int) -> None:
        """Tell an owner to delete an LMDB value (no answer, nothing waits for it)."""
        self.hooks.send_task(Task(next(self._seq), "delete", client_id, key, size, 0, segment, 0))
