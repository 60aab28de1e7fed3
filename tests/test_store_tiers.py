"""A tiered pool keeps what its tiers promise (real processes): a DRAM tier of a few blocks and an
LMDB tier of many hold a whole long prefix, a second prefill reuses it, and so does every engine
restarted on its LMDB path."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import (common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2,
                                         store_pb2_grpc)
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(400)

BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # tiny llama: layers, K+V, block of 4 tokens, 2 KV heads of 16, float32
PREFIX = 300  # 75 blocks: DRAM holds 8 of them per engine


def _request(ids):
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))


async def _objects(store: str, want: int, timeout_s: float = 20) -> int:
    async with grpc.aio.insecure_channel(store) as ch:
        stub = store_pb2_grpc.StoreMasterStub(ch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            stats = await stub.PoolStats(store_pb2.PoolStatsRequest(), timeout=5)
            if stats.objects >= want or loop.time() > deadline:
                return stats.objects
            await asyncio.sleep(0.2)


async def _generate(c: Cluster, ids, only: str) -> list:
    async with grpc.aio.insecure_channel(c.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for name in ("p1", "p2"):
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name=name, drain=name != only), timeout=5)
        return [x async for x in stub.Generate(_request(ids), timeout=60)]


def _why(c: Cluster, reader: str) -> list[str]:
    """What the reader and the master logged about reads that fell short (for a failure's message)."""
    return [line for name in (reader, "store") for line in c.log(name).splitlines()
            if " WARNING " in line or "could not be read back" in line or "pool" in line.lower()][-30:]


async def test_a_long_prefix_outgrowing_dram_is_reused_from_lmdb_and_survives_engine_restarts(
        tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path, extra_env={"MOONCAKED_STORE_DRAM_BYTES": str(8 * BLOCK_BYTES),
                                             "MOONCAKED_STORE_LMDB_BYTES": "4MiB"})
    engines = {"p1": "prefill", "p2": "prefill", "d1": "decode"}
    try:
        # plans no peer pull (p1's KV cache holds the prefix too): the second prefill reads the pool
        c.start("conductor", "conductor", "--policy", "cache_aware_local")
        store = f"127.0.0.1:{c.start('store', 'store')}"
        c.extra_env["MOONCAKED_STORE"] = store
        for name, role in engines.items():
            c.start(name, role, "--store-lmdb-path", str(tmp_path / f"lmdb-{name}"))
        c.wait_serving(list(engines))
        base = random_prompts([PREFIX], seed=80)[0]
        first = await _generate(c, base + [5, 6], "p1")
        assert first[0].prefill_instance == "p1"
        blocks = (PREFIX + 2) // 4
        # no put is dropped while LMDB has room: every full block of the prompt is in the pool
        assert await _objects(store, blocks) == blocks
        second = await _generate(c, base + random_prompts([9], seed=81)[0], "p2")
        assert second[0].prefill_instance == "p2"
        assert second[0].num_cached_tokens >= 0.9 * PREFIX, (second[0].num_cached_tokens, _why(c, "p2"))
        cold = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
        want = cold.generate([base + [7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids

        # every engine restarts on its LMDB path: what the disk tiers hold is found again
        for name in engines:
            c.kill(name)
            c.procs[name].wait(10)
        for name, role in engines.items():  # (each has remounted its tiers once `start` returns)
            c.start(name, role, "--store-lmdb-path", str(tmp_path / f"lmdb-{name}"))
        c.wait_serving(["p2", "d1"])  # p1 stays drained: an operator's drain outlives a restart
        third = await _generate(c, base + [7, 8, 9], "p2")
        assert third[0].num_cached_tokens >= 0.9 * PREFIX, (third[0].num_cached_tokens, _why(c, "p2"))
        assert [t for x in third for t in x.token_ids] == want
    finally:
        c.stop()
