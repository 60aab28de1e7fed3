"""The engine on a CUDA GPU against `transformers` on the same GPU and weights, through the torch attention
backend (it needs no flash-attn, which the flash tests compare against it): fp32 logits and greedy tokens,
chunked prefill through the paged cache, and bf16 greedy agreement. The CPU twin is test_engine_oracle.py;
these run where a GPU is lent (.ci/gpu)."""

from __future__ import annotations

import copy

import pytest
import torch

from mooncaked.engine import Engine, SamplingParams
from tiny_models import hf_greedy, hf_logits, random_prompts

DEVICE = "cuda"
NO_CUDA = None if torch.cuda.is_available() else "no CUDA GPU on this machine (these run where one is lent: .ci/gpu)"
pytestmark = pytest.mark.skipif(NO_CUDA is not None, reason=f"the engine on CUDA not testable here: {NO_CUDA}")


def _pair(tiny_model_factory, arch: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Engine]:
    """transformers' model (a copy: the factory's is shared with the CPU tests) and ours, both on DEVICE."""
    hf, folder = tiny_model_factory(arch, dtype)
    engine = Engine.from_pretrained(folder, device=DEVICE, dtype=dtype, attention_backend="torch", block_size=16,
                                    kv_cache_bytes=32 << 20)
    return copy.deepcopy(hf).to(DEVICE), engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_logits_and_greedy_tokens_match_transformers_on_the_gpu(arch, tiny_model_factory):
    hf, engine = _pair(tiny_model_factory, arch, torch.float32)
    for prompt in random_prompts([3, 17, 70]):
        ref = hf_logits(hf, prompt).cpu()
        for chunk in (None, 7):  # whole, and in chunks through the paged cache
            torch.testing.assert_close(engine.score(prompt, chunk_size=chunk).float().cpu(), ref, atol=1e-3, rtol=1e-3)
    prompts = random_prompts([3, 9, 40], seed=2)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == want


def test_bf16_greedy_tokens_agree_with_transformers_bf16_on_the_gpu(tiny_model_factory):
    hf, engine = _pair(tiny_model_factory, "llama", torch.bfloat16)
    prompts = random_prompts([5, 17, 40, 70], seed=3)
    want = [hf_greedy(hf, p, 16) for p in prompts]
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    agree = sum(x == y for a, b in zip(got, want) for x, y in zip(a, b)) / sum(len(w) for w in want)
    assert agree >= 0.9, (agree, got, want)  # bf16 sums in another order: a near tie may flip a token
