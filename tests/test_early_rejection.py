"""Prediction-based early rejection in a live cluster: refused before any prefill is spent."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from cluster import Cluster
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.timeout(300)


async def test_unmeetable_tbt_slo_rejects_with_resource_exhausted_and_429(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path)
    try:
        # a TBT SLO no decode instance can meet: every request must be refused up front
        c.start("conductor", "conductor", "--http", "127.0.0.1:0", "--tbt-slo-s", "1e-9")
        http = f"127.0.0.1:{c.http_port('conductor')}"
        c.start("p1", "prefill")
        c.start("d1", "decode")
        c.wait_serving(["p1", "d1"])
        req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[5, 6, 7, 8]),
                                            sampling=common_pb2.SamplingParams(max_tokens=4))
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [x async for x in conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=30)]
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tbt" in err.value.details().lower()
        async with aiohttp.ClientSession(f"http://{http}") as s:
            async with s.post("/v1/completions", json={"model": str(folder), "prompt": "t5 t6 t7", "max_tokens": 4}) as r:
                assert r.status == 429
                body = await r.json()
                assert "tbt" in body["error"]["message"].lower()
            async with s.get("/metrics") as r:
                text = await r.text()
        assert 'reason="tbt_slo"' in text
        # nothing was computed on the prefill instance
        async with grpc.aio.insecure_channel(f"127.0.0.1:{c.ports['p1']}") as ch:
            load = (await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=5)).load
        assert load.prefill_tokens_computed == 0
    finally:
        c.stop()
