"""The store master's rules, called directly with a hand-turned clock: allocator, placement,
leases, eviction and demotion, stale puts, dead clients, remount, bad input."""

from __future__ import annotations

import logging
import random

import pytest

from mooncaked.store.allocator import ByteBudget, ExtentAllocator
from mooncaked.store.errors import FailedPrecondition, InvalidArgument, NoRoom, NotFound
from mooncaked.store.master import StoreMaster
from mooncaked.store.records import DROPPED_PLACE_HOLD_S, Endpoint, ObjectRecord, ObjectView, Policy, PromotionPending, SegmentSpec, Task

KiB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Hooks:
    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.settled: list[tuple[int, bool]] = []
        self.dropped: list[str] = []
        self.events: list[tuple[str, str, str]] = []  # (kind, key, medium) in order
        self.journals: list[tuple[str, str, int, int]] = []  # (owner, key, offset, size; 0: left) in order

    def send_task(self, task: Task) -> None:
        self.tasks.append(task)

    def promotion_settled(self, task_id: int, ok: bool) -> None:
        self.settled.append((task_id, ok))

    def client_dropped(self, client_id: str) -> None:
        self.dropped.append(client_id)

    def pool_event(self, kind: str, keys, medium: str) -> None:
        self.events.extend((kind, k, medium) for k in keys)

    def journal(self, client_id: str, key: str, offset: int, size: int, checksum: int) -> None:
        self.journals.append((client_id, key, offset, size))


def dram(name: str, capacity: int) -> SegmentSpec:
    return SegmentSpec(name, "dram", capacity, Endpoint(f"127.0.0.1:{abs(hash(name)) % 60000}", "tcp", "r"))


def make(**policy) -> tuple[StoreMaster, Clock, Hooks]:
    clock, hooks = Clock(), Hooks()
    return StoreMaster(Policy(**policy), hooks, clock), clock, hooks


def put(m: StoreMaster, key: str, size: int = 4 * KiB, **kw) -> list[str]:
    plan = m.put_start(key, size, 7, **kw)
    m.put_end(key)
    return [p.replica.segment for p in plan.replicas]


# -- allocator --------------------------------------------------------------------------------
def test_extent_allocator_reuses_and_merges_free_extents():
    a = ExtentAllocator(1024, align=64)
    offs = [a.alloc(100) for _ in range(8)]  # 128 bytes each
    assert offs == [i * 128 for i in range(8)] and a.alloc(1) is None
    for o in offs[1:7]:
        a.free(o)
    assert a.largest_free() == 6 * 128  # neighbours merged
    assert a.alloc(6 * 128) == 128
    for o in (offs[0], 128, offs[7]):
        a.free(o)
    assert a.used == 0 and a.largest_free() == 1024


def test_extent_allocator_random_ops_keep_invariants():
    rng = random.Random(3)
    a = ExtentAllocator(1 << 20, align=64)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 20000)
            off = a.alloc(size)
            if off is not None:
                assert off % 64 == 0 and off + size <= a.capacity
                assert all(off + size <= o or o + s <= off for o, s in live.items()), "overlap"
                live[off] = size
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.used == 0 and a.largest_free() == 1 << 20
    with pytest.raises(AssertionError):
        a.free(0)


def test_extent_allocator_take_exact_range():
    a = ExtentAllocator(4096, align=64)
    assert a.take(1024, 100) and not a.take(1024, 64) and not a.take(1000, 10)
    assert a.alloc(1024) == 0 and a.alloc(2048) == 1024 + 128
    b = ByteBudget(100)
    assert b.alloc(60) == 0 and b.alloc(50) is None
    b.free(0, 60)
    assert b.used == 0


# -- placement --------------------------------------------------------------------------------
def test_replicas_never_share_a_segment_and_prefer_free_space():
    m, _, _ = make(replicas=3)
    for name, cap in (("a", 64 * KiB), ("b", 256 * KiB), ("c", 128 * KiB)):
        m.mount(name.upper(), dram(name, cap))
    first = put(m, "k0")
    assert first == ["b", "c", "a"]  # most free first
    for i in range(1, 40):
        segs = put(m, f"k{i}", 2 * KiB)
        assert len(segs) == len(set(segs)) == 3
    m2, _, _ = make(replicas=2)
    m2.mount("A", dram("only", 64 * KiB))
    assert put(m2, "x") == ["only"]  # fewer segments than replicas: one copy, never two on one


