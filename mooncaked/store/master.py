"""The store master's state machine: segments, objects, leases, placement and tier moves.

Metadata only, no gRPC, no bytes, no clock of its own (it is handed one), so every rule
here is tested by calling methods. `service.py` puts it on the wire; `placement.py` picks
where copies go, `eviction.py` what leaves a full segment. Tier moves (demote DRAM -> LMDB,
promote LMDB -> DRAM, delete from LMDB; `tiering.py`) are `Task`s handed to the segment's
owner through `hooks.send_task`; the owner reports back with `task_done`.

Pool events (`hooks.pool_event`) tell prefix indexes what is readable where: "stored" with
the object's best medium when it is committed or adopted at a remount, and again whenever
that medium changes (a demotion left it on LMDB only, a promotion brought it back to DRAM);
"removed" when it stops being readable, by whatever path (`_forget` is the only way out).
`_announce` after any change to a committed object's copies keeps those events exact.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from mooncaked.store import eviction, metrics, placement, tiering
from mooncaked.store.allocator import ByteBudget, ExtentAllocator
from mooncaked.store.errors import FailedPrecondition, InvalidArgument, NoRoom, NotFound
from mooncaked.store.records import (
    MAX_KEY_BYTES, MEDIA, Client, ObjectMeta, ObjectRecord, ObjectView, Placed, Policy, PoolStats,
    PoolEventKind, PromotionPending, PutPlan, Replica, RESERVED_PREFIX, Segment, SegmentSpec, SegmentUse, Task,
)

logger = logging.getLogger(__name__)

MAX_RESERVE = 1024  # places one ReservePlaces call may take


class MasterHooks(Protocol):
    """What the master tells the world: tasks to send, promotions settled, clients gone, pool events."""

    def send_task(self, task: Task) -> None: ...
    def promotion_settled(self, task_id: int, ok: bool) -> None: ...
    def client_dropped(self, client_id: str) -> None: ...
    def pool_event(self, kind: PoolEventKind, keys: Sequence[str], medium: str) -> None:
        """`keys` became readable on `medium` ("dram" | "lmdb"), or ("removed", medium "") stopped being
        readable. Called on the hot path: an implementation only records it."""


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


class StoreMaster:
    def __init__(self, policy: Policy = Policy(), hooks: MasterHooks | None = None,
                 clock: Callable[[], float] = time.monotonic, epoch: int | None = None) -> None:
        self.policy = policy
        self.hooks: MasterHooks = hooks or NoHooks()
        self.clock = clock
        self.epoch = epoch or random.SystemRandom().randrange(1, 1 << 63)
        self.segments: dict[str, Segment] = {}
        self.objects: dict[str, ObjectMeta] = {}
        self.clients: dict[str, Client] = {}
        self.tasks: dict[int, Task] = {}
        self._pending: dict[str, None] = {}  # uncommitted keys, oldest PutStart first
        self._deferred: list[tuple[float, int, Segment, int, int]] = []  # (due, seq, seg, offset, size)
        self._seq = itertools.count(1)
        self._reservation_ids = itertools.count(1)
        self.hits = self.misses = self.evictions = self.demotions = self.promotions = 0

    # -- segments and clients ----------------------------------------------------------------
    def mount(self, client_id: str, spec: SegmentSpec,
              records: Sequence[ObjectRecord] = ()) -> tuple[int, list[str]]:
        """Lend a segment (replacing an earlier mount of that name); returns (accepted, rejected keys)."""
        if not client_id:
            raise InvalidArgument("client_id is empty: every client names itself")
        if not spec.name:
            raise InvalidArgument("segment name is empty")
        if spec.medium not in MEDIA:
            raise InvalidArgument(f"segment {spec.name!r}: medium {spec.medium!r} is not one of {MEDIA}")
        if spec.capacity <= 0:
            raise InvalidArgument(f"segment {spec.name!r}: capacity must be positive, got {spec.capacity}")
        if spec.medium == "dram" and not (spec.endpoint.address and spec.endpoint.region):
            raise InvalidArgument(f"DRAM segment {spec.name!r} has no transfer endpoint (address and region)")
        client = self._touch(client_id, create=True)
        old = self.segments.get(spec.name)
        if old is not None:
            logger.info("segment %s remounted by %s; dropping what the earlier mount held", spec.name, client_id)
            self._unmount(old)
        alloc = ExtentAllocator(spec.capacity) if spec.medium == "dram" else ByteBudget(spec.capacity)
        seg = Segment(spec.name, client_id, spec.medium, spec.capacity, spec.endpoint, alloc)
        self.segments[seg.name] = seg
        client.segments.add(seg.name)
        accepted, rejected = 0, []
        for rec in records:
            if self._adopt(seg, rec):
                accepted += 1
            else:
                rejected.append(rec.key)
        logger.info("mounted %s segment %s of %s: %d bytes, %d objects re-reported (%d rejected)",
                    seg.medium, seg.name, client_id, seg.capacity, accepted, len(rejected))
        eviction.evict_if_needed(self, seg)
        return accepted, rejected

    def _adopt(self, seg: Segment, rec: ObjectRecord) -> bool:
        """Take a re-reported object into the metadata; False when it conflicts or does not fit."""
        if not rec.key or rec.size <= 0:
            return False
        obj = self.objects.get(rec.key)
        if obj is not None and (not obj.committed or obj.size != rec.size or obj.checksum != rec.checksum
                                or obj.replica_on(seg.name)):
            return False
        if not seg.alloc.take(rec.offset, rec.size):
            return False
        offset = rec.offset if seg.medium == "dram" else 0
        if obj is None:
            obj = ObjectMeta(rec.key, rec.size, rec.checksum, [], True, self.clock())
            self.objects[rec.key] = obj
            metrics.OBJECTS.inc()
        obj.replicas.append(Replica(seg.name, offset, rec.size, complete=True))
        seg.keys[rec.key] = None
        self._announce(obj)
        return True

    def unmount(self, client_id: str, name: str) -> int:
        seg = self._segment(name)
        if seg.owner != client_id:
            raise FailedPrecondition(f"segment {name!r} belongs to client {seg.owner!r}, not {client_id!r}")
        return self._unmount(seg)

    def _unmount(self, seg: Segment) -> int:
        """Forget a segment and every copy on it; returns how many objects went with it."""
        for task in [t for t in self.tasks.values() if seg.name in (t.src_segment, t.dst_segment)]:
            tiering.settle(self, task, False, "segment unmounted")
        del self.segments[seg.name]
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
                self._forget(obj)
            else:
                self._announce(obj)  # its DRAM copy went with the segment: LMDB only now
        logger.info("unmounted segment %s of %s: %d objects dropped", seg.name, seg.owner, removed)
        return removed

    def evacuate(self, client_id: str, name: str) -> tuple[int, int]:
        """Move a DRAM segment's only copies to its owner's LMDB tier; returns (demotions ordered, left)."""
        seg = self._segment(name)
        if seg.owner != client_id:
            raise FailedPrecondition(f"segment {name!r} belongs to client {seg.owner!r}, not {client_id!r}")
        if seg.medium != "dram":
            raise InvalidArgument(f"segment {name!r} is {seg.medium}; only DRAM segments are evacuated")
        return eviction.evacuate(self, seg)

    def ping(self, client_id: str) -> bool:
        """A client's heartbeat; False means the master does not know it (remount)."""
        return self._touch(client_id, create=False) is not None

    def _touch(self, client_id: str, create: bool) -> Client | None:
        client = self.clients.get(client_id)
        if client is None and create:
            client = self.clients[client_id] = Client(client_id, self.clock())
        if client is not None:
            client.last_seen = self.clock()
        return client

    def _segment(self, name: str) -> Segment:
        seg = self.segments.get(name)
        if seg is None:
            raise NotFound(f"segment {name!r} is not mounted (its client stopped pinging, or never mounted it); "
                           "the client remounts after its next ping")
        return seg

    # -- put -------------------------------------------------------------------------------------
    def put_start_many(self, items: Sequence[tuple[str, int, int, int, str, bool]]) -> list[PutPlan | None]:
        """PutStart for a batch; None where no room was found. Room for all of those is then made
        at once (demotions), so a retry after they finish places the whole rest of the batch."""
        plans: list[PutPlan | None] = []
        short = 0
        for key, size, csum, replicas, preferred, soft_pin in items:
            try:
                plans.append(self.put_start(key, size, csum, replicas, preferred, soft_pin, make_room=False))
            except NoRoom:
                plans.append(None)
                short += size
        placement.make_room_for(self, short)
        return plans

    def put_start(self, key: str, size: int, checksum: int, replicas: int = 0, preferred: str = "",
                  soft_pin: bool = False, make_room: bool = True) -> PutPlan:
        """Reserve places for one object; readers see nothing until `put_end`."""
        self._check_key(key)
        return self._start(key, size, checksum, replicas, preferred, soft_pin, make_room)

    def _start(self, key: str, size: int, checksum: int, replicas: int, preferred: str, soft_pin: bool,
               make_room: bool, ahead: bool = False) -> PutPlan:
        """`ahead`: a place reserved before any object needs it takes free space only (evicts nothing)."""
        if size <= 0:
            raise InvalidArgument(f"object {key!r}: size must be positive, got {size}")
        drams = [s for s in self.segments.values() if s.medium == "dram"]
        biggest = max((s.capacity for s in drams), default=0)
        limit = min(self.policy.max_object_bytes, biggest) if drams else self.policy.max_object_bytes
        if size > limit:
            raise InvalidArgument(f"object {key!r} of {size} bytes is larger than the largest object the pool "
                                  f"takes ({limit} bytes: max object size or the biggest DRAM segment)")
        pref = None
        if preferred:
            pref = self.segments.get(preferred)
            if pref is None or pref.medium != "dram":
                raise FailedPrecondition(f"preferred segment {preferred!r} is not a mounted DRAM segment "
                                         "(dropped after its client went silent?); remount it or pass none")
        obj = self.objects.get(key)
        if obj is not None:
            if obj.committed or self.clock() - obj.started_at < self.policy.put_timeout_s:
                self._touch_lru(obj)
                return PutPlan([], exists=True)
            self._discard_stale(obj)
        if not drams:
            raise NoRoom("no DRAM segment is mounted: start an engine with --store-dram-bytes")
        placed = placement.place(self, drams, size, min(replicas or self.policy.replicas, len(drams)), pref,
                                 make_room and not ahead, evict=not ahead)
        if not placed:
            raise NoRoom(f"no DRAM segment has {size} free bytes for {key!r} (copies are being moved to LMDB "
                         "or held by read leases); retry shortly or lend more DRAM")
        obj = ObjectMeta(key, size, checksum, [p.replica for p in placed], False, self.clock(), soft_pin=soft_pin)
        self.objects[key] = obj
        self._pending[key] = None
        for p in placed:
            p.segment.keys[key] = None
            if not ahead:
                eviction.evict_if_needed(self, p.segment)
        return PutPlan(placed, exists=False)

    def put_end(self, key: str, checksum: int | None = None) -> None:
        """Commit: from now on readers get the object (whose checksum the writer may give only now)."""
        obj = self.objects.get(key)
        if obj is None:
            raise FailedPrecondition(f"PutEnd({key!r}) without a PutStart in progress "
                                     f"(never started, revoked, or discarded after {self.policy.put_timeout_s:g}s)")
        if obj.committed:
            return
        self._commit(obj, checksum)

    def _commit(self, obj: ObjectMeta, checksum: int | None) -> None:
        if not obj.replicas:
            self._forget(obj)
            raise FailedPrecondition(f"every place reserved for {obj.key!r} was lost (its segment's client died); "
                                     "put it again")
        if checksum is not None:
            obj.checksum = checksum
        obj.committed = True
        for r in obj.replicas:
            r.complete = True
        self._pending.pop(obj.key, None)
        self._touch_lru(obj)
        metrics.OBJECTS.inc()
        self._announce(obj)

    # -- places reserved ahead ---------------------------------------------------------------------
    def reserve(self, size: int, count: int, replicas: int = 0, preferred: str = "",
                first_evicts: bool = True) -> list[tuple[int, PutPlan]]:
        """Up to `count` places for objects of `size` whose keys come at commit (`put_reserved`).

        Each is an uncommitted object under an internal key, so everything a pending put gets
        (no eviction, discarded after put_timeout_s, dropped with its segment) holds for it too.
        With `first_evicts` the first is placed as a PutStart would be (it may evict: a put is in
        hand); the others only take free space. NoRoom only when not even one fits.
        """
        if count <= 0:
            raise InvalidArgument(f"ReservePlaces: count must be positive, got {count}")
        out: list[tuple[int, PutPlan]] = []
        for _ in range(min(count, MAX_RESERVE)):
            rid = next(self._reservation_ids)
            try:
                plan = self._start(f"{RESERVED_PREFIX}{rid}", size, 0, replicas, preferred, False,
                                   make_room=not out, ahead=bool(out) or not first_evicts)
            except NoRoom:
                if not out:
                    raise
                break
            out.append((rid, plan))
        return out

    def put_reserved(self, reservation: int, key: str, checksum: int, soft_pin: bool = False) -> bool:
        """Commit bytes written into a reserved place under `key`; True when the object is in the pool
        (committed now, or it already was and the place is given back), False for an unknown place."""
        self._check_key(key)
        place = self.objects.get(f"{RESERVED_PREFIX}{reservation}")
        if place is None or place.committed:
            return False
        existing = self.objects.get(key)
        if existing is not None:
            if existing.committed or self.clock() - existing.started_at < self.policy.put_timeout_s:
                self._forget(place)
                self._touch_lru(existing)
                return True
            self._discard_stale(existing)
        del self.objects[place.key]
        self._pending.pop(place.key, None)
        for r in place.replicas:  # the place's copies now hold `key`, newest in their segment's LRU order
            seg = self.segments.get(r.segment)
            if seg is not None:
                seg.keys.pop(place.key, None)
                seg.keys[key] = None
        place.key, place.soft_pin = key, soft_pin
        self.objects[key] = place
        self._commit(place, checksum)
        return True

    def revoke_reserved(self, reservation: int) -> bool:
        place = self.objects.get(f"{RESERVED_PREFIX}{reservation}")
        if place is None or place.committed:
            return False
        self._forget(place)
        return True

    def put_revoke(self, key: str) -> None:
        obj = self.objects.get(key)
        if obj is None or obj.committed:
            raise FailedPrecondition(f"PutRevoke({key!r}) without a PutStart in progress")
        self._forget(obj)

    def _discard_stale(self, obj: ObjectMeta) -> None:
        if obj.key.startswith(RESERVED_PREFIX):  # a writer that went idle: its places simply lapse
            logger.debug("reserved place %s lapsed unused after %.1fs", obj.key[len(RESERVED_PREFIX):],
                         self.policy.put_timeout_s)
        else:
            logger.warning("discarding put of %s: no PutEnd within %.1fs", obj.key, self.policy.put_timeout_s)
            metrics.STALE_PUTS.inc()
        self._forget(obj)

    # -- get and queries ---------------------------------------------------------------------------
    def get_replicas(self, key: str, count: bool = True) -> ObjectView | PromotionPending:
        """Complete DRAM copies under a read lease; an LMDB-only object is promoted first.
        `count=False` renews a lease without counting a second lookup."""
        obj = self.objects.get(key)
        if obj is None or not obj.committed:
            if count:
                self.misses += 1
                metrics.lookup("miss").inc()
            raise NotFound(f"no object {key!r} in the pool")
        now = self.clock()
        placed = [Placed(r, self.segments[r.segment]) for r in obj.replicas
                  if r.complete and self.segments[r.segment].medium == "dram"]
        if not placed:
            return tiering.promote(self, obj)
        obj.lease_until = max(obj.lease_until, now + self.policy.lease_s)
        if count:
            obj.hits += 1
            self.hits += 1
            metrics.lookup("hit").inc()
        self._touch_lru(obj)
        return ObjectView(obj.key, obj.size, obj.checksum, placed, self.policy.lease_s)

    def exist(self, key: str) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.committed

    def longest_prefix(self, keys: Iterable[str]) -> int:
        """How many leading keys of a block-hash chain are committed."""
        n = 0
        for key in keys:
            if not self.exist(key):
                break
            n += 1
        return n

    def remove(self, keys: Iterable[str]) -> int:
        """Drop objects (a leased copy's bytes stay reserved until its lease ends)."""
        removed = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None:
                removed += obj.committed
                self._forget(obj)
        return removed

    def _check_key(self, key: str) -> None:
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidArgument(f"a key must be 1..{MAX_KEY_BYTES} bytes (e.g. 'model_id/block_hash'), "
                                  f"got {key[:80]!r}")
        if key.startswith(RESERVED_PREFIX):
            raise InvalidArgument(f"keys starting with {RESERVED_PREFIX!r} name reserved places, not objects")

    # -- tier tasks ---------------------------------------------------------------------------------
    def send_delete(self, client_id: str, key: str, segment: str, size: int) -> None:
        task = Task(next(self._seq), "delete", client_id, key, size, 0, segment, 0)
        self.hooks.send_task(task)

    def task_done(self, client_id: str, results: Iterable[tuple[int, bool, str]]) -> int:
        """The owner's report on tasks; returns how many matched a task still open."""
        self._touch(client_id, create=False)
        accepted = 0
        for task_id, ok, error in results:
            task = self.tasks.get(task_id)
            if task is None or task.client_id != client_id:
                continue
            accepted += 1
            tiering.settle(self, task, ok, error)
        return accepted

    # -- housekeeping ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Expire silent clients, stale puts and overdue tasks; free what leases held; evict."""
        now = self.clock()
        for client in [c for c in self.clients.values() if now - c.last_seen > self.policy.client_ttl_s]:
            self.drop_client(client.client_id, f"silent for {now - client.last_seen:.1f}s")
        for key in list(self._pending):
            obj = self.objects[key]
            if now - obj.started_at < self.policy.put_timeout_s:
                break
            self._discard_stale(obj)
        for task in [t for t in self.tasks.values() if t.deadline < now]:
            tiering.settle(self, task, False, f"timed out after {self.policy.task_timeout_s:g}s")
        while self._deferred and self._deferred[0][0] <= now:
            _, _, seg, offset, size = heapq.heappop(self._deferred)
            if self.segments.get(seg.name) is seg:
                seg.alloc.free(offset, size)
        for seg in list(self.segments.values()):
            eviction.evict_if_needed(self, seg)

    def drop_client(self, client_id: str, why: str) -> None:
        client = self.clients.pop(client_id, None)
        if client is None:
            return
        logger.warning("client %s is dead (%s): unmounting its segments %s", client_id, why,
                       sorted(client.segments))
        metrics.DEAD_CLIENTS.inc()
        for name in list(client.segments):
            seg = self.segments.get(name)
            if seg is not None:
                self._unmount(seg)
        self.hooks.client_dropped(client_id)

    def stats(self) -> PoolStats:
        segs = [SegmentUse(s.name, s.owner, s.medium, s.capacity, s.used, len(s.keys))
                for s in self.segments.values()]
        return PoolStats(segs, sum(o.committed for o in self.objects.values()), self.hits, self.misses,
                         self.evictions, self.demotions, self.promotions, self.epoch, len(self.clients))

    # -- helpers used by eviction.py -----------------------------------------------------------------
    def _dram_of(self, client_id: str) -> Segment | None:
        return self._tier_of(client_id, "dram")

    def _tier_of(self, client_id: str, medium: str) -> Segment | None:
        client = self.clients.get(client_id)
        for name in client.segments if client else ():
            seg = self.segments.get(name)
            if seg is not None and seg.medium == medium:
                return seg
        return None

    def _touch_lru(self, obj: ObjectMeta) -> None:
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None and obj.key in seg.keys:
                seg.keys.move_to_end(obj.key)

    def _drop_replica(self, obj: ObjectMeta, rep: Replica, send_delete: bool = True) -> None:
        """Remove one copy; a leased DRAM copy's bytes stay reserved until the lease ends."""
        obj.replicas.remove(rep)
        seg = self.segments.get(rep.segment)
        if seg is not None:
            seg.keys.pop(obj.key, None)
            now = self.clock()
            if seg.medium == "dram" and obj.lease_until > now:
                heapq.heappush(self._deferred, (obj.lease_until, next(self._seq), seg, rep.offset, rep.size))
            else:
                seg.alloc.free(rep.offset, rep.size)
            if seg.medium == "lmdb" and rep.complete and send_delete:
                self.send_delete(seg.owner, obj.key, seg.name, rep.size)
        if obj.committed and not any(r.complete for r in obj.replicas):
            self._forget(obj)
        else:
            self._announce(obj)  # e.g. a demoted object's DRAM copy went: LMDB only now

    def _forget(self, obj: ObjectMeta) -> None:
        """Remove an object and every copy of it."""
        if self.objects.get(obj.key) is not obj:
            return
        del self.objects[obj.key]
        self._pending.pop(obj.key, None)
        for rep in list(obj.replicas):
            self._drop_replica(obj, rep)
        if obj.committed:
            metrics.OBJECTS.dec()
        if obj.medium:
            obj.medium = ""
            self.hooks.pool_event("removed", (obj.key,), "")

    def _announce(self, obj: ObjectMeta) -> None:
        """Tell pool watchers where a committed object is readable, if that changed (after its copies did)."""
        if not obj.committed or self.objects.get(obj.key) is not obj:
            return
        medium = self.medium_of(obj)
        if medium and medium != obj.medium:
            obj.medium = medium
            self.hooks.pool_event("stored", (obj.key,), medium)

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

