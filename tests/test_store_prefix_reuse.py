"""Prefix reuse across prefill instances through the Mooncake Store (real processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import (common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2,
                                         engine_pb2_grpc, store_pb2, store_pb2_grpc)
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)


def _request(ids):
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))


async def test_second_prefill_reuses_the_first_ones_prefix_from_the_pool(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path, extra_env={"MOONCAKED_STORE_DRAM_BYTES": "4MiB"})
    try:
        c.start("conductor", "conductor")
        store_port = c.start("store", "store")
        c.extra_env["MOONCAKED_STORE"] = f"127.0.0.1:{store_port}"
        for name in ("p1", "p2", "d1"):
            c.start(name, "prefill" if name.startswith("p") else "decode")
        c.wait_serving(["p1", "p2", "d1"])
        base = random_prompts([64], seed=70)[0]
        tail = random_prompts([9], seed=71)[0]
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p2", drain=True), timeout=5)
            first = [x async for x in stub.Generate(_request(base + [3, 4]), timeout=60)]
            assert first[0].prefill_instance == "p1"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{store_port}") as sch:
                store = store_pb2_grpc.StoreMasterStub(sch)
                for _ in range(100):  # the write-back is asynchronous
                    stats = await store.PoolStats(store_pb2.PoolStatsRequest(), timeout=5)
                    if stats.objects >= 16:
                        break
                    await asyncio.sleep(0.1)
                assert stats.objects == 16  # every full block of the 66-token prompt
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p2", drain=False), timeout=5)
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p1", drain=True), timeout=5)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{c.ports['p2']}") as pch:
                p2 = engine_pb2_grpc.EngineStub(pch)
                before = (await p2.Stats(engine_pb2.StatsRequest(), timeout=5)).load
                second = [x async for x in stub.Generate(_request(base + tail), timeout=60)]
                after = (await p2.Stats(engine_pb2.StatsRequest(), timeout=5)).load
        assert second[0].prefill_instance == "p2"
        assert second[0].num_cached_tokens == 64  # 16 blocks of 4 pulled from the pool
        assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(tail)
        # p2 wrote back the 2 new full blocks of its own prompt: 18 objects
        ctl = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--store", f"127.0.0.1:{store_port}", "store"],
                             capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0 and "18 objects" in ctl.stdout and "p1" in ctl.stdout, ctl.stdout + ctl.stderr
        cold = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
        want = cold.generate([base + tail], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        assert [t for x in second for t in x.token_ids] == want
    finally:
        c.stop()