def test_preferred_segment_goes_first_and_must_be_mounted():
    m, _, _ = make()
    m.mount("A", dram("a", 64 * KiB))
    m.mount("B", dram("b", 256 * KiB))
    assert put(m, "k", preferred="a") == ["a"]
    with pytest.raises(FailedPrecondition, match="not a mounted DRAM segment"):
        m.put_start("k2", 10, 0, preferred="gone")


def test_bad_input_gets_typed_errors():
    m, _, _ = make(max_object_bytes=1 << 20)
    with pytest.raises(NoRoom, match="no DRAM segment is mounted"):
        m.put_start("k", 10, 0)
    m.mount("A", dram("a", 64 * KiB))
    with pytest.raises(InvalidArgument, match="must be positive"):
        m.put_start("k", -5, 0)
    with pytest.raises(InvalidArgument, match="larger than"):
        m.put_start("k", 65 * KiB, 0)
    with pytest.raises(InvalidArgument, match="key"):
        m.put_start("", 10, 0)
    with pytest.raises(FailedPrecondition, match="without a PutStart"):
        m.put_end("never")
    with pytest.raises(FailedPrecondition, match="without a PutStart"):
        m.put_revoke("never")
    with pytest.raises(NotFound):
        m.get_replicas("never")
    with pytest.raises(NotFound, match="not mounted"):
        m.unmount("A", "nope")
    with pytest.raises(FailedPrecondition, match="belongs to"):
        m.unmount("B", "a")
    with pytest.raises(InvalidArgument):
        m.mount("A", SegmentSpec("z", "tape", 10))


def test_readers_never_see_a_half_written_object():
    m, _, _ = make()
    m.mount("A", dram("a", 64 * KiB))
    plan = m.put_start("k", 100, 7)
    assert not plan.exists and not m.exist("k")
    with pytest.raises(NotFound):
        m.get_replicas("k")
    assert m.put_start("k", 100, 7).exists  # a second writer skips
    m.put_end("k")
    view = m.get_replicas("k")
    assert isinstance(view, ObjectView) and view.checksum == 7 and m.exist("k")
    m.put_start("r", 100, 7)
    m.put_revoke("r")
    assert not m.exist("r") and m.segments["a"].used == 128


def test_longest_prefix_and_remove():
    m, _, _ = make()
    m.mount("A", dram("a", 64 * KiB))
    for k in ("m/1", "m/2", "m/3", "m/5"):
        put(m, k, 100)
    assert m.longest_prefix(["m/1", "m/2", "m/3", "m/4", "m/5"]) == 3
    assert m.longest_prefix(["m/9", "m/1"]) == 0
    assert m.remove(["m/2", "nope"]) == 1
    assert m.longest_prefix(["m/1", "m/2", "m/3"]) == 1


# -- leases and eviction ------------------------------------------------------------------------
def test_leased_object_is_not_evicted_until_the_lease_lapses():
    m, clock, _ = make(lease_s=5.0, high_watermark=0.5, evict_fraction=0.25)
    m.mount("A", dram("a", 64 * KiB))
    put(m, "old", 8 * KiB)
    assert isinstance(m.get_replicas("old"), ObjectView)  # lease until t+5
    for i in range(6):
        put(m, f"k{i}", 8 * KiB)
        clock.t += 0.1
    assert m.exist("old"), "a leased object was evicted"
    assert not m.exist("k0"), "LRU victim should have gone instead"
    clock.t += 5.0
    m.ping("A")
    m.tick()
    for i in range(6, 9):
        put(m, f"k{i}", 8 * KiB)
    assert not m.exist("old"), "once the lease lapsed the LRU object is evictable"


def test_soft_pinned_and_hot_objects_are_evicted_last():
    m, clock, _ = make(lease_s=0.01, high_watermark=0.5, evict_fraction=0.125, hot_hits=2)
    m.mount("A", dram("a", 64 * KiB))
    put(m, "pinned", 8 * KiB, soft_pin=True)
    put(m, "hot", 8 * KiB)
    m.get_replicas("hot"), m.get_replicas("hot")
    clock.t += 1
    for i in range(4):
        put(m, f"k{i}", 8 * KiB)
    assert m.exist("pinned") and m.exist("hot")
    assert not m.exist("k0")


