"""The official ``openai`` client against a real cluster (conductor + prefill + decode as
processes): log-probs equal an in-process engine's on the same weights, ``n`` choices with
per-choice seeds, penalties, ``stop`` lists, ``echo``, 404 for an unknown model, 400s naming
what is not supported; streaming and not."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest

from cluster import Cluster
from mooncaked.proto.mooncake.v1 import engine_pb2, engine_pb2_grpc
from mooncaked.engine import Engine, SamplingParams
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(180)

TOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path_factory.mktemp("openai-logs"))
    try:
        yield c.start_serving()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def engine(cluster):
    """The same weights in this process: what the cluster's answers must agree with."""
    e = Engine.from_pretrained(cluster.model, block_size=4, kv_cache_bytes=4 << 20)
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c


def _alias(cluster) -> str:
    """The model as configured (its path): accepted, but answers name the canonical id."""
    return str(cluster.model)


def _word(token_id: int) -> str:
    return f"t{token_id}"  # the tiny tokenizer's token text


def test_completions_logprobs_equal_the_engines(cluster, engine, client):
    ids = random_prompts([11], seed=80)[0]
    want = engine.generate([ids], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2, ignore_eos=True))[0]
    r = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert r.model == cluster.model.name
    lp = r.choices[0].logprobs
    assert lp.tokens == [_word(t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=TOL)
    for pos, top in enumerate(lp.top_logprobs):
        ref = want.top_logprobs[pos]
        # the top 2, most likely first; the sampled (greedy: the first) is among them
        assert list(top) == [_word(t) for t in ref.token_ids]
        assert list(top.values()) == pytest.approx(ref.logprobs, abs=TOL)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]

    # streamed: the same log-probs, chunk by chunk, offsets running on
    stream = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=6, temperature=0, logprobs=2,
                                       stream=True, extra_body={"ignore_eos": True})
    tokens, lps, offsets = [], [], []
    for chunk in stream:
        assert chunk.model == cluster.model.name
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert lps == pytest.approx(want.logprobs, abs=TOL)

    # logprobs=0: the sampled token's alone
    r0 = client.completions.create(model=cluster.model.name, prompt=ids, max_tokens=2, temperature=0, logprobs=0,
                                   extra_body={"ignore_eos": True})
    assert r0.choices[0].logprobs.top_logprobs == [{_word(t): pytest.approx(v, abs=TOL)}
                                                   for t, v in zip(want.token_ids[:2], want.logprobs[:2])]


def test_chat_logprobs_equal_the_engines(cluster, engine, client):
    msgs = [{"role": "user", "content": "t20 t21 t22 t23"}]
    prompt = engine.tokenizer.encode_chat(msgs)
    want = engine.generate([prompt], SamplingParams(max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True))[0]
    args = dict(model=_alias(cluster), messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**args)
    assert r.model == cluster.model.name
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [_word(t) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=TOL)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    for c, ref in zip(content, want.top_logprobs):
        assert [t.token for t in c.top_logprobs] == [_word(t) for t in ref.token_ids]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(ref.logprobs, abs=TOL)
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)

    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        assert chunk.model == cluster.model.name
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    assert [c.logprob for c in streamed] == pytest.approx(want.logprobs, abs=TOL)
    assert [[t.token for t in c.top_logprobs] for c in streamed] == [[t.token for t in c.top_logprobs]
                                                                    for c in content]

    # logprobs without top_logprobs: each token's own, an empty top list
    r = client.chat.completions.create(**{**args, "top_logprobs": None})
    assert [c.top_logprobs for c in r.choices[0].logprobs.content] == [[]] * 5
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_n_choices_seeded_per_choice(cluster, client):
    body = dict(model=_alias(cluster), prompt="t9 t8 t7", max_tokens=12, temperature=2.0, seed=5,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**body, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.model == cluster.model.name
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 3
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1], "choices with seeds 5 and 6 should differ"
    # choice i samples with seed + i: the seed reaches the engine, and again gives the same answer
    assert client.completions.create(**body).choices[0].text == texts[0]
    assert client.completions.create(**{**body, "seed": 6}).choices[0].text == texts[1]

    # streamed: chunks of both choices, each under its index, with the same texts; usage sums both
    got = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(**body, n=2, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            got[c.index] += c.text
        usage = chunk.usage or usage
    assert [got[0], got[1]] == texts and usage.completion_tokens == 24

    chat = dict(model=_alias(cluster), messages=[{"role": "user", "content": "t30 t31"}], max_tokens=6,
                temperature=2.0, seed=11, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 12
    roles, parts = {}, {0: "", 1: ""}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            parts[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]


def test_penalties_reach_the_engine(cluster, engine, client):
    ids = random_prompts([12], seed=81)[0]
    pen = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3)
    want = engine.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True, **pen))[0]
    plain = engine.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert want.token_ids != plain.token_ids, "these penalties should change the greedy answer"
    r = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=10, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=0.7,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == want.text


