"""The engine against `transformers` on the same weights: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine import Engine, SamplingParams
from tiny_models import hf_greedy, hf_logits, random_prompts

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LENGTHS = [3, 9, 17, 40, 70]  # 70 > llama3's original context of 32 in the tiny llama


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", "float32")  # the exact path; auto may pick bf16 weights (engine/precision.py)
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return Engine.from_pretrained(folder, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_model_factory):
    hf, folder = tiny_model_factory(arch)
    engine = _engine(folder)
    for prompt in random_prompts(LENGTHS):
        ref = hf_logits(hf, prompt)
        # whole prompt at once, and in chunks of 7 through the paged cache
        for chunk in (None, 7):
            ours = engine.score(prompt, chunk_size=chunk)
            torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(arch, tiny_model_factory):
    hf, folder = tiny_model_factory(arch)
    prompts = random_prompts(LENGTHS, seed=2)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    # small step budget: long prompts are chunked and interleaved with running decodes
    engine = _engine(folder, max_num_batched_tokens=16)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_give_same_tokens(arch, tiny_model_factory):
    hf, folder = tiny_model_factory(arch)
    engine = _engine(folder)
    base = random_prompts([40], seed=3)[0]
    tails = random_prompts([5, 11, 2], seed=4)
    prompts = [base + t for t in tails]
    first = engine.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    before = engine.stats().prefill_tokens_computed
    outs = engine.generate(prompts[1:], SamplingParams(max_tokens=8, ignore_eos=True))
    computed = engine.stats().prefill_tokens_computed - before
    cached = [o.num_cached_tokens for o in outs]
    assert all(c == 40 for c in cached), cached  # 10 full blocks of 4 shared with the first prompt
    assert computed == sum(len(p) for p in prompts[1:]) - sum(cached)
    for p, o in zip(prompts, [first] + outs):
        assert o.token_ids == hf_greedy(hf, p, 8)
    # exactly the same prompt again: all but the last block comes from the cache
    again = engine.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4


def test_half_precision_logits_close(tiny_model_factory):
    for dtype in (torch.bfloat16, torch.float16):
        hf, folder = tiny_model_factory("llama", dtype)
        engine = _engine(folder, dtype=dtype)
        assert engine.dtype == dtype
        for prompt in random_prompts([5, 30], seed=5):
            ref = hf_logits(hf, prompt)
            ours = engine.score(prompt)
            # half precision rounds differently op by op; compare relative to the logit scale
            err = (ours - ref).abs().max() / ref.abs().max()
            assert err < 0.05, (dtype, err)


def test_half_model_runs_in_float32_on_cpu_by_default(tiny_model_factory):
    hf, folder = tiny_model_factory("qwen2", torch.bfloat16)
    assert _engine(folder, dtype=None).dtype == torch.float32  # auto: fp32 activations (weights: precision.py)
    engine = _engine(folder)
    assert engine.precision.exact
    prompt = random_prompts([12], seed=6)[0]
    ref = hf_logits(hf.float(), prompt)
    # large logits (scaled weights + biases): fp32 summation order shows at ~1e-5 relative
    torch.testing.assert_close(engine.score(prompt), ref, atol=1e-3, rtol=1e-3)


def test_a_prefill_longer_than_the_mlps_row_chunk_matches_transformers(tiny_model_factory, monkeypatch):
    """A long prefill runs its MLP a few rows at a time (models/llama.py MLP_CHUNK_ROWS): the same logits."""
    import mooncaked.engine.models.llama as llama

    monkeypatch.setattr(llama, "MLP_CHUNK_ROWS", 16)
    hf, folder = tiny_model_factory("llama")
    engine = _engine(folder)
    prompt = random_prompts([70], seed=5)[0]  # 70 rows: four whole chunks of 16 and a part
    torch.testing.assert_close(engine.score(prompt), hf_logits(hf, prompt), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_logprobs_match_transformers(arch, tiny_model_factory):
    """Scoring a prompt (OpenAI's echo with logprobs): each prompt token's log-prob under transformers'
    log-softmax of the position before it, and the top tokens there; in a batch with chunked prefill and
    running decodes, and for a prompt whose prefix is cached (a scored prompt computes it again)."""
    hf, folder = tiny_model_factory(arch)
    engine = _engine(folder, max_num_batched_tokens=16)
    prompts = random_prompts([2, 9, 40, 70], seed=5)
    engine.generate([prompts[2]], SamplingParams(max_tokens=2, ignore_eos=True))  # prompt 2's blocks now cached
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (0, 3, 5, 0)]
    outs = engine.generate([prompts[0], *prompts], [plain, *params])
    assert outs[0].prompt_logprobs is None  # only asked for where asked
    for prompt, p, out in zip(prompts, params, outs[1:]):
        ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert len(out.prompt_logprobs) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-4, rtol=1e-4)
        assert out.num_cached_tokens == 0
        assert out.token_ids == hf_greedy(hf, prompt, 3)  # the answer is unchanged by scoring
        if p.prompt_logprobs:
            top = torch.topk(ref[:-1], p.prompt_logprobs, dim=-1)
            assert [t.token_ids for t in out.prompt_top_logprobs] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([t.logprobs for t in out.prompt_top_logprobs]), top.values,
                                       atol=2e-4, rtol=1e-4)
        else:
            assert out.prompt_top_logprobs is None


def test_prompt_logprobs_survive_preemption(tiny_model_factory):
    """A KV cache of 24 blocks for four sequences that grow to 21-22 blocks each: running ones are preempted
    and recomputed, and a recompute scores its prompt again without doubling or losing a row."""
    hf, folder = tiny_model_factory("llama")
    engine = _engine(folder, kv_cache_bytes=48 << 10, max_num_batched_tokens=16)
    prompts = random_prompts([30, 35, 40, 45], seed=9)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=0))
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-4, rtol=1e-4)