def test_remove_of_a_leased_object_keeps_its_bytes_until_the_lease_ends():
    m, clock, _ = make(lease_s=2.0)
    m.mount("A", dram("a", 16 * KiB))
    put(m, "k", 16 * KiB)
    m.get_replicas("k")
    assert m.remove(["k"]) == 1 and not m.exist("k")
    with pytest.raises(NoRoom):
        m.put_start("k2", 16 * KiB, 0)  # a reader may still be copying those bytes
    clock.t += 2.5
    m.ping("A")
    m.tick()
    put(m, "k2", 16 * KiB)


def test_demotion_to_lmdb_and_promotion_back():
    m, clock, hooks = make(lease_s=1.0, high_watermark=0.5, evict_fraction=0.25, persist=False)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    for i in range(5):
        put(m, f"k{i}", 8 * KiB)
    demotes = [t for t in hooks.tasks if t.kind == "demote"]
    assert [t.key for t in demotes] == ["k0", "k1", "k2"] and all(t.dst_segment == "a-lmdb" for t in demotes)
    assert m.segments["a"].used == 40 * KiB  # DRAM bytes stay until the owner reports
    m.task_done("A", [(t.task_id, True, "") for t in demotes])
    assert m.segments["a"].used == 16 * KiB and m.segments["a-lmdb"].used == 24 * KiB
    assert m.exist("k0") and m.demotions == 3
    pending = m.get_replicas("k0")
    assert isinstance(pending, PromotionPending)
    assert m.get_replicas("k0") == pending  # one promotion per key
    promote = hooks.tasks[-1]
    assert promote.kind == "promote" and promote.src_segment == "a-lmdb" and promote.dst_segment == "a"
    m.task_done("A", [(promote.task_id, True, "")])
    assert hooks.settled == [(promote.task_id, True)]
    view = m.get_replicas("k0")
    assert isinstance(view, ObjectView) and [p.segment.name for p in view.replicas] == ["a"]
    # a failed promotion for a corrupt value drops the object
    pending = m.get_replicas("k1")
    m.task_done("A", [(pending.task_id, False, "checksum mismatch")])
    assert not m.exist("k1") and hooks.settled[-1] == (pending.task_id, False)


def test_overdue_task_fails_and_frees_its_places():
    m, clock, hooks = make(high_watermark=0.5, evict_fraction=0.25, task_timeout_s=3.0, persist=False)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    for i in range(5):
        put(m, f"k{i}", 8 * KiB)
    assert m.tasks
    clock.t += 4
    m.ping("A")
    m.tick()
    assert not m.tasks and m.segments["a-lmdb"].used == 0


# -- put timeout, dead clients, remount -----------------------------------------------------------
def test_stale_put_start_is_discarded():
    m, clock, _ = make(put_timeout_s=2.0)
    m.mount("A", dram("a", 16 * KiB))
    m.put_start("k", 16 * KiB, 0)
    clock.t += 1
    m.ping("A")
    m.tick()
    assert m.put_start("k", 16 * KiB, 0).exists
    clock.t += 1.5
    m.ping("A")
    m.tick()
    assert m.segments["a"].used == 0
    with pytest.raises(FailedPrecondition, match="discarded"):
        m.put_end("k")
    assert not m.put_start("k", 16 * KiB, 0).exists


def test_dead_client_loses_its_segments_and_replicas():
    m, clock, hooks = make(client_ttl_s=3.0, replicas=2)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("B", dram("b", 64 * KiB))
    put(m, "both")
    put(m, "onlyb", preferred="b", replicas=1)
    clock.t += 2
    m.ping("A")
    clock.t += 2
    m.tick()
    assert hooks.dropped == ["B"] and "b" not in m.segments and not m.ping("B")
    assert m.exist("both") and not m.exist("onlyb")
    assert [p.segment.name for p in m.get_replicas("both").replicas] == ["a"]