def test_a_batch_of_prompts_answers_each_prompt_in_order(cluster, engine, client):
    """OpenAI's batched completions: choice k * n + i is prompt k's i-th; usage counts each prompt once."""
    prompts = random_prompts([7, 9, 5], seed=84)
    want = [engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0].text for ids in prompts]
    r = client.completions.create(model=_alias(cluster), prompt=prompts, max_tokens=4, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7 + 9 + 5, 6 * 4)
    # text prompts, echoed and streamed: each choice as the prompt asked alone
    texts = ["t5 t6", "t7 t8 t9"]
    args = dict(model=_alias(cluster), max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=t, **args) for t in texts]
    got, use = ["", ""], None
    for chunk in client.completions.create(prompt=texts, stream=True, stream_options={"include_usage": True},
                                           **args):
        for c in chunk.choices:
            got[c.index] += c.text
        use = chunk.usage or use
    assert got == [a.choices[0].text for a in alone] and got[1].startswith("t7 t8 t9")
    assert use.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and use.completion_tokens == 6
    # a prompt the cluster refuses (too long once tokenized) is named by its index
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["t5", " ".join(["t6"] * 600)], **args)
    err = e.value.response.json()["error"]
    assert err["param"] == "prompt[1]" and err["message"].startswith("prompt[1]: the prompt has 600 tokens"), err
    assert err["code"] == "context_length_exceeded"


def test_logit_bias_reaches_both_engines(cluster, engine, client):
    """The prefill samples the first token and the decode the rest: both must add the bias."""
    ids = random_prompts([12], seed=83)[0]
    plain = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[3]: -100.0, 9: 2.5}
    want = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=bias))[0]
    assert want.token_ids[0] != plain.token_ids[0] and plain.token_ids[0] not in want.token_ids
    r = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=8, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    forced = client.chat.completions.create(model=_alias(cluster), messages=[{"role": "user", "content": "t5"}],
                                            max_tokens=5, logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == " ".join([_word(7)] * 5)


def test_stop_strings_end_the_answer_streaming_or_not(cluster, engine, client):
    ids = random_prompts([10], seed=82)[0]
    free = engine.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    word = _word(free.token_ids[3])
    want = free.text[: free.text.index(word)]
    for stop in (word, ["t999x", word]):
        args = dict(model=_alias(cluster), prompt=ids, max_tokens=10, temperature=0, stop=stop,
                    extra_body={"ignore_eos": True})
        r = client.completions.create(**args)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_and_user(cluster, client):
    r = client.completions.create(model=_alias(cluster), prompt="t40 t41", max_tokens=3, temperature=0, echo=True,
                                  user="someone", extra_body={"ignore_eos": True})
    plain = client.completions.create(model=_alias(cluster), prompt="t40 t41", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == "t40 t41" + plain.choices[0].text
    streamed = client.completions.create(model=_alias(cluster), prompt=[40, 41], max_tokens=3, temperature=0,
                                         echo=True, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == "t40 t41" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(cluster, engine, client):
    """OpenAI's echo with logprobs (how lm-evaluation-harness scores a continuation): the prompt's tokens
    come first with their log-probs, the first null; the prompt is computed whole even when cached.
    max_tokens 0 with echo: the prompt alone, nothing generated."""
    ids = random_prompts([13], seed=81)[0]
    client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=1)  # the prompt now cached
    want = engine.generate([ids], SamplingParams(max_tokens=2, logprobs=True, top_logprobs=2, prompt_logprobs=2,
                                                 ignore_eos=True))[0]
    r = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=2, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [_word(t) for t in ids + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.prompt_logprobs + want.logprobs, abs=TOL)
    for pos in range(1, len(ids)):
        top = lp.top_logprobs[pos]
        ref = want.prompt_top_logprobs[pos - 1]
        assert list(top)[:2] == [_word(t) for t in ref.token_ids]  # then the prompt's own token, if not in the top
        assert _word(ids[pos]) in top
        assert list(top.values())[:2] == pytest.approx(ref.logprobs, abs=TOL)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.usage.completion_tokens == 2

    only = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=0, echo=True, logprobs=0)
    choice = only.choices[0]
    assert choice.logprobs.tokens == [_word(t) for t in ids] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want.prompt_logprobs, abs=TOL)
    assert choice.text == " ".join(_word(t) for t in ids)
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=0, echo=True,
                                              logprobs=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens


