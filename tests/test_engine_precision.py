"""The engine's precision (engine/precision.py, engine/bf16_weights.py): auto picks bf16 weights only on a
CPU with native bf16, the bf16 path stays close to fp32, and --dtype float32 stays the exact path."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from mooncaked.config import add_config_args, load_config
from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.bf16_weights import Bf16Linear, CandidateHead
from mooncaked.engine.config import ConfigError
from mooncaked.engine.precision import cpu_flags, native_bf16, pick_precision
from mooncaked.engine.quant import check_quantize, greedy_agreement
from tiny_models import random_prompts

CPU = torch.device("cpu")
# /proc/cpuinfo flags of real machines (abridged)
ZEN4 = "fpu vme avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8"
ICE_LAKE = "fpu avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni"  # AVX-512 without bf16
HASWELL = "fpu sse4_2 avx avx2 fma"


def test_native_bf16_is_read_from_the_flags(tmp_path):
    assert native_bf16(ZEN4.split()) and native_bf16(SAPPHIRE_RAPIDS.split())
    assert not native_bf16(ICE_LAKE.split()) and not native_bf16(HASWELL.split()) and not native_bf16([])
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {ZEN4}\n\nprocessor\t: 1\nflags\t\t: {ZEN4}\n")
    assert cpu_flags(info) == frozenset(ZEN4.split())
    assert cpu_flags(tmp_path / "missing") == frozenset()  # not Linux: no native bf16 assumed


@pytest.mark.parametrize(("flags", "requested", "quantize", "want"), [
    (ZEN4, None, "none", (torch.float32, "bf16")),
    (SAPPHIRE_RAPIDS, None, "none", (torch.float32, "bf16")),
    (ICE_LAKE, None, "none", (torch.float32, "none")),
    (HASWELL, None, "none", (torch.float32, "none")),
    (ZEN4, torch.float32, "none", (torch.float32, "none")),  # --dtype float32: exact, whatever the CPU
    (ZEN4, torch.bfloat16, "none", (torch.bfloat16, "none")),
    (ZEN4, None, "int8", (torch.float32, "int8")),
    (HASWELL, None, "bf16", (torch.float32, "bf16")),  # asked for: honoured (slow without native bf16)
])
def test_pick_precision(flags, requested, quantize, want):
    p = pick_precision(requested, quantize, CPU, torch.bfloat16, flags.split())
    assert (p.dtype, p.weights) == want
    assert p.exact == (want == (torch.float32, "none"))


def test_auto_on_a_gpu_keeps_the_models_dtype():
    p = pick_precision(None, "none", torch.device("cuda"), torch.bfloat16, ZEN4.split())
    assert (p.dtype, p.weights) == (torch.bfloat16, "none")


def test_auto_engine_follows_this_cpu(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    engine = Engine.from_pretrained(folder, dtype="auto", block_size=4, kv_cache_bytes=4 << 20)  # as the CLI passes it
    want = "bf16" if native_bf16(cpu_flags()) else "none"
    assert (engine.precision.dtype, engine.precision.weights) == (torch.float32, want)
    has_bf16 = any(isinstance(m, Bf16Linear) for m in engine.runner.model.modules())
    assert has_bf16 == (want == "bf16")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, kept in fp32
def test_bf16_weights_stay_close_to_fp32(arch, tiny_model_factory):
    _, folder = tiny_model_factory(arch)
    kw = dict(dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    ref, bf16 = Engine.from_pretrained(folder, **kw), Engine.from_pretrained(folder, quantize="bf16", **kw)
    assert isinstance(bf16.runner.model.lm_head, CandidateHead)
    for prompt in random_prompts([5, 40], seed=70):
        want, got = ref.score(prompt), bf16.score(prompt)
        # bf16 rounds each GEMM's inputs to 2^-9 relative; the tiny model is 2 layers (9 GEMMs) deep
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 0.03, (arch, len(prompt), err)
        assert err > 0  # it is a different path
    prompts = random_prompts([3, 9, 17, 40], seed=71)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    same = greedy_agreement([o.token_ids for o in ref.generate(prompts, params)],
                            [o.token_ids for o in bf16.generate(prompts, params)])
    assert same >= 0.9, same


def test_candidate_head_is_fp32_where_it_counts():
    torch.manual_seed(72)
    linear = nn.Linear(64, 500, bias=False)
    head = CandidateHead(linear, k=8)
    h = torch.randn(6, 64)
    want = linear(h)
    with torch.no_grad():
        got = head(h)
    top = got.topk(8, dim=-1).indices
    # the candidates are exact fp32 logits; the rest bf16's
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() > 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="bias"):
        CandidateHead(nn.Linear(4, 8))


def test_dtype_and_quantize_settings():
    assert _settings(["--dtype", "auto"]).engine_config().dtype is None
    assert _settings([]).engine_config().dtype is None
    assert _settings(["--dtype", "float32"]).engine_config().dtype == torch.float32
    assert _settings(["--quantize", "bf16"]).engine_config().quantize == "bf16"
    with pytest.raises(ConfigError, match="quantize=bf16 is a CPU path"):
        check_quantize("bf16", "cuda")


def _settings(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return load_config(parser.parse_args(["--role", "decode", *argv]), {})
