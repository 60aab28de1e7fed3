"""Pool events over real gRPC on loopback: the master's WatchPool stream (a snapshot, then every
change with the medium a reader finds it on) with real store clients putting, removing, filling
DRAM past its watermark with and without an LMDB tier; and the conductor's PoolWatch keeping a
prefix index's "store" holder equal to the pool, across a master restart."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from store_helpers import client, start

from mooncaked.conductor.pool_watch import PoolWatch
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.store import Policy
from mooncaked.store.master import StoreMaster
from mooncaked.store.pool_events import PoolEventHub
from mooncaked.store.master_runner import MasterRunner

KiB = 1024
pytestmark = pytest.mark.timeout(60)
STORED = store_pb2.PoolEvent.KIND_STORED




async def until(cond: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ok = cond()
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def truth(runner: MasterRunner, prefix: str = "") -> dict[str, str]:
    """What the master holds right now: readable key -> best medium."""
    m = runner.master
    return {k: m.medium_of(o) for k, o in m.objects.items() if o.committed and k.startswith(prefix)}


class Watcher:
    """A WatchPool subscriber over a real stub, applying what it hears to key -> medium."""

    def __init__(self, address: str, prefix: str = "") -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = store_pb2_grpc.StoreMasterStub(self.channel)
        self.prefix = prefix
        self.state: dict[str, str] = {}
        self.snapshot: dict[str, str] | None = None
        self.epoch = 0
        self.messages = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for msg in self.stub.WatchPool(store_pb2.WatchPoolRequest(key_prefix=self.prefix), timeout=30):
            self.messages += 1
            for e in msg.events:
                for k in e.keys:
                    if e.kind == STORED:
                        self.state[k] = e.medium
                    else:
                        self.state.pop(k, None)
            if msg.snapshot_done:
                self.snapshot = dict(self.state)
                self.epoch = msg.master_epoch

    async def synced(self) -> dict[str, str]:
        await until(lambda: self.snapshot is not None, "the snapshot")
        return self.snapshot

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()


async def test_snapshot_then_puts_and_removes_in_order():
    runner, addr = await start()
    owner = await client(addr, "owner", dram_bytes=512 * KiB)
    watchers: list[Watcher] = []
    try:
        assert all(await owner.batch_put([(f"m/{i}", os.urandom(4 * KiB)) for i in range(5)]))
        assert await owner.put("other/1", os.urandom(4 * KiB))
        mine, everything = Watcher(addr, "m/"), Watcher(addr)
        watchers += [mine, everything]
        assert await mine.synced() == {f"m/{i}": "dram" for i in range(5)}
        assert await everything.synced() == {**{f"m/{i}": "dram" for i in range(5)}, "other/1": "dram"}
        assert mine.epoch == runner.master.epoch
        assert await owner.put("m/5", os.urandom(4 * KiB))
        assert await owner.remove(["m/1", "m/404"]) == 1
        await until(lambda: mine.state == truth(runner, "m/") and "m/5" in mine.state, "the put and the remove")
        assert "m/1" not in mine.state and "other/1" not in mine.state
        await until(lambda: everything.state == truth(runner), "the unfiltered watcher")
        closing, owner = owner, None
        await closing.close()  # its DRAM segment leaves the pool, and every object with it
        await until(lambda: not everything.state, "the unmount's removals")
        assert truth(runner) == {}
    finally:
        for w in watchers:
            await w.close()
        if owner is not None:
            await owner.close()
        await runner.stop()


async def test_demotion_to_lmdb_and_promotion_back_change_the_medium(tmp_path):
    runner, addr = await start(lease_s=0.5)
    owner = await client(addr, "owner", dram_bytes=1024 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                         lmdb_bytes=32 * 1024 * KiB)
    w = Watcher(addr, "m/")
    try:
        assert await w.synced() == {}
        data = {f"m/{i:02d}": os.urandom(64 * KiB) for i in range(48)}  # 3 MiB into 1 MiB of DRAM
        assert all(await owner.batch_put(list(data.items())))
        await until(lambda: len(w.state) == 48 and list(w.state.values()).count("lmdb") >= 30,
                    "stored events with medium lmdb for the demoted objects")
        await until(lambda: w.state == truth(runner), "the watcher to match the master")
        cold = next(k for k, medium in w.state.items() if medium == "lmdb")
        assert await owner.get(cold) == data[cold]  # promoted into DRAM to be read
        await until(lambda: w.state[cold] == "dram", "the promotion's stored event with medium dram")
        await until(lambda: w.state == truth(runner), "the watcher to match the master after the read")
    finally:
        await w.close()
        await owner.close()
        await runner.stop()


async def test_eviction_without_lmdb_removes():
    runner, addr = await start(high_watermark=0.5)
    owner = await client(addr, "owner", dram_bytes=512 * KiB)  # no LMDB: evicted objects are dropped
    w = Watcher(addr)
    try:
        await w.synced()
        for i in range(24):
            assert await owner.put(f"m/{i}", os.urandom(32 * KiB))
        await until(lambda: w.state == truth(runner), "the watcher to match the master")
        assert 0 < len(w.state) < 24 and set(w.state.values()) == {"dram"}
        assert "m/0" not in w.state, "the oldest objects were evicted and reported removed"
    finally:
        await w.close()
        await owner.close()
        await runner.stop()


def test_a_subscriber_that_falls_behind_is_cut_off():
    master = StoreMaster(Policy())
    hub = PoolEventHub(master, max_queued=3)
    slow, _ = hub.subscribe("", "slow-peer")
    for i in range(3):
        hub.add("stored", [f"m/{i}"], "dram")
        hub.flush()
    assert slow.queue.qsize() == 3 and not slow.dropped
    hub.add("removed", ["m/0"], "")
    hub.flush()
    assert slow.dropped and hub.subscribers == 0
    assert slow.queue.get_nowait() is None, "its backlog is discarded: it starts over from a snapshot"
    hub.add("stored", ["m/9"], "dram")  # nobody listens: nothing is kept
    hub.flush()
    fresh, snapshot = hub.subscribe("", "fresh-peer")
    assert [m.snapshot_done for m in snapshot] == [True] and fresh.queue.empty()


async def test_conductor_pool_watch_follows_the_pool_across_a_master_restart(tmp_path):
    runner, addr = await start(lease_s=0.5)
    port = int(addr.rsplit(":", 1)[1])
    owner = await client(addr, "owner", dram_bytes=512 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                         lmdb_bytes=32 * 1024 * KiB)
    index = PrefixIndex()
    watch = PoolWatch(addr, "model", index, retry_s=0.05, max_retry_s=0.2)
    task = None
    hashes = list(range(1000, 1024))

    def held() -> dict[str, int]:
        return index.media(POOL_HOLDER, hashes)

    try:
        assert all(await owner.batch_put([(f"model/{h}", os.urandom(32 * KiB)) for h in hashes[:8]]))
        assert await owner.put("other-model/1000", os.urandom(KiB))
        task = asyncio.create_task(watch.run())
        await until(lambda: watch.synced and held() == {"dram": 8}, "the snapshot in the index")
        assert index.match(hashes)[POOL_HOLDER] == 8
        assert all(await owner.batch_put([(f"model/{h}", os.urandom(32 * KiB)) for h in hashes[8:]]))
        await until(lambda: sum(held().values()) == 24 and held().get("lmdb", 0) > 0,
                    "live events, some of them demotions to lmdb")
        assert await owner.remove([f"model/{h}" for h in hashes[:2]]) == 2
        await until(lambda: POOL_HOLDER not in index.match(hashes), "the removal of the chain's head")
        assert watch.ignored_keys == 0, "the master filtered other models' keys"
        await until(lambda: not runner.master.tasks, "tier moves to settle")
        on_lmdb = {h for h in hashes[2:] if index.media(POOL_HOLDER, [h]) == {"lmdb": 1}}
        assert on_lmdb

        epoch = runner.master.epoch
        await runner.stop()
        await until(lambda: not held() and not watch.synced, "the pool's blocks to leave the index")
        runner, _ = await start(port, lease_s=0.5)
        assert runner.master.epoch != epoch
        # the owner remounts its LMDB tier; the watch resubscribes and takes the new snapshot
        await until(lambda: watch.synced and watch.epoch == runner.master.epoch, "the watch to resubscribe")

        def restored() -> dict[int, str]:
            return {h: medium for h in hashes for medium in index.media(POOL_HOLDER, [h])}

        def master_holds() -> dict[int, str]:
            return {int(k.split("/")[1]): medium for k, medium in truth(runner, "model/").items()}

        await until(lambda: set(restored()) == set(hashes[2:]) and restored() == master_holds(),
                    "every block the owner holds to be back in the index")
        assert "dram" in restored().values(), "DRAM objects outlived the master too (its owner's journal)"
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await watch.close()
        await owner.close()
        await runner.stop()
