"""The state machine keeps what its tiers promise: a put lands while any tier has room (DRAM, or
the writer's own LMDB tier), a DRAM object is persisted to its owner's LMDB tier and then leaves
DRAM at no cost, a chain longer than its owner's DRAM is read in pieces (leases given back), and
DRAM owners are told what their DRAM holds (the journal a remount re-reports)."""

from __future__ import annotations

import pytest
from test_store_master import KiB, Hooks, dram, make

from mooncaked.store.errors import NoRoom
from mooncaked.store.records import ObjectRecord, ObjectView, PromotionPending, SegmentSpec


def lmdb(name: str, capacity: int = 1 << 20) -> SegmentSpec:
    return SegmentSpec(name, "lmdb", capacity)


def settle(m, hooks: Hooks, kind: str, ok: bool = True) -> int:
    """Report every open task of `kind` done; returns how many."""
    open_ = [t for t in hooks.tasks if t.kind == kind and t.task_id in m.tasks]
    for t in open_:
        m.task_done(t.client_id, [(t.task_id, ok, "" if ok else "disk full")])
    return len(open_)


def test_a_committed_dram_object_is_persisted_and_then_leaves_dram_for_free():
    m, _, hooks = make(high_watermark=0.5, evict_fraction=0.25)
    m.mount("A", lmdb("a-lmdb"))
    m.mount("A", dram("a", 64 * KiB))
    for i in range(3):
        plan = m.put_start(f"k{i}", 8 * KiB, 7)
        assert [p.segment.name for p in plan.replicas] == ["a"]
        m.put_end(f"k{i}")
    persists = [t for t in hooks.tasks if t.kind == "persist"]
    assert [(t.key, t.src_segment, t.dst_segment) for t in persists] == [(f"k{i}", "a", "a-lmdb") for i in range(3)]
    assert settle(m, hooks, "persist") == 3
    assert m.medium_of(m.objects["k0"]) == "dram" and m.objects["k0"].replica_on("a-lmdb").complete
    for i in range(3, 8):  # past the watermark: the persisted copies are dropped, nothing is demoted
        m.put_start(f"k{i}", 8 * KiB, 7)
        m.put_end(f"k{i}")
    assert not [t for t in hooks.tasks if t.kind == "demote"] and m.demotions == 0
    assert m.medium_of(m.objects["k0"]) == "lmdb" and all(m.exist(f"k{i}") for i in range(8))
    assert ("stored", "k0", "lmdb") in hooks.events and not any(e[0] == "removed" for e in hooks.events)


def _objects(m) -> dict[str, int]:
    """What a status shows per segment, checked against the copies the master holds complete."""
    stats = {s.name: s.objects for s in m.stats().segments}
    for name in stats:
        assert stats[name] == sum(1 for o in m.objects.values() for r in o.replicas if r.segment == name and r.complete)
    return stats


def test_a_segment_counts_complete_copies_not_places_or_copies_being_written():
    """`objects` per segment (PoolStats, mooncakectl status, the metric) is what readers can get there:
    not a put in progress, a place reserved ahead, or a persist ordered but not done."""
    m, _, hooks = make()
    m.mount("A", lmdb("a-lmdb"))
    m.mount("A", dram("a", 64 * KiB))
    m.put_start("k", 4 * KiB, 7)
    m.reserve(4 * KiB, 3)
    assert _objects(m) == {"a-lmdb": 0, "a": 0}
    m.put_end("k")
    assert [t.kind for t in hooks.tasks] == ["persist"] and _objects(m) == {"a-lmdb": 0, "a": 1}
    assert settle(m, hooks, "persist") == 1 and _objects(m) == {"a-lmdb": 1, "a": 1}
    m.remove(["k"])
    assert _objects(m) == {"a-lmdb": 0, "a": 0}


def test_a_failed_persist_keeps_the_dram_copy():
    m, _, hooks = make()
    m.mount("A", lmdb("a-lmdb"))
    m.mount("A", dram("a", 64 * KiB))
    m.put_start("k", 4 * KiB, 7)
    m.put_end("k")
    assert settle(m, hooks, "persist", ok=False) == 1
    obj = m.objects["k"]
    assert [r.segment for r in obj.replicas] == ["a"] and m.segments["a-lmdb"].used == 0


def test_with_dram_full_a_put_lands_on_the_writers_own_lmdb_tier():
    """No put is dropped while LMDB has room: with DRAM full of objects not yet persisted (nothing
    can leave it now) the writer gets a place on its own LMDB tier; without one, NoRoom as before."""
    m, _, hooks = make(high_watermark=0.9)
    m.mount("W", lmdb("w-lmdb", 64 * KiB))
    m.mount("W", dram("w", 16 * KiB))
    plans = m.put_start_many([(f"k{i}", 4 * KiB, 7, 1, "", False) for i in range(12)], writer="W")
    media = [p.replicas[0].segment.medium for p in plans]
    assert media == ["dram"] * 4 + ["lmdb"] * 8
    assert all(p.replicas[0].segment.name == "w-lmdb" for p in plans[4:])
    for i in range(12):
        m.put_end(f"k{i}", 7)
    assert all(m.exist(f"k{i}") for i in range(12))
    assert [m.medium_of(m.objects[f"k{i}"]) for i in range(4, 12)] == ["lmdb"] * 8
    # a writer without an LMDB tier (here: one that lends nothing) finds no room while DRAM's objects
    # are still being persisted (nothing can leave it yet): NoRoom, which it retries, as before
    with pytest.raises(NoRoom):
        m.put_start("other", 4 * KiB, 7, writer="R")
    assert m.put_start_many([("other", 4 * KiB, 7, 1, "", False)], writer="R") == [None]
    settle(m, hooks, "persist")
    assert m.put_start("other", 4 * KiB, 7, writer="R").replicas, "persisted copies make room at once"


