"""The plan travels on the wire: with real processes (conductor, prefills p1 and p2, decode d1, no
store master), a request the policy routes to p2 while p1 holds its prefix is planned as "pull
from peer p1"; p2 reads the blocks out of p1's KV cache (p1's Lend over gRPC, the bytes over the
transfer engine), computes only the rest, and the tokens equal a cold single-engine run.
test_plan_peer_pull.py checks the same in-process, with the failure cases.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
PROMPT = [11, 23, 35, 47, 59, 61, 73, 85, 97, 9, 18, 27, 36, 4]  # 14 tokens: three full blocks and two more
FULL = len(PROMPT) // BLOCK


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path_factory.mktemp("logs"), extra_env={"MOONCAKED_HEARTBEAT_INTERVAL_S": "0.2"})
    try:
        c.start("conductor", "conductor")
        c.http = f"http://127.0.0.1:{c.http_port('conductor')}"
        c.extra_env["MOONCAKED_METRICS"] = "127.0.0.1:0"  # the engines' own /metrics
        for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
            c.start(name, role)
        c.wait_serving(["p1", "p2", "d1"])
        yield c
    finally:
        c.stop()


def _generate(stub, n: int = 6) -> tuple[list[int], list[conductor_pb2.GenerateChunk]]:
    req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=PROMPT),
                                        sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True))
    chunks = list(stub.Generate(req, timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks


def _computed(cluster: Cluster, name: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.ports[name]}") as ch:
        stats = engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=10)
    return stats.load.prefill_tokens_computed


def _metric(cluster: Cluster, name: str, series: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port(name)}/metrics", timeout=10) as r:
        m = re.search(rf"^{re.escape(series)} (\S+)$", r.read().decode(), re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _holders(cluster: Cluster) -> dict:
    body = json.dumps({"model": cluster.model.name, "token_ids": PROMPT, "block_size": BLOCK}).encode()
    req = urllib.request.Request(f"{cluster.http}/query", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["default"]


def test_p2_pulls_the_prefix_from_p1s_kv_cache_over_the_wire(cluster):
    cold = Engine.from_pretrained(cluster.model, block_size=BLOCK, kv_cache_bytes=8 << 20)
    want = cold.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    cold.close()
    with grpc.insecure_channel(cluster.conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)

        def drain(name: str, on: bool) -> None:
            stub.SetDrain(conductor_pb2.SetDrainRequest(name=name, drain=on), timeout=10)

        drain("p2", True)  # p1 computes the prompt first
        tokens, chunks = _generate(stub)
        assert tokens == want and chunks[0].prefill_instance == "p1"
        drain("p2", False)
        # p1's heartbeats bring its KV events to the conductor's prefix index
        deadline = time.monotonic() + 60
        while _holders(cluster).get("p1", {}).get("longest_matched") != FULL * BLOCK:
            assert time.monotonic() < deadline, f"the index never learned p1's blocks: {_holders(cluster)}"
            time.sleep(0.1)
        drain("p1", True)  # p2 is picked; p1 still holds the prefix and lends it
        p1_before, p2_before = _computed(cluster, "p1"), _computed(cluster, "p2")
        peer_before = _metric(cluster, "p2", 'mooncaked_plan_blocks_total{source="peer"}')
        tokens, chunks = _generate(stub)
        drain("p1", False)
    assert tokens == want
    assert chunks[0].prefill_instance == "p2" and chunks[0].num_cached_tokens == FULL * BLOCK
    # p2 computed only the rest; p1 computed nothing: it lent its KV cache (there is no pool at all)
    assert _computed(cluster, "p2") - p2_before == len(PROMPT) - FULL * BLOCK
    assert _computed(cluster, "p1") == p1_before
    assert _metric(cluster, "p2", 'mooncaked_plan_blocks_total{source="peer"}') - peer_before == FULL
    assert _metric(cluster, "p1", "mooncaked_lent_blocks_total") >= FULL
    assert not any(_metric(cluster, "p2", f'mooncaked_plan_deviations_total{{reason="{r}"}}')
                   for r in ("peer_unavailable", "peer_read_failed", "peer_missing", "no_pool"))
