"""The sampler on hand-made logits (penalties as their formulas say, greedy as argmax, top-k
log-probs in order), and penalized greedy decoding against transformers' own."""

from __future__ import annotations

import math

import pytest
import torch

from mooncaked.engine import Engine, RequestError, SamplingParams
from mooncaked.engine.sampler import History, apply_penalties, sample
from tiny_models import random_prompts

V = 8


def _logits(rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_without_penalties_is_argmax_and_leaves_logits_alone():
    logits = _logits(5)
    before = logits.clone()
    out = sample(logits, [SamplingParams()] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def test_penalties_follow_their_formulas():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0])
    prompt, output = [0, 1, 1], [3, 3, 4]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = row.clone()
    apply_penalties(got, p, prompt, output)
    # by hand: seen = {0, 1, 3, 4}; positive logits halve, negative double; then the output's
    # counts (3: twice, 4: once) cost 0.5 each and 0.25 once
    want = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2 - 0.5 - 0.25, 1.0, 0.0, 4.0]
    assert got.tolist() == pytest.approx(want)

    only_openai = row.clone()
    apply_penalties(only_openai, SamplingParams(frequency_penalty=-1.0, presence_penalty=1.5), prompt, output)
    # frequency and presence look at generated tokens only: the prompt's 0 and 1 are untouched
    want = row.tolist()
    want[3] += 2 * 1.0 - 1.5
    want[4] += 1.0 - 1.5
    assert only_openai.tolist() == pytest.approx(want)


def test_penalties_apply_in_greedy_mode_and_only_to_their_row():
    logits = torch.tensor([[0.0, 5.0, 4.5, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    plain, penalized = SamplingParams(), SamplingParams(presence_penalty=1.0)
    hist = History([7], [1])
    out = sample(logits, [plain, penalized], [None, None], histories=[None, hist])
    assert out.token_ids == [1, 2]  # 5 - 1 < 4.5: the repeat loses in the penalized row only
    # 5 / 1.2 < 4.5 for a repetition penalty over the prompt's tokens, too
    out = sample(logits[:1], [SamplingParams(repetition_penalty=1.2)], [None], histories=[History([1], [])])
    assert out.token_ids == [2]
    with pytest.raises(ValueError, match="history"):
        sample(logits, [plain, penalized], [None, None])


def test_top_logprobs_are_the_k_largest_in_order_of_the_raw_distribution():
    logits = _logits(3, seed=1)
    raw = torch.log_softmax(logits, -1)
    params = [SamplingParams(logprobs=True, top_logprobs=3),
              SamplingParams(logprobs=True, top_logprobs=1, temperature=0.7, repetition_penalty=1.5),
              SamplingParams()]
    hists = [None, History([0, 1, 2], []), None]
    gens = [None, torch.Generator().manual_seed(3), None]
    out = sample(logits, params, gens, histories=hists)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, k in ((0, 3), (1, 1)):
        order = raw[i].argsort(descending=True)[:k].tolist()
        assert out.top_logprobs[i].token_ids == order
        assert out.top_logprobs[i].logprobs == pytest.approx(raw[i, order].tolist())
        assert out.top_logprobs[i].logprobs == sorted(out.top_logprobs[i].logprobs, reverse=True)
        # the sampled token's log-prob is of the raw logits, whatever temperature and penalty chose it
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item())
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.token_ids[0] == out.top_logprobs[0].token_ids[0]  # greedy picks the most likely


def test_banned_tokens_are_not_chosen_but_logprobs_stay_raw():
    logits = _logits(1, seed=2)
    best = logits.argmax(-1).item()
    out = sample(logits, [SamplingParams(logprobs=True)], [None], banned=[frozenset({best})])
    assert out.token_ids[0] != best
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, out.token_ids[0]].item())


def test_logit_bias_is_added_to_its_row_only_and_logprobs_stay_raw():
    logits = _logits(3, seed=4)
    before = logits.clone()
    # an id past the vocabulary biases nothing
    bias = {int(logits[1].argmin()): 100.0, int(logits[1].argmax()): -100.0, V + 5: 50.0}
    params = [SamplingParams(), SamplingParams(logit_bias=bias, logprobs=True),
              SamplingParams(logit_bias={2: 1.5}, temperature=0.8, seed=1)]
    gens = [None, None, torch.Generator().manual_seed(5)]
    out = sample(logits, params, gens)
    assert out.token_ids[0] == logits[0].argmax().item()  # unbiased rows as before
    assert out.token_ids[1] == logits[1].argmin().item()  # +100 beats any gap these logits have
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits, -1)[1, out.token_ids[1]].item())
    assert torch.equal(logits, before)  # biased on a copy
    # a sampled row draws from softmax((logits + bias) / T): the same draw as unbiased logits shifted by hand
    shifted = logits.clone()
    shifted[2, 2] += 1.5
    again = sample(shifted[2:], [SamplingParams(temperature=0.8, seed=1)], [torch.Generator().manual_seed(5)])
    assert out.token_ids[2] == again.token_ids[0]


@pytest.mark.parametrize("kw, what", [
    (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(top_logprobs=2), "top_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
])
def test_bad_settings_are_refused(kw, what):
    with pytest.raises(RequestError, match=what):
        SamplingParams(**kw)


def test_greedy_with_repetition_penalty_matches_transformers(tiny_model_factory):
    hf, folder = tiny_model_factory("llama")
    engine = Engine.from_pretrained(folder, dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    prompts = random_prompts([9, 17], seed=30)
    plain = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
                                     SamplingParams(max_tokens=12, ignore_eos=True)])
    for prompt, out in zip(prompts[:1], outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    assert outs[0].token_ids != plain[0].token_ids, "the penalty should change this prompt's answer"
    assert outs[1].token_ids == plain[1].token_ids, "a penalized neighbour must not change an unpenalized row"
