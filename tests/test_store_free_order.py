"""The master's ranking of DRAM segments by free bytes (store/free_order.py) against a stable sort of the same
segments, through random places and frees, segments mounted and unmounted, and rankings stopped early or
read while the segments change under them, as placement reads it."""

from __future__ import annotations

import contextlib
import random

from mooncaked.store.allocator import ExtentAllocator
from mooncaked.store.free_order import FreeOrder
from mooncaked.store.master import StoreMaster
from mooncaked.store.records import Endpoint, Policy, Segment, SegmentSpec

KiB = 1 << 10


def _segment(i: int, capacity: int) -> Segment:
    return Segment(f"seg-{i}", f"client-{i}", "dram", capacity, Endpoint(f"127.0.0.1:{20000 + i}", "tcp", "r"),
                   ExtentAllocator(capacity))


def _sorted(order: FreeOrder) -> list[str]:
    # the ranking placement had before: sorted() is stable, so ties stay in mount order
    return [s.name for s in sorted(order.segments.values(), key=lambda s: s.alloc.free_bytes, reverse=True)]


def test_the_ranking_is_a_stable_sort_by_free_bytes_through_any_changes():
    rng = random.Random(7)
    order = FreeOrder()
    taken: dict[str, list[tuple[int, int]]] = {}
    mounted = 0
    for _ in range(12):
        seg = _segment(mounted, rng.choice([64, 128, 256]) * KiB)  # equal capacities: ties to break
        order.add(seg)
        taken[seg.name] = []
        mounted += 1
    for step in range(3000):
        segs = list(order.segments.values())
        seg = rng.choice(segs)
        roll = rng.random()
        if roll < 0.5:
            size = rng.choice([1, 4, 16]) * KiB
            off = seg.alloc.alloc(size)
            if off is not None:
                taken[seg.name].append((off, size))
                order.changed(seg)
        elif roll < 0.9 and taken[seg.name]:
            off, size = taken[seg.name].pop(rng.randrange(len(taken[seg.name])))
            seg.alloc.free(off, size)
            order.changed(seg)
        elif roll < 0.95 and len(segs) > 2:
            order.remove(seg)
        else:
            new = _segment(mounted, rng.choice([64, 128, 256]) * KiB)
            mounted += 1
            order.add(new)
            taken[new.name] = []
        if step % 7 == 0:  # a ranking stopped early gives back what it took
            with contextlib.closing(order.ranked()) as ranked:
                first = [s.name for _, s in zip(range(rng.randrange(1, 4)), ranked)]
            assert first == _sorted(order)[:len(first)]
        assert [s.name for s in order.ranked()] == _sorted(order), step
        assert order.biggest == max(s.capacity for s in order.segments.values())


def test_a_segment_changed_while_it_is_ranked_comes_once_and_stays_ranked():
    order = FreeOrder()
    segs = [_segment(i, 64 * KiB) for i in range(4)]
    for s in segs:
        order.add(s)
    seen = []
    for seg in order.ranked():  # as placement does: a place taken on each segment as it is reached
        seen.append(seg.name)
        seg.alloc.alloc(8 * KiB * (len(seen)))
        order.changed(seg)
    assert seen == ["seg-0", "seg-1", "seg-2", "seg-3"]
    assert [s.name for s in order.ranked()] == ["seg-0", "seg-1", "seg-2", "seg-3"] == _sorted(order)


def test_the_master_places_on_the_segment_with_most_free_bytes_and_never_twice_on_one():
    m = StoreMaster(Policy(replicas=2, client_ttl_s=3600.0))
    for i, cap in enumerate([256 * KiB, 512 * KiB, 384 * KiB]):
        m.mount(f"client-{i}", SegmentSpec(f"seg-{i}", "dram", cap, Endpoint(f"127.0.0.1:{20000 + i}", "tcp", "r")))
    plan = m.put_start("k/0", 64 * KiB, 0)
    assert [p.segment.name for p in plan.replicas] == ["seg-1", "seg-2"]
    plan = m.put_start("k/1", 200 * KiB, 0)  # seg-1 (448 KiB free) and seg-2 (320), before seg-0 (256)
    assert [p.segment.name for p in plan.replicas] == ["seg-1", "seg-2"]
    plan = m.put_start("k/2", 16 * KiB, 0, preferred="seg-0")  # the writer's own segment first
    assert [p.segment.name for p in plan.replicas][0] == "seg-0" and len({p.segment.name for p in plan.replicas}) == 2
    m.unmount("client-1", "seg-1")
    assert [s.name for s in m.catalog.free_order.ranked()] == ["seg-0", "seg-2"]
