"""The store master's state machine: segments, objects, leases, placement and tier moves.

Metadata only, no gRPC, no bytes, no clock of its own (it is handed one), so every rule
here is tested by calling methods. `service.py` puts it on the wire. Its parts, one job each:

- `catalog.py` holds the metadata (clients, segments, objects with their copies and LRU
  order, tier tasks) and is the only code that changes it, through a few public operations;
  the pool events and the DRAM journal that follow a change are sent from there.
- `placement.py` (where a new object's copies go), `eviction.py` (what leaves a full
  segment) and `tiering.py` (tier moves: demote DRAM -> LMDB, promote LMDB -> DRAM, persist
  a DRAM object to its owner's LMDB, delete from LMDB) are deciders: they read the catalog
  and yield what to do (`decisions.py`).
- This class checks each request, asks the deciders, applies their decisions to the catalog
  (`_apply`) and answers. Tier moves are `Task`s handed to the segment's owner through
  `hooks.send_task`; the owner reports back with `task_done`.

The tiers keep what they promise: a put lands while any tier has room (DRAM, or the writer's
own LMDB tier when no DRAM has room now); an object committed to DRAM is also copied to its
owner's LMDB tier in the background (`Policy.persist`), so it survives the process and leaves
DRAM at no cost; a read of LMDB-only objects gets what fits its owners' DRAM now and is told
which keys to ask again once it gives its lease back (`release`). Each DRAM segment's owner is
told what was committed to (or left) its DRAM (`hooks.journal`), so a restarted master gets
DRAM objects re-reported at the remount as it gets LMDB ones.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence

from mooncaked.store import eviction, metrics, placement, tiering
from mooncaked.store.allocator import ByteBudget, ExtentAllocator
from mooncaked.store.catalog import Catalog, MasterHooks, NoHooks
from mooncaked.store.decisions import (
    Complete, Decision, Decisions, DeleteValue, Drop, DropPlace, Evict, Place, TierMove,
)
from mooncaked.store.errors import FailedPrecondition, InvalidArgument, NoRoom, NotFound
from mooncaked.store.records import (
    DROPPED_PLACE_HOLD_S, FRESH_DRAM_HOLD_S, MAX_KEY_BYTES, MEDIA, ObjectMeta, ObjectRecord, ObjectView, Placed, Policy, PoolStats,
    PromotionPending, PutPlan, RESERVED_PREFIX, Segment, SegmentSpec, SegmentUse, Task,
)
from mooncaked.store.removed_keys import RemovedKeys


__all__ = ["MasterHooks", "NoHooks", "StoreMaster", "MAX_RESERVE"]

logger = logging.getLogger(__name__)

MAX_RESERVE = 1024  # places one ReservePlaces call may take


class StoreMaster:
    """The master's requests (what service.py and fast_path.py call): checked, decided, applied."""

    def __init__(self, policy: Policy = Policy(), hooks: MasterHooks | None = None,
                 clock: Callable[[], float] = time.monotonic, epoch: int | None = None) -> None:
        self.policy = policy
        self.hooks: MasterHooks = hooks or NoHooks()
        self.clock = clock
        self.epoch = epoch or random.SystemRandom().randrange(1, 1 << 63)
        self.catalog = Catalog(policy, self.hooks, clock)
        # the catalog's own dicts, read by the service, the metrics and the tests (only the catalog writes them)
        self.segments = self.catalog.segments
        self.objects = self.catalog.objects
        self.clients = self.catalog.clients
        self.tasks = self.catalog.tasks
        # ids (places, read leases) unlike any other master's: one that a master now gone (restarted,
        # or deposed under HA) handed out must be unknown here, never taken for one of ours
        self._reservation_ids = itertools.count(random.SystemRandom().randrange(1, 1 << 62))
        self._lease_ids = itertools.count(random.SystemRandom().randrange(1, 1 << 62))
        self.hits = self.misses = self.evictions = self.demotions = self.promotions = 0
        self.fresh_dram_from = 0.0  # clock(): no new DRAM place before (hold_dram_places)
        self.removed = RemovedKeys(clock=clock)  # a late remount or re-report must not bring these back

    def hold_dram_places(self, seconds: float = FRESH_DRAM_HOLD_S) -> None:
        """Place nothing new on DRAM for `seconds`: a leader that just took over does not know which
        places its predecessor reserved (records.PLACE_USE_S), and a late write into one must not
        land on a new object's bytes."""
        self.fresh_dram_from = self.clock() + seconds

    # -- segments and clients ----------------------------------------------------------------
    def mount(self, client_id: str, spec: SegmentSpec,
              records: Sequence[ObjectRecord] = ()) -> tuple[int, list[str]]:
        """Lend a segment (replacing an earlier mount of that name) with the objects it holds; returns
        (accepted, rejected keys). `records`: anything with an ObjectRecord's fields (the wire's
        messages are taken as they are)."""
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
        cat = self.catalog
        cat.touch(client_id, create=True)
        old = self.segments.get(spec.name)
        if old is not None:
            logger.info("segment %s remounted by %s; dropping what the earlier mount held", spec.name, client_id)
            self._unmount(old)
        alloc = ExtentAllocator(spec.capacity) if spec.medium == "dram" else ByteBudget(spec.capacity)
        seg = Segment(spec.name, client_id, spec.medium, spec.capacity, spec.endpoint, alloc)
        cat.add_segment(seg)
        accepted, rejected = 0, []
        fresh: list[str] = []  # objects new to the master: announced together
        persist = seg.medium == "dram" and self.policy.persist and cat.tier_of(client_id, "lmdb") is not None
        for rec in records:
            adopted = cat.adopt(seg, rec, fresh) if not self.removed.holds(rec.key, rec.checksum) else None
            if adopted is None:
                rejected.append(rec.key)
                continue
            accepted += 1
            if persist:  # it may have been on its way to LMDB when the master went
                self._run(tiering.persist(cat, adopted[0], adopted[1], seg))
        if fresh:
            self.hooks.pool_event("stored", fresh, seg.medium)
        logger.info("mounted %s segment %s of %s: %d bytes, %d objects re-reported (%d rejected)",
                    seg.medium, seg.name, client_id, seg.capacity, accepted, len(rejected))
        self._run(eviction.evict_if_needed(cat, seg))
        return accepted, rejected

    def unmount(self, client_id: str, name: str) -> int:
        seg = self._segment(name)
        if seg.owner != client_id:
            raise FailedPrecondition(f"segment {name!r} belongs to client {seg.owner!r}, not {client_id!r}")
        removed = self._unmount(seg)
        client = self.clients.get(client_id)
        if client is not None and not client.segments:  # it left: its silence later is not a death
            self.catalog.remove_client(client_id)
            self.hooks.client_dropped(client_id)
            logger.info("client %s left the pool (its last segment unmounted)", client_id)
        return removed

    def _unmount(self, seg: Segment) -> int:
        """Forget a segment and every copy on it; returns how many objects went with it."""
        for task in [t for t in self.tasks.values() if seg.name in (t.src_segment, t.dst_segment)]:
            self._settle(task, False, "segment unmounted")
        removed = self.catalog.remove_segment(seg)
        logger.info("unmounted segment %s of %s: %d objects dropped", seg.name, seg.owner, removed)
        return removed

    def evacuate(self, client_id: str, name: str) -> tuple[int, int]:
        """Move a DRAM segment's only copies to its owner's LMDB tier; returns (demotions ordered, left)."""
        seg = self._segment(name)
        if seg.owner != client_id:
            raise FailedPrecondition(f"segment {name!r} belongs to client {seg.owner!r}, not {client_id!r}")
        if seg.medium != "dram":
            raise InvalidArgument(f"segment {name!r} is {seg.medium}; only DRAM segments are evacuated")
        decider = eviction.evacuate(self.catalog, seg)
        try:
            while True:
                self._apply(next(decider))
        except StopIteration as end:
            return end.value

    def report_writes(self, client_id: str, name: str, records: Sequence[ObjectRecord]) -> tuple[int, list[str], bool]:
        """A writer's puts on another client's DRAM segment, committed just before this master took over
        (the owner's journal of them may not have gone out). Taken like a remount's objects: only into
        free space, never over a known object; every read still checks the checksum. Returns
        (accepted, rejected keys, whether the segment is mounted: if not, nothing was taken)."""
        seg = self.segments.get(name)
        if seg is None:
            return 0, [], False
        if seg.medium != "dram":
            raise InvalidArgument(f"segment {name!r} is {seg.medium}; writes are re-reported on DRAM segments only")
        if seg.owner == client_id:
            raise InvalidArgument(f"segment {name!r} is the caller's own: its remount re-reports it")
        cat = self.catalog
        self.catalog.touch(client_id, create=False)
        accepted, rejected, fresh = 0, [], []
        persist = self.policy.persist and cat.tier_of(seg.owner, "lmdb") is not None
        for rec in records:
            adopted = (cat.adopt(seg, rec, fresh)
                       if rec.key not in self.objects and not self.removed.holds(rec.key, rec.checksum) else None)
            if adopted is None:
                rejected.append(rec.key)
                continue
            accepted += 1
            cat.landed(adopted[0], adopted[1], seg)  # its owner journals it now
            if persist:
                self._run(tiering.persist(cat, adopted[0], adopted[1], seg))
        if fresh:
            self.hooks.pool_event("stored", fresh, seg.medium)
        if accepted or rejected:
            logger.info("%s re-reported %d writes on %s (%d taken, %d refused)", client_id, len(records), name,
                        accepted, len(rejected))
        return accepted, rejected, True

    def ping(self, client_id: str) -> bool:
        """A client's heartbeat; False means the master does not know it (remount)."""
        return self.catalog.touch(client_id, create=False) is not None

    def _segment(self, name: str) -> Segment:
        seg = self.segments.get(name)
        if seg is None:
            raise NotFound(f"segment {name!r} is not mounted (its client stopped pinging, or never mounted it); "
                           "the client remounts after its next ping")
        return seg

    # -- put -------------------------------------------------------------------------------------
    def put_start_many(self, items: Sequence[tuple[str, int, int, int, str, bool]],
                       writer: str = "") -> list[PutPlan | None]:
        """PutStart for a batch; None where no room was found. Room for all of those, and for those
        that went to the writer's LMDB tier, is then made at once (demotions), so later puts find DRAM."""
        plans: list[PutPlan | None] = []
        short = 0
        for key, size, csum, replicas, preferred, soft_pin in items:
            try:
                plan = self.put_start(key, size, csum, replicas, preferred, soft_pin, make_room=False, writer=writer)
            except NoRoom:
                plan = None
            plans.append(plan)
            if plan is None or plan.replicas and plan.replicas[0].segment.medium != "dram":
                short += size
        if short:
            self._run(placement.make_room_for(self.catalog, short))
        return plans

    def put_start(self, key: str, size: int, checksum: int, replicas: int = 0, preferred: str = "",
                  soft_pin: bool = False, make_room: bool = True, writer: str = "") -> PutPlan:
        """Reserve places for one object; readers see nothing until `put_end`. When no DRAM segment
        has room now and `writer` lends an LMDB tier, the place is there: the writer stores it itself."""
        self._check_key(key)
        return self._start(key, size, checksum, replicas, preferred, soft_pin, make_room, writer=writer)

    def _start(self, key: str, size: int, checksum: int, replicas: int, preferred: str, soft_pin: bool,
               make_room: bool, ahead: bool = False, writer: str = "") -> PutPlan:
        """`ahead`: a place reserved before any object needs it takes free space only (evicts nothing)."""
        if size <= 0:
            raise InvalidArgument(f"object {key!r}: size must be positive, got {size}")
        drams = self.catalog.free_order
        limit = min(self.policy.max_object_bytes, drams.biggest) if drams.segments else self.policy.max_object_bytes
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
                self.catalog.touch_lru(obj)
                return PutPlan([], exists=True)
            self._discard_stale(obj)
        if not drams.segments:
            raise NoRoom("no DRAM segment is mounted: start an engine with --store-dram-bytes")
        cat = self.catalog
        placed: list[Placed] = []
        if self.clock() >= self.fresh_dram_from:
            placed = self._places(placement.place(cat, size, min(replicas or self.policy.replicas, len(drams.segments)),
                                                  pref, make_room and not ahead, evict=not ahead))
        if not placed and writer and not ahead:
            own = cat.tier_of(writer, "dram")  # a read promotes it there: it must fit
            if own is not None and size <= own.capacity:
                placed = self._places(placement.place_on_lmdb(cat, cat.tier_of(writer, "lmdb"), size))
        if not placed:
            raise NoRoom(f"no DRAM segment has {size} free bytes for {key!r} (copies are being moved to LMDB "
                         "or held by read leases); retry shortly or lend more DRAM")
        cat.new_object(key, size, checksum, placed, soft_pin)
        if not ahead:
            for p in placed:
                self._run(eviction.evict_if_needed(cat, p.segment))
        return PutPlan(placed, exists=False)

    def _places(self, decisions: Decisions[None]) -> list[Placed]:
        """Apply a placement's decisions; the places it took."""
        placed: list[Placed] = []
        for d in decisions:
            if isinstance(d, Place):
                placed.append(self.catalog.take_space(d.segment, d.size))
            else:
                self._apply(d)
        return placed

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
        cat = self.catalog
        if not obj.replicas:
            cat.forget(obj)
            raise FailedPrecondition(f"every place reserved for {obj.key!r} was lost (its segment's client died); "
                                     "put it again")
        cat.commit(obj, checksum)
        self.removed.committed(obj.key, obj.checksum)  # this object's record may come in a later report
        for r in list(obj.replicas):  # (a persist adds an LMDB copy)
            seg = self.segments.get(r.segment)
            if seg is not None and seg.medium == "dram":
                cat.landed(obj, r, seg)
                if self.policy.persist:
                    self._run(tiering.persist(cat, obj, r, seg))

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
                self.catalog.forget(place)
                self.catalog.touch_lru(existing)
                return True
            self._discard_stale(existing)
        self.catalog.rename(place, key, soft_pin)
        self._commit(place, checksum)
        return True

    def revoke_reserved(self, reservation: int) -> bool:
        place = self.objects.get(f"{RESERVED_PREFIX}{reservation}")
        if place is None or place.committed:
            return False
        self.catalog.forget(place)
        return True

    def put_revoke(self, key: str) -> None:
        obj = self.objects.get(key)
        if obj is None or obj.committed:
            raise FailedPrecondition(f"PutRevoke({key!r}) without a PutStart in progress")
        self.catalog.forget(obj)

    def _discard_stale(self, obj: ObjectMeta) -> None:
        if obj.key.startswith(RESERVED_PREFIX):  # a writer that went idle: its places simply lapse
            logger.debug("reserved place %s lapsed unused after %.1fs", obj.key[len(RESERVED_PREFIX):],
                         self.policy.put_timeout_s)
        else:
            logger.warning("discarding put of %s: no PutEnd within %.1fs", obj.key, self.policy.put_timeout_s)
            metrics.STALE_PUTS.inc()
        self.catalog.forget(obj)

    # -- get and queries ---------------------------------------------------------------------------
    def new_lease(self) -> int:
        """An id for the read leases of one lookup, so that its reader can give them back (`release`)."""
        return next(self._lease_ids)

    def get_replicas(self, key: str, count: bool = True, lease: int = 0) -> ObjectView | PromotionPending:
        """Complete DRAM copies under a read lease (`lease`: its id, 0 for one that only lapses); an
        LMDB-only object is promoted first. `count=False` renews a lease without counting a second lookup."""
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
            if not obj.promotion:  # else: join the one in flight
                if now < self.fresh_dram_from:
                    raise NoRoom(f"{obj.key!r} is on LMDB only, and this master, which just took over, places "
                                 f"nothing on DRAM for {self.fresh_dram_from - now:.1f}s more; retry shortly")
                self._run(tiering.promote(self.catalog, obj))
            return PromotionPending(obj.promotion)
        self.catalog.lend(obj, lease, now, count)
        if count:
            self.hits += 1
            metrics.lookup("hit").inc()
        return ObjectView(obj.key, obj.size, obj.checksum, placed, self.policy.lease_s)

    def touched(self, keys: Iterable[str]) -> int:
        """Objects an owner served by key (owner_server.py, reported with its ping): each one read more,
        and the newest in its LRU order, as a lookup would have made it. Returns how many were known."""
        known = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None and obj.committed:
                obj.hits += 1
                self.catalog.touch_lru(obj)
                known += 1
        return known

    def grant_lease(self, obj: ObjectMeta, lease: int = 0, now: float | None = None) -> None:
        """Hold the object's copies for a reader for `lease_s` (or until it releases lease id `lease`)."""
        self.catalog.grant_lease(obj, lease, now)

    def release(self, lease: int, keys: Iterable[str]) -> int:
        """A reader is done with these objects of lease `lease`: their copies are free to leave (a
        promoted copy, which LMDB still holds, goes first when its DRAM needs room). Returns how many
        leases ended."""
        return self.catalog.release(lease, keys) if lease else 0

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
        """Drop objects (a leased copy's bytes stay reserved until its lease ends). Every key named is
        noted, known or not: a remount or re-report arriving later must not bring it back."""
        keys = list(keys)
        self.removed.note(keys)
        removed = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None:
                removed += obj.committed
                self.catalog.forget(obj)
        return removed

    def medium_of(self, obj: ObjectMeta) -> str:
        """Where a reader finds the object at best: "dram", "lmdb", or "" (no complete copy)."""
        return self.catalog.medium_of(obj)

    def _check_key(self, key: str) -> None:
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidArgument(f"a key must be 1..{MAX_KEY_BYTES} bytes (e.g. 'model_id/block_hash'), "
                                  f"got {key[:80]!r}")
        if key.startswith(RESERVED_PREFIX):
            raise InvalidArgument(f"keys starting with {RESERVED_PREFIX!r} name reserved places, not objects")

    # -- tier tasks ---------------------------------------------------------------------------------
    def send_delete(self, client_id: str, key: str, segment: str, size: int) -> None:
        self.catalog.send_delete(client_id, key, segment, size)

    def task_done(self, client_id: str, results: Iterable[tuple[int, bool, str]]) -> int:
        """The owner's report on tasks; returns how many matched a task still open."""
        self.catalog.touch(client_id, create=False)
        accepted = 0
        for task_id, ok, error in results:
            task = self.tasks.get(task_id)
            if task is None or task.client_id != client_id:
                continue
            accepted += 1
            self._settle(task, ok, error)
        return accepted

    def _settle(self, task: Task, ok: bool, error: str) -> None:
        """A task ended (reported, timed out, or its segment went): count it and apply its outcome."""
        obj = self.catalog.close_task(task)
        done = ok and obj is not None and obj.replica_on(task.dst_segment) is not None
        if task.kind == "promote":
            self.promotions += done
            metrics.PROMOTIONS.labels("ok" if done else "failed").inc()
        elif task.kind == "demote" and done:
            self.demotions += 1
            metrics.EVICTIONS.labels("dram", "demote").inc()
        self._run(tiering.settle(self.catalog, task, obj, ok, error))
        if task.kind == "promote":
            self.hooks.promotion_settled(task.task_id, done)

    # -- housekeeping ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Expire silent clients, stale puts and overdue tasks; free what leases held; evict."""
        now = self.clock()
        for client in [c for c in self.clients.values() if now - c.last_seen > self.policy.client_ttl_s]:
            self.drop_client(client.client_id, f"silent for {now - client.last_seen:.1f}s")
        for key in list(self.catalog.pending):
            obj = self.objects[key]
            if now - obj.started_at < self.policy.put_timeout_s:
                break
            self._discard_stale(obj)
        for task in [t for t in self.tasks.values() if t.deadline < now]:
            self._settle(task, False, f"timed out after {self.policy.task_timeout_s:g}s")
        self.catalog.free_lapsed(now)
        for seg in list(self.segments.values()):
            self._run(eviction.evict_if_needed(self.catalog, seg))

    def drop_client(self, client_id: str, why: str) -> None:
        client = self.catalog.remove_client(client_id)
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
        segs = [SegmentUse(s.name, s.owner, s.medium, s.capacity, s.used, s.held)
                for s in self.segments.values()]
        return PoolStats(segs, self.catalog.committed, self.hits, self.misses,
                         self.evictions, self.demotions, self.promotions, self.epoch, len(self.clients))

    # -- applying decisions ------------------------------------------------------------------------
    def _run(self, decisions: Iterable[Decision]) -> None:
        """Apply a decider's decisions one by one (each before it decides the next)."""
        for d in decisions:
            self._apply(d)

    def _apply(self, d: Decision) -> None:
        """Carry out one decision through the catalog's operations (and count what it counts)."""
        cat = self.catalog
        if isinstance(d, TierMove):
            cat.open_task(d.kind, d.obj, d.replica, d.source, cat.add_copy(d.obj, d.to))
        elif isinstance(d, Evict):
            if d.to is not None and d.how == "demote":
                cat.open_task("demote", d.obj, d.replica, d.segment, cat.add_copy(d.obj, d.to))
            else:
                cat.drop_copy(d.obj, d.replica)
                self.evictions += 1
                metrics.EVICTIONS.labels(d.segment.medium, "drop").inc()
        elif isinstance(d, DropPlace):
            # its writer may be writing into it for PLACE_USE_S after the master answered: the bytes are
            # handed out again only once no such write can land (a new object's bytes would be overwritten)
            cat.forget(d.obj, hold_until=self.clock() + DROPPED_PLACE_HOLD_S)
        elif isinstance(d, Complete):
            cat.complete(d.obj, d.replica)
            if d.lease:
                cat.grant_lease(d.obj, d.lease)
        elif isinstance(d, Drop):
            cat.drop_copy(d.obj, d.replica, d.send_delete)
        elif isinstance(d, DeleteValue):
            cat.send_delete(d.segment.owner, d.key, d.segment.name, d.size)
        else:
            raise AssertionError(f"{d!r} is not applied here (a Place is taken by `_places`)")
