"""Tiers that keep their promise, over real gRPC and sockets on loopback: with a DRAM tier of a
few objects and an LMDB tier of many, no put is dropped and a whole chain reads back (promoted in
pieces, each piece's lease given back); and a store master killed with SIGKILL and restarted on
its port gets every object back, the ones that sat only in an engine's DRAM included."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from store_helpers import client, start
from test_store_cluster import Master, free_port

KiB = 1024
pytestmark = pytest.mark.timeout(120)


async def until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ok = cond()
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_no_put_is_dropped_and_a_chain_longer_than_dram_reads_back(tmp_path):
    runner, addr = await start(lease_s=5.0)
    # DRAM for 8 objects, LMDB for 512; no retries, so a put that found no room would show as False
    owner = await client(addr, "owner", dram_bytes=64 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                         lmdb_bytes=4096 * KiB, no_room_retry_s=0.0)
    reader = await client(addr, "reader", get_batch_keys=64)
    try:
        data = {f"m/{i:03d}": os.urandom(8 * KiB) for i in range(120)}
        items = list(data.items())
        assert all(await owner.batch_put(items[:100])), "a batch far larger than DRAM lands whole"
        for key, value in items[100:]:
            assert await owner.put(key, value), key  # single puts too
        stats = await owner.pool_stats()
        assert stats.objects == 120
        keys = list(data)
        assert await reader.longest_prefix(keys) == 120
        got = await reader.batch_get(keys)  # 120 objects through a DRAM of 8: promoted piece by piece
        assert [k for k, v in zip(keys, got) if v != data[k]] == []
        assert (await reader.pool_stats()).promotions >= 100
        # and again, at once: the first read's leases were given back, nothing waits for them to lapse
        assert await reader.batch_get(keys[:40]) == [data[k] for k in keys[:40]]
    finally:
        await reader.close()
        await owner.close()
        await runner.stop()


async def _objects(c, want: int) -> bool:
    try:
        return (await c.pool_stats()).objects >= want
    except Exception:  # noqa: BLE001 - the restarted master may not be up yet
        return False


async def test_a_master_killed_and_restarted_gets_every_dram_object_back(tmp_path):
    port = free_port()
    master = Master(port)
    addr = master.address
    plain = await client(addr, "plain", dram_bytes=1024 * KiB)  # DRAM only: nothing of it is on disk
    tiered = await client(addr, "tiered", dram_bytes=1024 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                          lmdb_bytes=8192 * KiB)
    writer = await client(addr, "writer")
    try:
        data = {f"m/{i:03d}": os.urandom(16 * KiB) for i in range(80)}  # 1.25 MiB: both DRAMs hold some
        assert all(await writer.batch_put(list(data.items())))
        stats = await writer.pool_stats()
        held = {s.owner: s.objects for s in stats.segments if s.medium == "dram"}
        assert held["plain"] > 0 and held["tiered"] > 0
        # each owner's journal has heard of what its DRAM holds (batched on its Tasks stream)
        await until(lambda: len(plain.journal) == held["plain"] and len(tiered.journal) == held["tiered"],
                    "the journals to catch up")

        assert master.stop(signal.SIGKILL) != 0
        master = Master(port)
        await until(lambda: plain.mounts.remounts >= 1 and tiered.mounts.remounts >= 1, "both owners to remount")
        await until(lambda: _objects(writer, 80), "every object to be re-reported")
        stats = await writer.pool_stats()
        assert stats.objects == 80 and stats.master_epoch != 0
        again = {s.owner: s.objects for s in stats.segments if s.medium == "dram"}
        assert again["plain"] == held["plain"], "DRAM-only objects outlived the master"
        keys = list(data)
        assert await writer.longest_prefix(keys) == 80
        assert await writer.batch_get(keys) == [data[k] for k in keys]
    finally:
        for c in (writer, tiered, plain):
            await c.close()
        assert master.stop() == 0
