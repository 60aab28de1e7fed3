"""tools/bench_engine_cuda.py: the roofline's pieces on any machine, the GPU bench itself where CUDA is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_engine_cuda import peak_gbps, weight_bytes  # noqa: E402

from mooncaked.engine import Engine  # noqa: E402

NO_CUDA = None if torch.cuda.is_available() else "no CUDA GPU on this machine (the GPU bench runs where one is lent)"


def test_peak_bandwidth_by_name():
    assert peak_gbps("NVIDIA H200", None) == 4800
    assert peak_gbps("NVIDIA H100 80GB HBM3", None) == 3350
    assert peak_gbps("NVIDIA H100 PCIe", None) == 2000
    assert peak_gbps("NVIDIA A100-SXM4-80GB", None) == 2039
    assert peak_gbps("Some Future GPU", None) is None
    assert peak_gbps("Some Future GPU", 1234.0) == 1234.0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weight_bytes_count_what_a_decode_step_reads(arch, tiny_model_factory):
    _, folder = tiny_model_factory(arch)
    model = Engine.from_pretrained(folder, dtype="float32", block_size=4, kv_cache_bytes=4 << 20).runner.model
    cfg = model.cfg
    params = {id(p): p for p in model.parameters()}
    everything = sum(p.numel() * 4 for p in params.values())
    embedding = cfg.vocab_size * cfg.hidden_size * 4
    tied = model.lm_head.weight is model.embed_tokens.weight
    # an untied embedding is read a row per token, not whole; a tied one is the head, read whole
    assert weight_bytes(model) == (everything if tied else everything - embedding)


@pytest.mark.skipif(NO_CUDA is not None, reason=f"GPU bench not runnable here: {NO_CUDA}")
def test_gpu_bench_reports_tokens_and_roofline(tiny_model_factory):
    _, folder = tiny_model_factory("llama", torch.bfloat16)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_engine.py"), "--device", "cuda", "--json",
                          "--model", str(folder), "--prompt-len", "32", "--new-tokens", "8", "--batches", "1", "16",
                          "64"], capture_output=True, text=True, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in res["runs"]] == [1, 16, 64]
    for r in res["runs"]:
        assert r["tok_s"] > 0 and r["decode_steps"] > 0
        if res["peak_gbps"]:
            assert 0 < r["roofline_fraction"] <= 1.0, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the bench runs (the test above)")
def test_the_gpu_bench_says_why_it_cannot_run_without_cuda():
    """On a machine without CUDA, `--device cuda` names what is missing: no traceback."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_engine.py"), "--device", "cuda", "--quick",
                        "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "without CUDA" in r.stderr or "no CUDA" in r.stderr, r.stderr