def test_remount_rebuilds_lmdb_objects_and_rejects_conflicts():
    m, _, _ = make()
    m.mount("A", dram("a", 64 * KiB))
    put(m, "dup", 100)
    recs = [ObjectRecord("x", 0, 500, 11), ObjectRecord("dup", 0, 100, 7), ObjectRecord("bad", 0, 100, 9),
            ObjectRecord("dup2", 0, 100, 1)]
    put(m, "bad", 100)  # checksum 7 != 9: conflicting copy
    accepted, rejected = m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20), recs)
    assert accepted == 3 and rejected == ["bad"]
    assert m.exist("x") and m.segments["a-lmdb"].used == 700
    assert m.objects["dup"].replica_on("a-lmdb") is not None


def test_evacuate_demotes_only_copies_and_ignores_leases():
    m, _, hooks = make(replicas=1, persist=False)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    m.mount("B", dram("b", 64 * KiB))
    for i in range(4):
        put(m, f"k{i}", 4 * KiB, preferred="a")
    put(m, "elsewhere", 4 * KiB, preferred="b")
    m.get_replicas("k0")  # leased: still evacuated (its DRAM copy stays readable until the move is done)
    assert m.evacuate("A", "a") == (4, 0)
    assert sorted(t.key for t in hooks.tasks if t.kind == "demote") == ["k0", "k1", "k2", "k3"]
    m.task_done("A", [(t.task_id, True, "") for t in hooks.tasks])
    assert m.unmount("A", "a") == 0, "every object kept its LMDB copy"
    assert all(m.exist(f"k{i}") for i in range(4))
    with pytest.raises(FailedPrecondition):
        m.evacuate("B", "a-lmdb")
    with pytest.raises(InvalidArgument):
        m.evacuate("A", "a-lmdb")


# -- pool events (what WatchPool subscribers, e.g. the conductor's prefix index, hear) ------------------
def test_pool_events_for_commit_and_remove_only():
    m, clock, hooks = make(put_timeout_s=2.0)
    m.mount("A", dram("a", 64 * KiB))
    m.put_start("k", 100, 7)
    assert hooks.events == [], "an uncommitted object is not readable: no event"
    m.put_end("k")
    m.put_end("k")  # a repeated commit says nothing new
    assert hooks.events == [("stored", "k", "dram")]
    m.put_start("r", 100, 7)
    m.put_revoke("r")
    m.put_start("stale", 100, 7)
    clock.t += 3
    m.ping("A")
    m.tick()
    assert m.put_start("k", 100, 7).exists and hooks.events == [("stored", "k", "dram")], \
        "revoked, stale and duplicate puts are never announced"
    assert m.remove(["k", "nope"]) == 1 and m.remove(["k"]) == 0
    assert hooks.events[1:] == [("removed", "k", "")]


def test_pool_events_for_eviction_without_lmdb():
    m, _, hooks = make(high_watermark=0.5, evict_fraction=0.25)
    m.mount("A", dram("a", 64 * KiB))
    for i in range(6):
        put(m, f"k{i}", 8 * KiB)
    gone = [k for kind, k, _ in hooks.events if kind == "removed"]
    assert gone and all(not m.exist(k) for k in gone)
    assert {k for kind, k, _ in hooks.events if kind == "stored"} == {f"k{i}" for i in range(6)}
    assert {f"k{i}" for i in range(6) if m.exist(f"k{i}")} == {f"k{i}" for i in range(6)} - set(gone)


def test_pool_events_for_demotion_promotion_and_a_corrupt_lmdb_value():
    m, _, hooks = make(lease_s=1.0, high_watermark=0.5, evict_fraction=0.25, persist=False)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    for i in range(5):
        put(m, f"k{i}", 8 * KiB)
    assert hooks.events == [("stored", f"k{i}", "dram") for i in range(5)], "ordering a demotion changes nothing yet"
    del hooks.events[:]
    demotes = [t for t in hooks.tasks if t.kind == "demote"]
    m.task_done("A", [(t.task_id, True, "") for t in demotes])
    assert hooks.events == [("stored", k, "lmdb") for k in ("k0", "k1", "k2")], "LMDB only now"
    del hooks.events[:]
    pending = m.get_replicas("k0")
    assert hooks.events == [], "a promotion in flight is not yet a DRAM copy"
    m.task_done("A", [(pending.task_id, True, "")])
    assert hooks.events == [("stored", "k0", "dram")]
    pending = m.get_replicas("k1")
    m.task_done("A", [(pending.task_id, False, "checksum mismatch")])
    assert hooks.events[1:] == [("removed", "k1", "")]


