"""CPP prefill groups as real processes: stages started with --pipeline-group/--pipeline-stage, one
conductor routing to a group only while all its stages serve, mooncakectl showing the groups, and
kill -9 of a stage during a long prompt: that request is retried on the other group (or fails
cleanly) within 5 s, and the next request is served by the complete group. Tokens equal one whole
engine's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, SamplingParams
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)


def _generate(conductor: str, prompt: list[int], n: int) -> tuple[list[int], str]:
    with grpc.insecure_channel(conductor) as ch:
        req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=prompt),
                                            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True))
        chunks = list(conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=60))
    return [t for c in chunks for t in c.token_ids], chunks[0].prefill_instance


def test_groups_serve_show_in_status_and_survive_a_killed_stage(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    ref = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20)
    c = Cluster(folder, tmp_path)
    try:
        c.start("conductor", "conductor")
        c.start("d1", "decode")
        # one token per chunk: a 400-token prompt is 400 hand-offs per stage, long enough to kill a stage in
        for g in ("a", "b"):
            for k in range(2):
                c.start(f"{g}-s{k}", "prefill", "--pipeline-group", g, "--pipeline-stage", f"{k}/2",
                        "--cpp-chunk-tokens", "1")
        c.wait_serving(["d1", "a-s0", "a-s1", "b-s0", "b-s1"])
        out = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", c.conductor, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        groups = json.loads(out.stdout)["groups"]
        assert groups == {"a": {"stages": ["a-s0", "a-s1"], "complete": True},
                          "b": {"stages": ["b-s0", "b-s1"], "complete": True}}

        short = random_prompts([9], seed=5)[0]
        tokens, head = _generate(c.conductor, short, 5)
        assert tokens == ref.generate(short, SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        assert head in ("a-s0", "b-s0")

        long_ = random_prompts([400], seed=6)[0]
        want = ref.generate(long_, SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        result: dict = {}

        def run() -> None:
            try:
                result["tokens"], result["head"] = _generate(c.conductor, long_, 5)
            except grpc.RpcError as e:
                result["error"] = e
            result["at"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        # kill the later stage of whichever group took the prompt, while its stages hand chunks along
        deadline = time.monotonic() + 30
        victim = None
        while victim is None and time.monotonic() < deadline and t.is_alive():
            for i in c.status().instances:
                if i.name.endswith("-s0") and i.load.queued_prefill_tokens:
                    victim = i.name.removesuffix("-s0") + "-s1"
            time.sleep(0.02)
        assert victim is not None, "the long prompt finished before a stage could be killed"
        c.kill(victim)
        killed = time.monotonic()
        t.join(60)
        assert "at" in result and result["at"] - killed < 5.0, "the request neither retried nor failed within 5 s"
        if "error" in result:  # failing cleanly is allowed: a status naming what happened
            assert result["error"].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        else:
            assert result["tokens"] == want
            assert result["head"] != victim.removesuffix("-s1") + "-s0"  # retried on the other group
        # the next request goes to the complete group, and status shows the broken one as such
        survivor = "b" if victim.startswith("a") else "a"
        tokens, head = _generate(c.conductor, short, 5)
        assert tokens == ref.generate(short, SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        assert head == f"{survivor}-s0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", c.conductor, "status"],
                                 capture_output=True, text=True, timeout=30)
            if f"group      {victim[0]}: INCOMPLETE" in out.stdout:
                break
            time.sleep(0.3)
        assert f"group      {victim[0]}: INCOMPLETE" in out.stdout, out.stdout
    finally:
        c.stop()
        ref.close()
