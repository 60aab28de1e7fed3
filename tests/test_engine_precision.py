"""The engine's precision (engine/precision.py, engine/bf16_weights.py): auto picks bf16 weights only on a
CPU with native bf16, fp16 weights on one with AVX2 only, refuses bf16 weights clearly where oneDNN cannot
run them; the bf16 path stays close to fp32, and --dtype float32 stays the exact path."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.config import add_config_args, load_config
from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.bf16_weights import Bf16Linear, CandidateHead
from mooncaked.engine.config import ConfigError
from mooncaked.engine.precision import (Precision, check_supported, cpu_flags, fp16_gemm, native_bf16,
                                        pick_precision, unsupported_reason)
from mooncaked.engine.quant import Fp16Linear, QuantLinear, check_quantize, greedy_agreement
from tiny_models import random_prompts

CPU = torch.device("cpu")
# None where this CPU runs oneDNN's bf16 GEMM, else why not (the tests of the bf16 path skip with it)
NO_BF16_HERE = unsupported_reason("bf16", CPU, cpu_flags())
NO_FP16_HERE = None if fp16_gemm(cpu_flags()) else "fbgemm's fp16 GEMM needs an x86 CPU with AVX2, FMA and F16C"
# /proc/cpuinfo flags of real machines (abridged)
ZEN4 = "fpu vme avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8"
ICE_LAKE = "fpu avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni"  # AVX-512 without bf16
HASWELL = "fpu sse4_2 avx avx2 fma f16c"
SANDY_BRIDGE = "fpu sse4_2 avx"
ZEN3 = "fpu avx avx2 fma f16c vaes vpclmulqdq"  # this session's machine: AVX2 only
SIERRA_FOREST = "fpu avx2 avx_vnni avx_ne_convert"  # no AVX-512, but oneDNN's bf16 path runs


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
    (ICE_LAKE, None, "none", (torch.float32, "fp16")),  # AVX2+FMA+F16C, no native bf16: fp16 weights
    (HASWELL, None, "none", (torch.float32, "fp16")),
    (ZEN3, None, "none", (torch.float32, "fp16")),
    (SANDY_BRIDGE, None, "none", (torch.float32, "none")),  # no AVX2: fp32
    (ZEN4, torch.float32, "none", (torch.float32, "none")),  # --dtype float32: exact, whatever the CPU
    (ZEN4, torch.bfloat16, "none", (torch.bfloat16, "none")),
    (ZEN4, None, "int8", (torch.float32, "int8")),
    (HASWELL, None, "bf16", (torch.float32, "bf16")),  # asked for: honoured (slow without native bf16)
])
def test_pick_precision(flags, requested, quantize, want):
    p = pick_precision(requested, quantize, CPU, torch.bfloat16, flags.split())
    assert (p.dtype, p.weights) == want
    assert p.exact == (want == (torch.float32, "none"))


@pytest.mark.parametrize(("flags", "weights", "refused"), [
    (HASWELL, "bf16", True), (ZEN3, "bf16", True),
    (ZEN4, "bf16", False), (ICE_LAKE, "bf16", False), (SIERRA_FOREST, "bf16", False),
    ("", "bf16", False),  # flags unknown: torch decides (bf16_weights.py turns its refusal into a ConfigError)
    (HASWELL, "int8", False), (HASWELL, "int4", False), (HASWELL, "none", False),
])
def test_cpus_that_cannot_run_a_precision_are_refused_by_name(flags, weights, refused):
    reason = unsupported_reason(weights, CPU, flags.split())
    assert (reason is not None) == refused
    precision = Precision(torch.float32, weights, "requested")
    if not refused:
        check_supported(precision, CPU, flags.split())
        return
    assert "avx512bw+avx512dq+avx512vl" in reason and "avx_ne_convert" in reason
    with pytest.raises(ConfigError, match="need a CPU with avx_ne_convert or avx512bw"):
        check_supported(precision, CPU, flags.split())
    assert unsupported_reason(weights, torch.device("cuda"), flags.split()) is None


def test_bf16_weights_on_this_cpu_run_or_are_refused_clearly(tiny_model_factory):
    """The real engine start: where oneDNN cannot pack bf16, a ConfigError before any weight is read."""
    _, folder = tiny_model_factory("llama")
    kw = dict(dtype="float32", quantize="bf16", block_size=4, kv_cache_bytes=4 << 20)
    if NO_BF16_HERE is None:
        assert isinstance(Engine.from_pretrained(folder, **kw).runner.model.lm_head, CandidateHead)
    else:
        with pytest.raises(ConfigError, match="bf16 weights .* need a CPU with"):
            Engine.from_pretrained(folder, **kw)


def test_auto_on_a_gpu_keeps_the_models_dtype():
    p = pick_precision(None, "none", torch.device("cuda"), torch.bfloat16, ZEN4.split())
    assert (p.dtype, p.weights) == (torch.bfloat16, "none")


def test_auto_engine_follows_this_cpu(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    engine = Engine.from_pretrained(folder, dtype="auto", block_size=4, kv_cache_bytes=4 << 20)  # as the CLI passes it
    want = "bf16" if native_bf16(cpu_flags()) else "fp16" if fp16_gemm(cpu_flags()) else "none"
    assert (engine.precision.dtype, engine.precision.weights) == (torch.float32, want)
    has_bf16 = any(isinstance(m, Bf16Linear) for m in engine.runner.model.modules())
    assert has_bf16 == (want == "bf16")
    assert any(isinstance(m, Fp16Linear) for m in engine.runner.model.modules()) == (want == "fp16")


@pytest.mark.skipif(NO_BF16_HERE is not None, reason=str(NO_BF16_HERE))
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


@pytest.mark.parametrize("cheap", ["bf16", "int8", "int4", "fp16"])
def test_candidate_head_is_fp32_where_it_counts(cheap):
    if cheap == "bf16" and NO_BF16_HERE is not None:
        pytest.skip(NO_BF16_HERE)
    torch.manual_seed(72)
    linear = nn.Linear(64, 512, bias=False)  # int4 packs rows in 16s
    layer = None if cheap == "bf16" else Fp16Linear(linear) if cheap == "fp16" else QuantLinear(linear, cheap)
    head = CandidateHead(linear, k=8, cheap=layer)
    h = torch.randn(6, 64)
    want = linear(h)
    with torch.no_grad():
        got = head(h)
        top = head.cheap(h).float().topk(8, dim=-1).indices  # the candidates: the cheap head's best
    # the candidates are exact fp32 logits; the rest the cheap head's
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() > 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="bias"):
        CandidateHead(nn.Linear(4, 8))


@pytest.mark.skipif(NO_FP16_HERE is not None, reason=str(NO_FP16_HERE))
def test_fp16_prefill_runs_an_fp32_gemm_over_the_same_fp16_weights():
    """Prefill-sized calls (more rows than SMALL_M) take the fp32 GEMM, decode-sized ones fbgemm's fp16
    kernel, and both multiply by the fp16-rounded weights: a prompt's tokens must not depend on its chunks."""
    torch.manual_seed(73)
    linear = nn.Linear(96, 200)
    kept, packed_only = Fp16Linear(linear, dense=True), Fp16Linear(linear)
    grid = linear.weight.detach().half().float()
    many, few = torch.randn(100, 96), torch.randn(8, 96)
    with torch.no_grad():
        assert torch.equal(kept(many), F.linear(many, grid, linear.bias))  # the fp32 GEMM ran
        assert torch.equal(kept(few), packed_only(few))  # fbgemm ran
        # the same weights either way: only the summation order differs
        torch.testing.assert_close(kept(many), packed_only(many), rtol=1e-5, atol=1e-5)
        assert (kept(many) - linear(many)).abs().max() > 1e-5  # and they are the fp16 grid, not fp32's
    assert kept.dense.dtype == torch.float32 and packed_only.dense is None


@pytest.mark.skipif(NO_FP16_HERE is not None, reason=str(NO_FP16_HERE))
def test_fp16_engine_gives_a_cached_prompt_the_tokens_of_its_cold_run(tiny_model_factory):
    """Cold, the prompt is one prefill of 100 rows (fp32 GEMM); warm, only the rows past its cached
    blocks (fbgemm): the same tokens."""
    _, folder = tiny_model_factory("llama")
    engine = Engine.from_pretrained(folder, dtype="float32", quantize="fp16", block_size=16, kv_cache_bytes=4 << 20)
    assert any(isinstance(m, Fp16Linear) and m.dense is not None for m in engine.runner.model.modules())
    prompt = random_prompts([100], seed=74)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = engine.generate(prompt, params)[0]
    warm = engine.generate(prompt, params)[0]
    assert warm.num_cached_tokens >= 96
    assert warm.token_ids == cold.token_ids


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