def test_an_lmdb_place_drops_the_lmdb_tiers_oldest_objects_when_it_must():
    m, _, _ = make(persist=False)
    m.mount("W", lmdb("w-lmdb", 8 * KiB))
    m.mount("W", dram("w", 4 * KiB))
    for i in range(4):  # one fits DRAM, the rest go to LMDB, which drops its least recently used
        plan = m.put_start(f"k{i}", 4 * KiB, 7, writer="W")
        assert plan.replicas, i
        m.put_end(f"k{i}")
    assert m.exist("k3") and not m.exist("k1") and m.segments["w-lmdb"].used <= 8 * KiB


def test_a_chain_longer_than_dram_is_read_in_pieces_with_leases_given_back():
    m, _, hooks = make(persist=False, lease_s=5.0)
    m.mount("A", lmdb("a-lmdb"))
    m.mount("A", dram("a", 16 * KiB))
    recs = [ObjectRecord(f"k{i}", 0, 4 * KiB, 7) for i in range(10)]
    m.mount("A", lmdb("a-lmdb"), recs)  # ten LMDB-only objects, DRAM for four
    lease = m.new_lease()
    results = []
    for i in range(10):
        try:
            results.append(m.get_replicas(f"k{i}", lease=lease))
        except NoRoom:
            results.append(None)
    assert [isinstance(r, PromotionPending) for r in results] == [True] * 4 + [False] * 6
    assert settle(m, hooks, "promote") == 4
    views = [m.get_replicas(f"k{i}", count=False, lease=lease) for i in range(4)]
    assert all(isinstance(v, ObjectView) for v in views)
    for r in results[:4]:
        m.release(-r.task_id, [f"k{i}" for i in range(4)])  # the promotions' own leases (what the service does)
    with pytest.raises(NoRoom):
        m.get_replicas("k4", lease=m.new_lease())  # the first piece is still leased
    assert m.release(lease, [f"k{i}" for i in range(4)]) == 4
    nxt = m.get_replicas("k4", lease=m.new_lease())
    assert isinstance(nxt, PromotionPending), "the released promoted copies (LMDB has them) made room at once"


def test_a_release_never_ends_another_readers_lease():
    m, clock, _ = make(lease_s=5.0)
    m.mount("A", dram("a", 64 * KiB))
    m.put_start("k", 4 * KiB, 7)
    m.put_end("k")
    first, second = m.new_lease(), m.new_lease()
    m.get_replicas("k", lease=first)
    m.get_replicas("k", lease=second)
    m.get_replicas("k")  # an anonymous reader too
    m.release(first, ["k"])
    m.release(second, ["k"])
    assert m.objects["k"].lease_until == clock.t + 5.0, "the anonymous lease holds until it lapses"
    m.release(first, ["k"])  # twice, or after it lapsed: nothing
    clock.t += 6
    m.get_replicas("k", lease=first)
    assert m.release(first, ["k"]) == 1 and m.objects["k"].lease_until <= clock.t


def test_dram_owners_hear_what_their_dram_holds():
    m, _, hooks = make(persist=False, high_watermark=0.5, evict_fraction=0.25)
    m.mount("A", dram("a", 16 * KiB))
    m.mount("B", dram("b", 64 * KiB))
    a = m.put_start("x", 4 * KiB, 11, preferred="a").replicas[0].replica
    m.put_end("x")
    assert hooks.journals == [("A", "x", a.offset, 4 * KiB)], "the owner of the copy, not the writer"
    m.remove(["x"])
    assert hooks.journals[-1] == ("A", "x", a.offset, 0), "a copy that left"
    del hooks.journals[:]
    m.put_start("y", 4 * KiB, 11, preferred="b")
    assert hooks.journals == [], "nothing until the commit"
    m.put_revoke("y")
    assert hooks.journals == []


def test_dram_records_reported_at_a_remount_are_adopted_and_persisted():
    m, _, hooks = make()
    m.mount("A", lmdb("a-lmdb"))
    recs = [ObjectRecord("x", 0, 4 * KiB, 7), ObjectRecord("y", 4 * KiB, 4 * KiB, 8),
            ObjectRecord("clash", 2 * KiB, 4 * KiB, 9)]  # overlaps both: refused
    accepted, rejected = m.mount("A", dram("a", 64 * KiB), recs)
    assert (accepted, rejected) == (2, ["clash"])
    assert isinstance(m.get_replicas("x"), ObjectView) and m.segments["a"].used == 8 * KiB
    assert sorted(t.key for t in hooks.tasks if t.kind == "persist") == ["x", "y"]
