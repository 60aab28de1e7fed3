"""Engine behaviour on a tiny real model: batching, preemption, sampling, streaming, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mooncaked.engine import ConfigError, Engine, RequestError, SamplingParams
from tiny_models import hf_logits, random_prompts

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", "float32")  # the exact path: these tests compare with transformers and across batches
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return Engine.from_pretrained(folder, **kw)


@pytest.mark.parametrize("pack", [None, 2048], ids=["cpu-default-pack", "whole-step-pack"])
def test_batched_equals_one_by_one(llama, pack):
    _, folder = llama
    prompts = random_prompts([4, 13, 26, 7, 31, 2], seed=10)
    batched = _engine(folder, prefill_pack_tokens=pack).generate(prompts, GREEDY)
    single = [_engine(folder, enable_prefix_caching=False).generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]


def test_preempted_sequences_resume_with_the_same_tokens(llama):
    _, folder = llama
    prompts = random_prompts([10, 11, 12, 13], seed=11)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = _engine(folder).generate(prompts, params)
    # 2 layers * 2 * 4 tokens * 2 heads * 16 dims * 4 bytes = 2 KiB a block; 20 blocks cannot hold all four
    tight = _engine(folder, kv_cache_bytes=20 * 2048)
    outs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.stats().num_free_blocks == tight.stats().num_blocks


def test_sampling_seeds_top_k_and_logprobs(llama):
    hf, folder = llama
    engine = _engine(folder)
    prompt = random_prompts([9], seed=12)[0]
    a = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    b = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    c = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    greedy = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=3,
                                                    ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    tiny_p = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=3,
                                                      ignore_eos=True))[0]
    assert tiny_p.token_ids == greedy.token_ids
    min_p = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, min_p=1.0, seed=3,
                                                     ignore_eos=True))[0]
    assert min_p.token_ids == greedy.token_ids
    with_lp = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=True))[0]
    ref = torch.log_softmax(hf_logits(hf, prompt)[-1], -1)[with_lp.token_ids[0]].item()
    assert with_lp.logprobs is not None and abs(with_lp.logprobs[0] - ref) < 1e-4


def test_stops(llama):
    _, folder = llama
    engine = _engine(folder)
    prompt = random_prompts([9], seed=13)[0]
    free = engine.generate([prompt], GREEDY)[0]
    third = free.token_ids[2]
    by_id = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[third]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(third) + 1]
    word = f"t{third}"
    by_text = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop=[word]))[0]
    assert by_text.finish_reason == "stop" and word not in by_text.text
    assert free.text.startswith(by_text.text)
    eos = engine.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[], ignore_eos=False))[0]
    assert eos.finish_reason in ("stop", "length")
    assert 2 not in eos.token_ids[:-1]  # eos id 2 ends the request when it appears


def test_min_tokens_keeps_eos_out_of_reach(llama):
    hf, folder = llama
    engine = _engine(folder)
    prompt = random_prompts([9], seed=17)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    eos_at = free.token_ids[3]
    held = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=12, stop_token_ids=[eos_at]))[0]
    assert held.finish_reason == "length" and eos_at not in held.token_ids
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                       eos_token_id=[2, eos_at], pad_token_id=0)[0, len(prompt):].tolist()
    assert held.token_ids == want
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


async def test_stream_deltas_and_abort(llama):
    _, folder = llama
    engine = _engine(folder)
    prompt = random_prompts([9], seed=14)[0]
    want = engine.generate([prompt], GREEDY)[0]
    pieces, ids = [], []
    async for out in engine.stream(prompt, GREEDY):
        pieces.append(out.new_text)
        ids += out.new_token_ids
    assert ids == want.token_ids and "".join(pieces) == want.text and out.finish_reason == "length"
    # leaving a stream early aborts it and frees its blocks
    agen = engine.stream(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    async for out in agen:
        break
    await agen.aclose()
    for _ in range(100):
        if not engine.has_work():
            break
        await asyncio.sleep(0.02)
    assert not engine.has_work()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    engine.close()


async def test_concurrent_streams_equal_generate(llama):
    _, folder = llama
    engine = _engine(folder)
    prompts = random_prompts([5, 17, 30], seed=15)
    want = [o.token_ids for o in _engine(folder).generate(prompts, GREEDY)]

    async def collect(p):
        return [t async for out in engine.stream(p, GREEDY) for t in out.new_token_ids]

    got = await asyncio.gather(*(collect(p) for p in prompts))
    assert got == want
    engine.close()


def test_bad_requests_get_clear_errors(llama):
    _, folder = llama
    engine = _engine(folder)
    with pytest.raises(RequestError, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(RequestError, match="prompt has 600 tokens"):
        engine.generate([[5] * 600], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.generate([[5, 9999]], GREEDY)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    # the engine still serves after refusing
    assert engine.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"
    small = _engine(folder, kv_cache_bytes=3 * 2048)
    with pytest.raises(RequestError, match="KV slots"):
        small.generate([[5] * 20], GREEDY)


def test_config_errors_name_the_field(tmp_path, llama):
    import json
    import shutil

    _, folder = llama
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM"):
        Engine.from_pretrained(bad)
    cfg["architectures"] = ["LlamaForCausalLM"]
    del cfg["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        Engine.from_pretrained(bad)
    cfg["hidden_size"] = 64
    cfg["num_key_value_heads"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Engine.from_pretrained(bad)
    with pytest.raises(FileNotFoundError, match="not found"):
        Engine.from_pretrained(tmp_path / "nope")


def test_old_style_rope_config_is_read(tmp_path, llama):
    """transformers < 5 writes rope_theta and rope_scaling at the top level; both must be honoured."""
    import json
    import shutil

    hf, folder = llama
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    cfg = json.loads((old / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg.pop("head_dim", None)
    (old / "config.json").write_text(json.dumps(cfg))
    prompt = random_prompts([60], seed=16)[0]
    torch.testing.assert_close(_engine(old).score(prompt), hf_logits(hf, prompt), atol=2e-4, rtol=1e-4)


def _first_token_steps(engine: Engine, lengths: list[int], seed: int) -> list[int]:
    """The step at which each of these prompts, queued together, got its first token."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
           for p in random_prompts(lengths, seed=seed)]
    first_at: dict[str, int] = {}
    step = 0
    while engine.has_work():
        step += 1
        for out in engine.step():
            if out.token_ids:
                first_at.setdefault(out.request_id, step)
    return [first_at[i] for i in ids]