def test_pool_events_for_a_demotion_under_a_lease():
    m, _, hooks = make(lease_s=1.0, high_watermark=0.5, evict_fraction=0.25, persist=False)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    put(m, "k", 8 * KiB)
    m.evacuate("A", "a")
    m.get_replicas("k")  # leased: its DRAM copy outlives the demotion
    m.task_done("A", [(t.task_id, True, "") for t in hooks.tasks if t.kind == "demote"])
    assert hooks.events == [("stored", "k", "dram")], "still readable from DRAM"
    m.unmount("A", "a")
    assert hooks.events[1:] == [("stored", "k", "lmdb")], "its DRAM copy went with the segment"


def test_pool_events_for_unmount_dead_client_and_remount():
    m, clock, hooks = make(client_ttl_s=3.0, replicas=2)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("B", dram("b", 64 * KiB))
    put(m, "both")
    put(m, "onlyb", preferred="b", replicas=1)
    put(m, "onlya", preferred="a", replicas=1)
    del hooks.events[:]
    clock.t += 2
    m.ping("A")
    clock.t += 2
    m.tick()  # B is silent: dead
    assert hooks.events == [("removed", "onlyb", "")], "a copy that survives elsewhere is still readable"
    assert m.unmount("A", "a") == 2
    assert sorted(hooks.events[1:]) == [("removed", "both", ""), ("removed", "onlya", "")]
    del hooks.events[:]
    recs = [ObjectRecord("x", 0, 500, 11), ObjectRecord("y", 0, 500, 12)]
    assert m.stats().objects == 0
    assert m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20), recs) == (2, [])
    assert hooks.events == [("stored", "x", "lmdb"), ("stored", "y", "lmdb")]
    assert m.stats().objects == 2  # re-reported objects count as the committed ones do
    del hooks.events[:]
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20), recs[:1])  # remounted with y gone from the disk
    assert hooks.events == [("removed", "x", ""), ("removed", "y", ""), ("stored", "x", "lmdb")]
    assert m.exist("x") and not m.exist("y") and m.stats().objects == 1


def test_a_client_that_unmounts_its_last_segment_has_left_and_is_not_reported_dead(caplog):
    """A stopping engine unmounts its segments, then goes silent: its silence must not read as a death
    (a WARNING in a quiet stop) once it has left."""
    m, clock, hooks = make(client_ttl_s=3.0)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("A", SegmentSpec("a-lmdb", "lmdb", 1 << 20))
    m.mount("B", dram("b", 64 * KiB))
    m.unmount("A", "a")
    assert "A" in m.clients, "one segment left: still a member"
    m.unmount("A", "a-lmdb")
    assert "A" not in m.clients and hooks.dropped == ["A"]
    clock.t += 4
    with caplog.at_level(logging.INFO, logger="mooncaked.store.master"):
        m.tick()
    dead = [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]
    assert dead == ["client B is dead (silent for 4.0s): unmounting its segments ['b']"]
    assert not m.ping("A"), "a client that left and pings again is told to remount"
    m.mount("A", dram("a", 64 * KiB))
    assert m.ping("A")


