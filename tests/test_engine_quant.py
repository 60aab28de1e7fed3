"""Weight-only quantized linear layers (engine/quant.py): they run, stay close to fp32, and say no clearly."""

from __future__ import annotations

import pytest
import torch

import argparse

from mooncaked.config import ConfigError as SettingsError
from mooncaked.config import add_config_args, load_config
from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.config import ConfigError
from mooncaked.engine.bf16_weights import CandidateHead
from mooncaked.engine.quant import Fp16Linear, QuantLinear, greedy_agreement, perplexity, quantize_int4, quantize_int8
from tiny_models import random_prompts

# Bounds on max|logit error| / max|logit| against the fp32 engine (tiny llama: 2 layers, 5 GEMMs deep).
# int8: per-channel rounding is at most 1/254 of a row's largest weight and bf16 activations add 2^-9
# relative per GEMM; summed over 9 GEMMs on the path that stays under ~4 %, so 0.05 leaves room.
# int4 in groups of 32: a weight is off by up to 1/30 of its group's range, ~8x int8's step, and these
# random Gaussian weights (unlike the default model's Q4_1 ones) are not on a 16-level grid: 0.5, a
# check that the int4 kernel and its packing are wired right rather than a quality claim.
# fp16: weights rounded to 2^-11 relative, nothing else (fp32 activations and outputs): 0.005.
BOUND = {"int8": 0.05, "int4": 0.5, "fp16": 0.005}


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", "float32")  # fp32 activations; the reference (quantize none) is the exact path
    return Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=4 << 20, **kw)


@pytest.mark.parametrize("mode", ["int8", "int4", "fp16"])
def test_quantized_logits_close_to_fp32(mode, tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    ref, quant = _engine(folder), _engine(folder, quantize=mode)
    layer = Fp16Linear if mode == "fp16" else QuantLinear
    assert any(isinstance(m, layer) for m in quant.runner.model.modules())
    assert isinstance(quant.runner.model.lm_head, CandidateHead)
    # 5 tokens: the quantized kernel; 90: above SMALL_M, the dequantize + fp32 GEMM path
    for prompt in random_prompts([5, 90], seed=7):
        want, got = ref.score(prompt), quant.score(prompt)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < BOUND[mode], (mode, len(prompt), err)


@pytest.mark.parametrize("mode", ["int8", "fp16"])
def test_int8_greedy_agrees_with_fp32_on_tiny_model(mode, tiny_model_factory):
    _, folder = tiny_model_factory("qwen2")  # biases on q/k/v: the quantized layer keeps them
    prompts = random_prompts([3, 9, 17, 40], seed=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in _engine(folder).generate(prompts, params)]
    got = [o.token_ids for o in _engine(folder, quantize=mode).generate(prompts, params)]
    # the tiny models' logits are scaled far apart (tiny_models.py), so int8 flips few choices; one
    # flip changes the rest of that sequence's context, so the position-wise share is the fair one
    assert greedy_agreement(want, got) >= 0.85


def test_quantizers_round_trip():
    w = torch.randn(8, 64)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()
    q4, scale, zero = quantize_int4(w)
    assert int(q4.max()) <= 15
    back = ((q4.float().view(8, 2, 32) - 8) * scale[..., None] + zero[..., None]).view(8, 64)
    assert ((back - w).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-5).all()


def test_quality_measures():
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == 0.75
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]], prefix=True) == 0.25
    # uniform logits over V tokens: perplexity V; a certain, right prediction: 1
    assert perplexity(torch.zeros(5, 10), [1, 2, 3, 4, 5]) == pytest.approx(10.0)
    sure = torch.full((3, 10), -1e4)
    sure[0, 7] = sure[1, 8] = 0
    assert perplexity(sure, [0, 7, 8]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        perplexity(torch.zeros(1, 10), [1])


def test_bad_quantize_values_are_clear(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    with pytest.raises(ConfigError, match="quantize must be one of none, bf16, int8, int4"):
        _engine(folder, quantize="int3")
    with pytest.raises(SettingsError, match="quantize"):
        _settings(["--quantize", "fp8"])
    assert _settings(["--quantize", "int8"]).engine_config().quantize == "int8"
    assert _settings([], {"MOONCAKED_QUANTIZE": "int4"}).engine_config().quantize == "int4"
    assert _settings([]).engine_config().quantize == "none"


def _settings(argv: list[str], environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return load_config(parser.parse_args(["--role", "decode", *argv]), environ or {})


def test_int4_keeps_layers_it_cannot_pack():
    """int4 packs inputs in groups of 32 and outputs in 16s: other shapes stay fp32, not a crash."""
    from mooncaked.engine.quant import quantize_model

    model = torch.nn.ModuleDict({"odd_out": torch.nn.Linear(64, 500, bias=False),
                                 "odd_in": torch.nn.Linear(48, 64, bias=False),
                                 "fits": torch.nn.Linear(64, 64, bias=False)})
    assert quantize_model(model, "int4") == 1
    assert isinstance(model["fits"], QuantLinear)
    assert type(model["odd_out"]) is torch.nn.Linear and type(model["odd_in"]) is torch.nn.Linear


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_prefill_rows_use_the_kept_fp32_weights(mode):
    """Above SMALL_M rows a layer with ``dense`` is the fp32 GEMM itself; without, its dequantized weights."""
    torch.manual_seed(9)
    linear = torch.nn.Linear(64, 32, bias=True)
    x = torch.randn(90, 64)
    with torch.no_grad():
        want = linear(x)
        kept, own = QuantLinear(linear, mode, dense=True), QuantLinear(linear, mode, dense=False)
        assert torch.equal(kept(x), want)
        err = float((own(x) - want).abs().max() / want.abs().max())
        assert 0 < err < BOUND[mode]
        # few rows: both run the quantized kernel on the same quantized weights
        torch.testing.assert_close(kept(x[:3]), own(x[:3]))