def test_on_cpu_the_default_step_lets_prompts_finish_in_arrival_order(llama):
    """Prompts queued together get their first tokens one after another, not all at the end of one big
    step: on a CPU a bigger step buys no throughput and would hold every first token in it."""
    from mooncaked.engine.config import DEFAULT_PACK_TOKENS, DEFAULT_STEP_TOKENS

    _, folder = llama
    engine = _engine(folder)
    assert engine.config.max_num_batched_tokens is None and engine.config.prefill_pack_tokens is None
    assert engine.config.step_tokens == DEFAULT_STEP_TOKENS["cpu"] == 256
    assert engine.config.pack_tokens == DEFAULT_PACK_TOKENS["cpu"] == 32
    # 800 tokens: one step at a 2048 budget; at 256 without the pack limit, the first two share step 1
    assert _first_token_steps(engine, [200, 200, 200, 200], seed=40) == [1, 2, 3, 4]
    assert _first_token_steps(engine, [100, 100, 100], seed=41) == [1, 2, 3]  # each alone in its step
    assert _first_token_steps(engine, [8, 8, 8, 30], seed=42) == [1, 1, 1, 2]  # tiny prompts still pack

    packed = _engine(folder, prefill_pack_tokens=256)  # a pack size set by hand is kept
    assert _first_token_steps(packed, [100, 100, 100], seed=41) == [1, 1, 2]
    wide = _engine(folder, max_num_batched_tokens=2048)  # a budget set by hand is kept
    assert wide.config.step_tokens == 2048