def test_min_tokens_holds_off_the_stop_ids(cluster, engine, client):
    """vLLM's min_tokens: the stop token ids (and EOS) cannot end the answer before that many tokens, on
    the prefill (the first token) and the decode (the rest) alike."""
    ids = random_prompts([7], seed=82)[0]
    first = engine.generate([ids], SamplingParams(max_tokens=1))[0].token_ids[0]
    want = engine.generate([ids], SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[first]))[0]
    assert len(want.token_ids) >= 4
    for extra, expect in (({}, [first]), ({"min_tokens": 4}, want.token_ids)):
        r = client.completions.create(model=_alias(cluster), prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                      extra_body={"stop_token_ids": [first], **extra})
        assert r.choices[0].logprobs.tokens == [_word(t) for t in expect], extra


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="t5", max_tokens=1)
    err = e.value.response.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "t5"}], stream=True)


UNSUPPORTED = [
    ("completions", {"prompt": ["t5"] * 33, "n": 2}, "prompt"),  # 66 choices: over MAX_CHOICES
    ("completions", {"prompt": ["t5", ""]}, "prompt[1]"),
    ("completions", {"prompt": ["t5", [5, 10 ** 9]]}, "prompt[1]"),
    ("completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ("chat", {"logit_bias": [5, 1]}, "logit_bias"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "t9"}, "suffix"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt scored)
    ("completions", {"min_tokens": 2}, "min_tokens"),  # above max_tokens (1)
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": "lots"}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 2}, "logprobs"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat only
    ("chat", {"functions": [{"name": "f"}]}, "functions"),  # the deprecated form
]


@pytest.mark.parametrize("kind, extra, param", UNSUPPORTED)
def test_what_is_not_supported_is_a_400_naming_it(cluster, client, kind, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(model=cluster.model.name, messages=[{"role": "user", "content": "t5"}],
                                           max_tokens=1, extra_body=extra)
        else:
            client.completions.create(model=cluster.model.name, prompt="t5", max_tokens=1, extra_body=extra)
    assert e.value.response.json()["error"]["param"] == param


async def _running(cluster, name: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.ports[name]}") as ch:
        reply = await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=5)
    return reply.load.running_requests + reply.load.waiting_requests


async def test_a_client_leaving_cancels_every_choice(cluster):
    body = {"model": cluster.model.name, "prompt": [5, 6, 7], "max_tokens": 450, "ignore_eos": True, "n": 3,
            "stream": True}
    async with aiohttp.ClientSession(cluster.http, timeout=aiohttp.ClientTimeout(total=30)) as s:
        r = await s.post("/v1/completions", json=body)
        assert r.status == 200
        await r.content.readline()
        assert await _running(cluster, "d1") == 3
        r.close()  # drop the connection mid-stream
    for _ in range(40):
        await asyncio.sleep(0.1)
        if await _running(cluster, "d1") == 0:
            break
    assert await _running(cluster, "d1") == 0, "the decode kept generating choices for a client that left"
