"""Evictions and removals reach the conductor's prefix index: a block the pool evicts (DRAM with no
LMDB behind it, or a full LMDB tier) leaves the index's "store" holder, by the store master's pool
events on real gRPC (WatchPool -> PoolWatch -> PrefixIndex). And a BlockRemoved naming a medium
takes only that medium away from a holder that keeps the block elsewhere."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
from store_helpers import client, start

from mooncaked.conductor.kv_indexer import KVIndexer
from mooncaked.conductor.pool_watch import PoolWatch
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.conductor.registry import Registry

KiB = 1024
pytestmark = pytest.mark.timeout(60)


async def until(cond, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def pool_blocks(index: PrefixIndex, hashes: list[int]) -> set[int]:
    return {h for h in hashes if index.media(POOL_HOLDER, [h])}


def master_blocks(runner) -> set[int]:
    return {int(k.split("/")[1]) for k, o in runner.master.objects.items() if o.committed and k.startswith("model/")}


@pytest.mark.parametrize("tiered", [False, True], ids=["dram-only", "lmdb-full"])
async def test_an_evicted_block_leaves_the_conductors_prefix_index(tiered, tmp_path):
    runner, addr = await start(high_watermark=0.5, lease_s=0.5)
    # DRAM for 16 objects of 4 KiB; with `tiered`, an LMDB tier behind it that holds only 24
    kw = dict(lmdb_path=str(tmp_path / "lmdb"), lmdb_bytes=96 * KiB) if tiered else {}
    owner = await client(addr, "owner", dram_bytes=64 * KiB, no_room_retry_s=5.0, **kw)
    index = PrefixIndex()
    watch = PoolWatch(addr, "model", index, retry_s=0.05, max_retry_s=0.2)
    task = asyncio.create_task(watch.run())
    hashes = list(range(5000, 5064))
    try:
        await until(lambda: watch.synced, "the watch to subscribe")
        first = hashes[:8]
        assert all(await owner.batch_put([(f"model/{h}", os.urandom(4 * KiB)) for h in first]))
        await until(lambda: pool_blocks(index, first) == set(first), "the blocks to be listed under 'store'")
        for h in hashes[8:]:  # far more than both tiers hold: the oldest are evicted for good
            assert await owner.put(f"model/{h}", os.urandom(4 * KiB))
        await until(lambda: not runner.master.tasks, "tier moves to settle")
        await until(lambda: pool_blocks(index, hashes) == master_blocks(runner), "the index to follow the pool")
        gone = set(hashes) - master_blocks(runner)
        assert hashes[0] in gone and len(gone) >= 24, "the oldest blocks were evicted from the pool"
        assert all(POOL_HOLDER not in index.match([h]) for h in gone), "and no longer listed in the index"
        assert index.match(hashes).get(POOL_HOLDER, 0) == 0, "the chain's head is gone: nothing to reuse"
        if tiered:
            assert any(index.media(POOL_HOLDER, [h]) == {"lmdb": 1} for h in hashes), "some on LMDB only"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watch.close()
        await owner.close()
        await runner.stop()


def test_block_removed_with_a_medium_keeps_the_holders_other_media():
    index = PrefixIndex()
    index.stored("e1", [1, 2, 3], "hbm")
    index.stored("e1", [1, 2], "dram")  # offloaded to its CPU cache too
    assert index.media("e1", [1, 2, 3]) == {"hbm": 3}, "a block counts once, at its fastest"
    index.removed("e1", [1, 2, 3], "hbm")  # evicted from HBM
    assert index.match([1, 2, 3]) == {"e1": 2} and index.media("e1", [1, 2]) == {"dram": 2}
    index.removed("e1", [2], "lmdb")  # never held there: nothing changes
    assert index.match([1, 2]) == {"e1": 2}
    index.removed("e1", [1])  # no medium: from every medium
    assert index.match([1, 2]) == {}
    index.stored("e1", [7], "lmdb")
    assert index.lookup([7]).holder_slow == {"e1": 1}
    index.stored("e1", [7], "dram")
    assert index.lookup([7]).holder_slow == {}, "held on a fast medium as well"
    # the pool's events say where a block is at best now: they replace
    index.stored(POOL_HOLDER, [9], "dram", replace=True)
    index.stored(POOL_HOLDER, [9], "lmdb", replace=True)  # its DRAM copy left
    assert index.media(POOL_HOLDER, [9]) == {"lmdb": 1}


def test_kv_indexer_events_remove_one_medium_or_all():
    service = SimpleNamespace(model_id="m", block_size=4, hash_seed=0, index=PrefixIndex(),
                              registry=Registry(2.0), watches_pool=False,
                              model_config=SimpleNamespace(max_position_embeddings=4096))
    kv = KVIndexer(service)
    kv.register({"modelname": "m", "block_size": 4, "instance_id": "ext", "endpoint": "tcp://x:1", "type": "vLLM",
                 "dp_rank": 0})

    def event(kind: str, hashes: list[int], medium: str | None = None) -> dict:
        e = {"event_type": kind, "instance_id": "ext", "seq_hashes": hashes}
        return e if medium is None else {**e, "medium": medium}

    kv.events({"events": [event("stored", [11, 12], "gpu"), event("stored", [11, 12], "cpu")]})
    q = {"model": "m", "block_size": 4, "seq_hashes": [11, 12]}
    assert kv.query(q, by_hash=True)["default"]["ext"]["GPU"] == 8
    kv.events({"events": [event("removed", [11, 12], "gpu")]})
    row = kv.query(q, by_hash=True)["default"]["ext"]
    assert row["longest_matched"] == 8 and row["CPU"] == 8 and row["GPU"] == 0, "still in its CPU cache"
    kv.events({"events": [event("removed", [12])]})  # no medium: gone from every medium
    assert kv.query(q, by_hash=True)["default"]["ext"]["longest_matched"] == 4