def test_pool_events_replayed_always_equal_what_the_master_holds():
    """Random puts, reads, removes, tier moves (some failing), timeouts, deaths and remounts: the
    key -> medium map rebuilt from the events alone matches the master after every step."""
    rng = random.Random(11)
    m, clock, hooks = make(lease_s=0.5, high_watermark=0.6, evict_fraction=0.2, client_ttl_s=3.0,
                           task_timeout_s=1.0, put_timeout_s=1.0, replicas=2)
    seen: dict[str, str] = {}
    applied = 0

    def check() -> None:
        nonlocal applied
        for kind, key, medium in hooks.events[applied:]:
            if kind == "stored":
                seen[key] = medium
            else:
                assert seen.pop(key, None) is not None, f"removed {key} that was never stored"
        applied = len(hooks.events)
        truth = {k: m.medium_of(o) for k, o in m.objects.items() if o.committed}
        assert seen == truth
        assert m.stats().objects == len(truth)  # a count kept, not a walk
        drams = [s for s in m.segments.values() if s.medium == "dram"]  # placement's ranking: a stable sort
        ranked = sorted(drams, key=lambda s: s.alloc.free_bytes, reverse=True)
        assert [s.name for s in m.catalog.free_order.ranked()] == [s.name for s in ranked]

    def mount(client: str) -> None:
        m.mount(client, dram(f"{client}-dram", 64 * KiB))
        m.mount(client, SegmentSpec(f"{client}-lmdb", "lmdb", 256 * KiB))

    for c in "ABC":
        mount(c)
    for _ in range(3000):
        op = rng.random()
        key = f"k{rng.randrange(60)}"
        try:
            if op < 0.35:
                plan = m.put_start(key, rng.choice((2, 4, 8)) * KiB, 7)
                if not plan.exists and rng.random() < 0.9:
                    m.put_end(key)
            elif op < 0.55:
                m.get_replicas(key)
            elif op < 0.62:
                m.remove([key])
            elif op < 0.85:
                open_tasks = list(m.tasks.values())
                for t in rng.sample(open_tasks, min(len(open_tasks), 3)):
                    error = rng.choice(("", "", "", "checksum mismatch", "disk full"))
                    m.task_done(t.client_id, [(t.task_id, not error, error)])
            elif op < 0.97:
                clock.t += rng.uniform(0.05, 0.6)
                for c in "ABC":
                    if c in m.clients and rng.random() < 0.97:
                        m.ping(c)
                m.tick()
            else:
                c = rng.choice("ABC")
                if c not in m.clients:
                    mount(c)
                elif rng.random() < 0.5:
                    m.unmount(c, f"{c}-dram")
                    m.mount(c, dram(f"{c}-dram", 64 * KiB))
                else:
                    m.drop_client(c, "test")
        except (NoRoom, NotFound, FailedPrecondition):
            pass
        check()
    assert any(k == "stored" and md == "lmdb" for k, _, md in hooks.events), "no demotion happened"
    assert any(k == "removed" for k, _, _ in hooks.events)


# -- places reserved ahead ------------------------------------------------------------------------
def test_reserved_places_commit_under_their_key_and_lapse_unused():
    m, clock, hooks = make(put_timeout_s=2.0, replicas=2)
    m.mount("A", dram("a", 64 * KiB))
    m.mount("B", dram("b", 64 * KiB))
    places = m.reserve(8 * KiB, 3, first_evicts=True)
    assert len(places) == 3
    for _, plan in places:  # each place has its two copies on distinct segments
        assert sorted(p.segment.name for p in plan.replicas) == ["a", "b"]
    assert m.segments["a"].used == 24 * KiB and not m.exist("k")
    (r1, plan1), (r2, _), (r3, _) = places
    assert m.put_reserved(r1, "k", checksum=99)
    view = m.get_replicas("k")
    assert isinstance(view, ObjectView) and view.checksum == 99
    assert sorted((p.segment.name, p.replica.offset) for p in view.replicas) == \
        sorted((p.segment.name, p.replica.offset) for p in plan1.replicas)
    assert hooks.events == [("stored", "k", "dram")]
    # a key already in the pool: the place is given back, and the answer is "in the pool"
    assert m.put_reserved(r2, "k", checksum=5)
    assert m.get_replicas("k").checksum == 99 and m.segments["a"].used == 16 * KiB
    assert not m.put_reserved(r2, "k2", checksum=5), "a used place is gone"
    assert not m.put_reserved(12345, "k2", checksum=5), "an unknown place is refused, not guessed"
    # an unused place lapses after put_timeout_s like a PutStart, without counting as a stale put
    clock.t += 2.5
    for c in ("A", "B"):
        m.ping(c)
    m.tick()
    assert not m.put_reserved(r3, "late", checksum=1)
    assert m.segments["a"].used == 8 * KiB and m.segments["b"].used == 8 * KiB
    assert [e for e in hooks.events if e[1] != "k"] == [], "reserved places are never announced"
    with pytest.raises(InvalidArgument, match="reserved places"):
        m.put_start("\x00reserved/1", 10, 0)
    with pytest.raises(InvalidArgument, match="count"):
        m.reserve(10, 0)


