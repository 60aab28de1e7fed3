"""The disaggregated cluster as real processes: conductor, store master, two prefill and two decode instances."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

import urllib.request

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import (common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2,
                                         engine_pb2_grpc)
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

ENGINES = ["p1", "p2", "d1", "d2"]


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    # heartbeats (which carry KV events to the conductor's index) 5x a second: the routing test waits
    # one second for them, a wait that raced the default 1 s heartbeat on a loaded machine
    c = Cluster(folder, tmp_path_factory.mktemp("logs"), extra_env={"MOONCAKED_STORE_DRAM_BYTES": "2MiB",
                                                                   "MOONCAKED_HEARTBEAT_INTERVAL_S": "0.2"})
    try:
        c.start("conductor", "conductor")
        c.extra_env["MOONCAKED_STORE"] = f"127.0.0.1:{c.start('store', 'store')}"
        c.extra_env["MOONCAKED_METRICS"] = "127.0.0.1:0"
        for name in ENGINES:
            c.start(name, "prefill" if name.startswith("p") else "decode")
        c.wait_serving(ENGINES)
        yield c
    finally:
        c.stop()


def _request(ids: list[int], max_tokens: int = 10, **sampling) -> conductor_pb2.GenerateRequest:
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                            **sampling))


async def _generate(stub, req, timeout=60) -> tuple[list[int], list[conductor_pb2.GenerateChunk]]:
    chunks = [c async for c in stub.Generate(req, timeout=timeout)]
    return [t for c in chunks for t in c.token_ids], chunks


async def test_concurrent_requests_equal_the_engine_alone(cluster, tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    prompts = random_prompts([5, 9, 14, 22, 31, 40, 57, 63], seed=40)
    want = [o.token_ids for o in Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
            .generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        results = await asyncio.gather(*(_generate(stub, _request(p)) for p in prompts))
    assert [ids for ids, _ in results] == want
    used = {(chunks[0].prefill_instance, chunks[0].decode_instance) for _, chunks in results}
    assert {p for p, _ in used} <= {"p1", "p2"} and {d for _, d in used} <= {"d1", "d2"}
    assert all(chunks[-1].finish_reason == "length" for _, chunks in results)


async def _prefill_stats(cluster, name: str) -> common_pb2.InstanceLoad:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.ports[name]}") as ch:
        reply = await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=5)
    return reply.load


async def test_prefix_in_prefill_cache_computes_only_new_blocks(cluster):
    base = random_prompts([48], seed=41)[0]
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        first_ids, first = await _generate(stub, _request(base + [7, 8]))
        await asyncio.sleep(1.0)  # let the KV events reach the conductor's index
        prefills = ("p1", "p2")
        before = {n: await _prefill_stats(cluster, n) for n in prefills}
        tail = random_prompts([10], seed=42)[0]
        ids, chunks = await _generate(stub, _request(base + tail))
        after = {n: await _prefill_stats(cluster, n) for n in prefills}
    # Algorithm 1 sends it to the holder, or (when the holder's measured step times make it look slower,
    # as under a loaded machine) to the other prefill, which pulls the prefix: either way the prefix is
    # not computed again, only the 10 new tokens, on the instance that served it
    assert chunks[0].num_cached_tokens == 48  # 12 full blocks of 4
    computed = {n: after[n].prefill_tokens_computed - before[n].prefill_tokens_computed for n in prefills}
    assert computed[chunks[0].prefill_instance] == 10 and sum(computed.values()) == 10, (first[0].prefill_instance,
                                                                                          chunks[0].prefill_instance,
                                                                                          computed)
    cold = Engine.from_pretrained(cluster.model, block_size=4, kv_cache_bytes=8 << 20)
    assert ids == cold.generate([base + tail], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("req, words", [
    (conductor_pb2.GenerateRequest(prompt=""), "empty"),
    (conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[])), "empty"),
    (conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[5] * 600)), "context"),
    (conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[5, 99999])), "vocabulary"),
    (_request([5, 6], max_tokens=0), "max_tokens"),
    (_request([5, 6], temperature=-1.0), "temperature"),
    (conductor_pb2.GenerateRequest(), "prompt"),
])
async def test_bad_requests_get_invalid_argument(cluster, req, words):
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(stub, req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in err.value.details()
        # and the cluster keeps serving
        ids, _ = await _generate(stub, _request([5, 6, 7]))
        assert len(ids) == 10


async def test_unknown_instance_and_garbage_on_transfer_port(cluster):
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name="nope", drain=True), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
        # garbage bytes to every engine's data-plane port: the connection is dropped, service goes on
        status = await stub.Status(conductor_pb2.StatusRequest(), timeout=5)
        assert len(status.instances) == 4
        for name in ENGINES:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.ports[name]}") as ech:
                stats = await engine_pb2_grpc.EngineStub(ech).Stats(engine_pb2.StatsRequest(), timeout=5)
                assert stats.name == name
        for line in cluster.log("d1").splitlines():
            if "transfer on" in line:
                host, port = line.split("transfer on ")[1].split(",")[0].rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(b"\xde\xad\xbe\xef" * 64)
                    s.settimeout(5)
                    try:
                        assert s.recv(1024) == b""  # closed on us...
                    except ConnectionResetError:
                        pass  # ...or reset: either way the peer dropped it
        for _ in range(4):
            ids, _ = await _generate(stub, _request([9, 8, 7, 6]))
            assert len(ids) == 10


async def test_drain_and_undrain_through_the_conductor(cluster):
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p1", drain=True), timeout=5)
        try:
            for _ in range(4):
                _, chunks = await _generate(stub, _request(random_prompts([6], seed=43)[0]))
                assert chunks[0].prefill_instance == "p2"
        finally:
            await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p1", drain=False), timeout=5)


async def test_a_heartbeat_composed_before_an_undrain_does_not_undo_it(cluster):
    """A heartbeat the engine composed while drained can reach the conductor after the undrain's answer; it
    carries the engine's count of drain calls then (drain_seq), older than the undrain's, so its "draining"
    is not taken (before: the instance showed draining, and got no new work, until its next heartbeat)."""
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p1", drain=True), timeout=5)
        await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p1", drain=False), timeout=5)

        async def p1():
            status = await stub.Status(conductor_pb2.StatusRequest(), timeout=5)
            return next(i for i in status.instances if i.name == "p1")

        before = await p1()
        assert before.state == common_pb2.INSTANCE_STATE_SERVING
        stale = conductor_pb2.HeartbeatRequest(name="p1", load=before.load, drain_seq=0,
                                               state=common_pb2.INSTANCE_STATE_DRAINING)
        assert (await stub.Heartbeat(stale, timeout=5)).known
        assert (await p1()).state == common_pb2.INSTANCE_STATE_SERVING


def test_engines_export_prometheus_metrics(cluster):
    for name in ENGINES:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port(name)}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "mooncaked_transfer" in text and "mooncaked_store" in text, name
        assert "mooncaked_conductor_" not in text and "mooncaked_store_is_leader" not in text, name  # others' series
