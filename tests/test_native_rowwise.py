"""The native RMSNorm, residual add + RMSNorm and rotary kernels (csrc/rowwise.cpp) against torch's ops, and
an engine that runs them against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.models.rope import apply_rotary
from native_kernels import native_or_skip
from tiny_models import hf_greedy, hf_logits, make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def kernels():
    return native_or_skip()


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_norms_and_rotary_equal_torchs_ops(kernels, rows):
    g = torch.Generator().manual_seed(rows)
    x, r, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    h, n = kernels.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(n, F.rms_norm(x + r, (576,), w, 1e-6), rtol=1e-5, atol=1e-5)
    # q and k heads as a view into the fused qkv output: rows strided, heads contiguous
    qkv = torch.randn(rows, 12 * 64 + 3 * 64, generator=g)
    qk = qkv[:, : 12 * 64].view(rows, 12, 64)
    cos, sin = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(kernels.rotary(qk, cos, sin), apply_rotary(qk, cos[:, None], sin[:, None]),
                               rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused_with_a_reason(kernels):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.rms_norm(torch.randn(2, 24), torch.randn(24), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(torch.randn(2, 32), torch.randn(16), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        kernels.add_rms_norm(torch.randn(2, 32), torch.randn(3, 32), torch.randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.rotary(torch.randn(2, 3, 16), torch.randn(2, 16), torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="cos / sin"):
        kernels.rotary(torch.randn(2, 3, 64), torch.randn(3, 64), torch.randn(2, 64))


def test_an_engine_on_the_native_kernels_matches_transformers(kernels, tmp_path):
    """A tiny llama with head_dim 32, so that the norms, the rotary embedding and the decode attention all
    run natively: its logits and greedy tokens are transformers', as the torch ops' are."""
    hf, folder = make_tiny_model("llama", tmp_path / "llama-h128", hidden_size=128)
    engine = Engine.from_pretrained(folder, dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                                    max_num_batched_tokens=16)
    model = engine.runner.model
    assert model.layers[0].self_attn.native is kernels and engine.runner.backend.decode_kernel is not None
    prompts = random_prompts([3, 9, 17, 40], seed=4)
    for p in prompts:
        torch.testing.assert_close(engine.score(p), hf_logits(hf, p), atol=2e-4, rtol=1e-4)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


def test_silu_mul_from_bf16_is_the_bf16_paths_own_math_bit_for_bit(kernels):
    """bf16(silu(gate) * up) in fp32 from the bf16 gate|up: what the bf16 path computed in four passes."""
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(37, 2 * 256, generator=g) * 4).bfloat16()
    edges = torch.tensor([-100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, float("inf"), float("-inf"),
                          float("nan"), 3.0, -3.0, 0.5, -0.5]).bfloat16()
    gu[0, :16] = edges
    gate, up = gu.float().split(256, dim=-1)
    want = (F.silu(gate) * up).to(torch.bfloat16)
    got = kernels.silu_mul_bf16(gu)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 256)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.silu_mul_bf16(torch.zeros(2, 40).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.silu_mul_bf16(torch.zeros(2, 64))


def test_qkv_rotated_from_bf16_is_the_rotation_of_its_fp32_cast_bit_for_bit(kernels):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(21, (9 + 3 + 3) * 64, generator=g).bfloat16()
    cos, sin = torch.randn(21, 64, generator=g), torch.randn(21, 64, generator=g)
    qk, v = kernels.qkv_rotary_bf16(qkv, cos, sin, 12, 64)
    wide = qkv.float()
    assert torch.equal(qk, kernels.rotary(wide[:, : 12 * 64].view(21, 12, 64), cos, sin))
    assert torch.equal(v, wide[:, 12 * 64 :].view(21, 3, 64))
    with pytest.raises(RuntimeError, match="more heads"):
        kernels.qkv_rotary_bf16(qkv, cos, sin, 15, 64)
    with pytest.raises(RuntimeError, match="cos / sin"):
        kernels.qkv_rotary_bf16(qkv, cos[:3], sin, 12, 64)


def test_the_bf16_paths_mlp_and_qkv_on_the_native_kernels_give_the_same_values_and_tokens(kernels, tmp_path):
    from test_engine_precision import NO_BF16_HERE

    if NO_BF16_HERE is not None:
        pytest.skip(NO_BF16_HERE)
    _, folder = make_tiny_model("llama", tmp_path / "llama-h128", hidden_size=128)
    engine = Engine.from_pretrained(folder, dtype="float32", quantize="bf16", block_size=4, kv_cache_bytes=4 << 20,
                                    enable_prefix_caching=False)
    model = engine.runner.model
    prompts = random_prompts([20, 33, 40, 50], seed=6)  # > 8 rows a call: the bf16 GEMMs, not 4-bit reads
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with torch.no_grad():
        x = torch.randn(24, 128)
        mlp = model.layers[0].mlp
        assert mlp.gate_up_proj.bf16_out(x) is not None  # the fused middle runs for this call
        fused = mlp(x)
        attn = model.layers[0].self_attn
        rope = model.rope.lookup(torch.arange(24), torch.float32)
        qk, v = attn._rotate_bf16(x, rope)  # the fused qkv rotation runs for this call too
        model.use_native(None)
        torch.testing.assert_close(fused, mlp(x), rtol=0, atol=0)
        qkv = attn.qkv_proj(x)
        # torch's rotary differs by an ulp in ~1 of 10 elements (its vectorized kernels round differently)
        torch.testing.assert_close(qk, attn._rotate(qkv[:, :attn.q_size + attn.kv_size].view(24, -1, 32), rope),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, qkv[:, attn.q_size + attn.kv_size:].reshape(24, -1, 32), rtol=0, atol=0)
    torch_ops = [o.token_ids for o in engine.generate(prompts, params)]
    model.use_native(kernels)
    assert [o.token_ids for o in engine.generate(prompts, params)] == torch_ops
