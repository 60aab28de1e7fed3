"""The native RMSNorm, residual add + RMSNorm and rotary kernels (csrc/norm_rope.cpp) against torch's ops, and
an engine that runs them against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.models.rope import apply_rotary
from tiny_models import hf_greedy, hf_logits, make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def kernels():
    from mooncaked.engine.native import native_module, q4_unavailable

    if q4_unavailable() is not None:
        pytest.skip(f"native kernels: {q4_unavailable()}")
    module = native_module()
    if module is None:
        pytest.skip("native kernels could not be built here (the log says why)")
    return module


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
