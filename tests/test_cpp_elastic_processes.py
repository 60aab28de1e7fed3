"""Elastic CPP end to end with real processes: a conductor with ``--policy mooncaked`` and three
whole-model prefill instances lends the two idle ones to a long prompt. The tokens equal one whole
engine's, every prefill instance computed the prompt (its share of the layers), and the lead alone
holds the prompt whole afterwards: a follow-up sharing its prefix is served from its cache (on the
lead, or pulled from it: the helpers publish none of their partial blocks)."""

from __future__ import annotations

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc
from tiny_models import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(300)

STEP = 16  # the engines' step budget: a 300-token prompt is 19 chunks, which a pipeline overlaps


def _generate(conductor: str, prompt: list[int], n: int) -> tuple[list[int], conductor_pb2.GenerateChunk]:
    with grpc.insecure_channel(conductor) as ch:
        req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=prompt),
                                            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True))
        chunks = list(conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks[0]


def _computed(c: Cluster, name: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[name]}") as ch:
        stats = engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=10)
    return stats.load.prefill_tokens_computed


def test_the_elastic_policy_lends_idle_instances_to_a_long_prompt(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "model", num_layers=3)[1]
    ref = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
    c = Cluster(folder, tmp_path)
    try:
        c.start("conductor", "conductor", "--policy", "mooncaked", "--log-level", "DEBUG")
        names = ["p1", "p2", "p3"]
        for name in names:
            c.start(name, "prefill", "--max-num-batched-tokens", str(STEP))
        c.start("d1", "decode")
        c.wait_serving([*names, "d1"])
        prompt, = random_prompts([300], seed=21)
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        got, first = _generate(c.conductor, prompt, 6)
        assert got == ref.generate(prompt, params)[0].token_ids
        computed = {name: _computed(c, name) for name in names}
        # the lead and its helpers each computed their layers of every prompt token
        assert sorted(computed.values()) == [300, 300, 300], computed
        lead = first.prefill_instance
        assert f"-> {lead} with helpers " in c.log("conductor")  # the route's DEBUG line names them
        # the lead holds the prompt whole (its helpers' layers arrived in its blocks): a follow-up sharing
        # 296 tokens is a prefix hit, on the lead or pulled from it, with one engine's tokens
        again = prompt[:296] + [5, 6, 7, 8, 9]
        got, first = _generate(c.conductor, again, 6)
        assert got == ref.generate(again, params)[0].token_ids
        assert first.num_cached_tokens == 296
        assert sum(_computed(c, name) for name in names) - 900 in (5, 15)  # alone, or 3 stages of the rest
    finally:
        ref.close()
        c.stop()
