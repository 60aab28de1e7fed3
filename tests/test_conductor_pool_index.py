"""The conductor's prefix index follows the Mooncake Store pool (real processes): blocks a prefill
writes back to the pool appear under holder "store" in the KV-indexer API, and leave it when they
leave the pool, because the store master reports both (WatchPool), not the engine."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest

from cluster import Cluster, free_port
from mooncaked.conductor.prefix_index import POOL_HOLDER
from mooncaked.hashing import block_hashes
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2, store_pb2_grpc
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)


async def _pool_row(http: aiohttp.ClientSession, model: str, hashes: list[int]) -> dict | None:
    async with http.post("/query_by_hash", json={"model": model, "seq_hashes": hashes, "block_size": 4}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["default"].get(POOL_HOLDER)


async def _until(cond, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_index_lists_pool_blocks_until_they_leave_the_pool(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path, extra_env={"MOONCAKED_STORE_DRAM_BYTES": "4MiB"})
    store = f"127.0.0.1:{free_port()}"
    try:
        # the conductor comes first and finds the master once it is up (it retries)
        c.start("conductor", "conductor", "--store", store)
        c.start("store", "store", "--listen", store)
        c.extra_env["MOONCAKED_STORE"] = store
        c.start("p1", "prefill")
        c.start("d1", "decode")
        c.wait_serving(["p1", "d1"])
        http_url = f"http://127.0.0.1:{c.http_port('conductor')}"
        ids = random_prompts([66], seed=81)[0]
        hashes = block_hashes(ids, 4)
        assert len(hashes) == 16
        model = folder.name
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            assert [x async for x in conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=60)]
        async with aiohttp.ClientSession(http_url, timeout=aiohttp.ClientTimeout(total=10)) as http:

            async def all_in_pool():
                row = await _pool_row(http, model, hashes)
                return row if row and row["longest_matched"] == 64 else None

            row = await _until(all_in_pool, "the prompt's 16 blocks under holder 'store'")
            assert row["CPU"] == 64 and row["DISK"] == 0, row  # in the pool's DRAM

            async def p1_holds_all():  # p1's own cache reaches the index with its heartbeat, not the pool's events
                async with http.post("/query_by_hash", json={"model": model, "seq_hashes": hashes,
                                                              "block_size": 4}) as r:
                    return (await r.json())["default"].get("p1", {}).get("longest_matched") == 64

            await _until(p1_holds_all, "p1's own blocks in the index")
            async with grpc.aio.insecure_channel(store) as sch:
                master = store_pb2_grpc.StoreMasterStub(sch)
                removed = await master.Remove(store_pb2.RemoveRequest(keys=[f"{model}/{h}" for h in hashes[4:]]),
                                              timeout=5)
                assert removed.removed == 12

                async def only_head():
                    row = await _pool_row(http, model, hashes)
                    return row if row and row["longest_matched"] == 16 else None

                await _until(only_head, "the removed blocks to leave holder 'store'")
                await master.Remove(store_pb2.RemoveRequest(keys=[f"{model}/{h}" for h in hashes[:4]]), timeout=5)

                async def none_left():
                    row = await _pool_row(http, model, hashes)
                    return row is not None and row["longest_matched"] == 0 and row["CPU"] == 0

                await _until(none_left, "every block to leave holder 'store'")
            async with http.post("/query_by_hash", json={"model": model, "seq_hashes": hashes,
                                                          "block_size": 4}) as r:
                own = (await r.json())["default"]["p1"]
            assert own["longest_matched"] == 64, "p1's own cache is another holder, untouched"
        assert "Traceback" not in c.log("conductor")
    finally:
        c.stop()