def test_places_reserved_ahead_never_push_objects_out():
    m, clock, _ = make(high_watermark=0.9)
    m.mount("A", dram("a", 32 * KiB))
    for i in range(3):
        put(m, f"k{i}", 8 * KiB)
    with pytest.raises(NoRoom):  # 24 KiB used: one more place would pass the watermark (28.8 KiB)
        m.reserve(8 * KiB, 4, first_evicts=False)
    assert all(m.exist(f"k{i}") for i in range(3)), "a refill evicted an object"
    assert m.remove(["k2"]) == 1
    got = m.reserve(8 * KiB, 4, first_evicts=False)
    assert len(got) == 1, "places ahead stop below the watermark"
    # above the watermark, the round gives up places ahead (they hold nothing) before any object; the
    # place's bytes stay taken while its writer may still write there, counted as leaving
    put(m, "k3", 8 * KiB)
    assert all(m.exist(k) for k in ("k0", "k1", "k3")) and not m.revoke_reserved(got[0][0])
    seg = m.segments["a"]
    assert seg.used == 32 * KiB and seg.leaving_bytes == 8 * KiB
    clock.t += DROPPED_PLACE_HOLD_S + 0.01
    m.ping("A")
    m.tick()
    assert seg.used == 24 * KiB and seg.leaving_bytes == 0
    # a place for a put in hand evicts as its PutStart would: the LRU object goes
    put(m, "k4", 8 * KiB)
    first = m.reserve(8 * KiB, 2, first_evicts=True)
    assert first and not m.exist("k0") and m.exist("k4")


def test_a_place_the_master_drops_is_not_handed_out_while_its_writer_may_still_write():
    """Eviction gives up a place reserved ahead, but its writer may be writing into it right now (it
    uses a place up to PLACE_USE_S after the answer): no new object is put on those bytes until
    that window has passed, or the late write would overwrite it (found by tools/bench_failover.py:
    objects that failed their checksum and were lost once DRAM was full)."""
    m, clock, _ = make(high_watermark=0.9)
    m.mount("A", dram("a", 32 * KiB))
    [(rid, plan)] = m.reserve(8 * KiB, 1, first_evicts=False)
    held = {p.replica.offset for p in plan.replicas}
    for i in range(3):
        put(m, f"k{i}", 8 * KiB)  # full: the watermark's round drops the place
    assert not m.revoke_reserved(rid), "the master dropped it"
    for i in range(3):  # each new put evicts an object (no LMDB) and takes its bytes, never the place's
        clock.t += 0.1
        new = m.put_start(f"n{i}", 8 * KiB, 7)
        assert {p.replica.offset for p in new.replicas}.isdisjoint(held), (i, new.replicas)
        m.put_end(f"n{i}")
    clock.t += DROPPED_PLACE_HOLD_S
    m.ping("A")
    m.tick()
    assert m.segments["a"].leaving_bytes == 0
    reused = False
    for i in range(4):  # the bytes are free again: later puts may land there
        new = m.put_start(f"later{i}", 8 * KiB, 7)
        reused = reused or bool({p.replica.offset for p in new.replicas} & held)
        m.put_end(f"later{i}")
    assert reused


def test_the_objects_gauge_is_read_from_the_watched_masters_at_scrape_time():
    """mooncaked_store_objects is the masters' own count of committed objects, read when scraped: no write per
    commit on the hot path, and a master replaced by a new one (a standby taking over) is followed."""
    from mooncaked.store import metrics

    def scraped() -> float:
        family = next(f for f in metrics.MASTERS.collect() if f.name == "mooncaked_store_objects")
        return family.samples[0].value

    m, _, _ = make()
    m.mount("A", dram("a", 64 * KiB))
    before = scraped()  # other tests' masters, if any are still watched
    metrics.MASTERS.watch(m)
    try:
        put(m, "k1")
        put(m, "k2")
        m.put_start("pending", 4 * KiB, 7)  # not committed: not counted
        assert scraped() == before + 2
        m.remove(["k1"])
        assert scraped() == before + 1
    finally:
        metrics.MASTERS.unwatch(m)
    assert scraped() == before
