"""Failures in a live cluster: no client ever hangs, and work moves to the instances still alive."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)


def _cluster(folder, tmp_path, *decode_args: str):
    c = Cluster(folder, tmp_path)
    try:
        c.start("conductor", "conductor")
        for name in ("p1", "p2", "d1", "d2"):
            c.start(name, *(("prefill",) if name.startswith("p") else ("decode", *decode_args)))
        c.wait_serving(["p1", "p2", "d1", "d2"])
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    yield from _cluster(folder, tmp_path)


@pytest.fixture
def long_drain_cluster(tiny_model_factory, tmp_path):
    """Decodes that drain for up to 60 s: a stream of 300 tokens outlasted the cluster's 5 s on a loaded
    2-core CI machine (stop() still kills a process after 15 s)."""
    _, folder = tiny_model_factory("llama")
    yield from _cluster(folder, tmp_path, "--drain-timeout-s", "60")


def _request(ids, max_tokens):
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_killing_decode_mid_stream_ends_the_stream_with_unavailable(cluster):
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        call = stub.Generate(_request([5, 6, 7, 8, 9], 400), timeout=120)
        first = await call.read()
        decode = first.decode_instance
        cluster.kill(decode)
        killed = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                chunk = await call.read()
                assert chunk is not grpc.aio.EOF, "the stream ended normally although its decode died"
                assert not chunk.finish_reason
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed < 5
        # the other decode instance takes new work
        chunks = [c async for c in stub.Generate(_request([1, 2, 3], 5), timeout=30)]
        assert chunks[0].decode_instance != decode and sum(len(c.token_ids) for c in chunks) == 5


async def test_killing_prefill_before_first_token_retries_on_another(cluster, tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    prompt = random_prompts([30], seed=50)[0]
    want = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        # make p1 the only choice, freeze it so the prefill is in flight there, then kill it
        await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p2", drain=True), timeout=5)
        cluster.kill("p1", signal.SIGSTOP)
        task = asyncio.ensure_future(_collect(stub, _request(prompt, 8)))
        await asyncio.sleep(0.5)
        assert not task.done()
        await stub.SetDrain(conductor_pb2.SetDrainRequest(name="p2", drain=False), timeout=5)
        cluster.kill("p1", signal.SIGKILL)
        chunks = await asyncio.wait_for(task, 30)
    assert chunks[0].prefill_instance == "p2"
    assert [t for c in chunks for t in c.token_ids] == want


async def _collect(stub, req):
    return [c async for c in stub.Generate(req, timeout=60)]


async def test_no_instances_means_unavailable_not_a_hang(cluster):
    for name in ("p1", "p2"):
        cluster.kill(name)
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _collect(stub, _request([1, 2, 3], 5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 15


async def test_sigterm_drains_and_exits_zero(long_drain_cluster):
    cluster = long_drain_cluster
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        call = stub.Generate(_request([4, 4, 4], 300), timeout=60)
        first = await call.read()
        cluster.kill(first.decode_instance, signal.SIGTERM)  # drains: the running stream finishes
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        assert rest[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in [first, *rest]) == 300
        assert cluster.procs[first.decode_instance].wait(20) == 0
        status = await stub.Status(conductor_pb2.StatusRequest(), timeout=5)
        assert first.decode_instance not in {i.name for i in status.instances}  # it deregistered


def test_roles_started_in_any_order_warn_only_about_one_that_stays_away(tiny_model_factory, tmp_path):
    """Roles started together (`--role all`, systemd starting every unit) come up in any order. An engine
    whose store master comes up 3 s after it says nothing above DEBUG; one whose conductor is still away
    after `STARTUP_GRACE_S` gets one WARNING, saying for how long, and registers once it starts."""
    from cluster import free_port
    from mooncaked.roles.membership import STARTUP_GRACE_S

    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path)
    store_port, conductor_port = free_port(), free_port()
    c.conductor_port = conductor_port  # the engine's --conductor, before any conductor listens there
    try:
        c.start("d1", "decode", "--store", f"127.0.0.1:{store_port}", "--join-timeout-s", "120", wait=False)
        started = time.monotonic()
        time.sleep(3)
        c.start("store", "store", "--listen", f"127.0.0.1:{store_port}")
        c.printed("d1", "joined the KV pool", 60)
        assert " WARNING " not in c.log("d1"), c.log("d1")  # the store came late, within the grace: no warning
        line = c.printed("d1", ".*not reachable yet.*", 60).group(0)
        assert time.monotonic() - started >= STARTUP_GRACE_S
        assert " WARNING " in line and "conductor" in line and re.search(r"for \d+s", line), line
        c.start_conductor("conductor", port=conductor_port)
        c.printed("d1", "gRPC on", 60)
        c.wait_serving(["d1"])
        warnings = [ln for ln in c.log("d1").splitlines() if " WARNING " in ln]
        assert len(warnings) == 1, warnings
    finally:
        c.stop()
