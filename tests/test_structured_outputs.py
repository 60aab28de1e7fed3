"""Structured outputs (engine/grammar.py): a JSON schema, a regex or a list of choices as each step's
allowed tokens, with the bundled default model (a real tokenizer: the tiny test models' word-level one
has no JSON punctuation). In one engine, then through a cluster (conductor, prefill and decode as
processes): the prefill constrains the first token and the decode the rest, and the answer equals the
single engine's token for token."""

from __future__ import annotations

import json

import openai
import pytest

from cluster import Cluster
from mooncaked.engine import Engine, RequestError, SamplingParams
from mooncaked.engine.grammar import json_schema_grammar, regex_grammar
from mooncaked.engine.loader import resolve_model_dir
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_dir("default", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine.from_pretrained(model_dir, block_size=16, kv_cache_bytes=64 << 20)
    yield e
    e.close()


def test_a_schema_shapes_the_answer(engine):
    ids = engine.tokenizer.encode_chat(ASK)
    free = engine.generate([ids], SamplingParams(max_tokens=24))[0]
    assert not free.text.startswith("{")  # left alone, the model chats
    out = engine.generate([ids], SamplingParams(max_tokens=64, grammar=json_schema_grammar(PERSON)))[0]
    assert out.finish_reason == "stop", out
    person = json.loads(out.text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 150


def test_a_regex_and_choices_hold_sampled_answers_too(engine):
    ids = engine.tokenizer.encode("My phone number is")
    for seed in range(4):  # sampled at temperature 1.5: still inside the grammar
        out = engine.generate([ids], SamplingParams(max_tokens=16, temperature=1.5, seed=seed,
                                                    grammar=regex_grammar(r" \d{3}-\d{4}")))[0]
        assert out.finish_reason == "stop" and len(out.text) == 9 and out.text[4] == "-", out.text
    yes_no = regex_grammar("(yes)|(no)")
    ask = engine.tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue?"}])
    assert engine.generate([ask], SamplingParams(max_tokens=8, grammar=yes_no))[0].text in ("yes", "no")


def test_a_bad_grammar_is_refused_and_one_the_model_cannot_follow_fails_only_its_request(tiny_model_factory):
    with pytest.raises(RequestError, match="grammar"):
        SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: (("}]}')
    with pytest.raises(RequestError, match="grammar"):
        SamplingParams(grammar="x" * (65 << 10))
    # the tiny model's tokenizer (word pieces) is one llguidance cannot read: that request fails, the next serves
    _, folder = tiny_model_factory("llama")
    e = Engine.from_pretrained(folder, dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    try:
        ids = random_prompts([6], seed=1)[0]
        bad, good = e.generate([ids, ids], [SamplingParams(max_tokens=4, grammar=regex_grammar("t5")),
                                            SamplingParams(max_tokens=4, ignore_eos=True)])
        assert bad.finish_reason == "error" and "grammar cannot be applied" in bad.error
        assert good.finish_reason == "length" and len(good.token_ids) == 4
    finally:
        e.close()


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    env = {"MOONCAKED_BLOCK_SIZE": "16", "MOONCAKED_KV_CACHE_BYTES": "64MiB"}
    c = Cluster(model_dir, tmp_path_factory.mktemp("structured-logs"), extra_env=env)
    try:
        yield c.start_serving()
    finally:
        c.stop()


def test_the_cluster_constrains_on_both_engines_as_one_engine_does(cluster, engine):
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", timeout=60, max_retries=0) as client:
        model = client.models.list().data[0].id
        want = engine.generate([engine.tokenizer.encode_chat(ASK)],
                               SamplingParams(max_tokens=64, grammar=json_schema_grammar(PERSON)))[0]
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(want.token_ids) > 1  # the decode produced all but the first
        chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0,
                                                     response_format={"type": "json_object"}, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert isinstance(json.loads(text), dict), text
        choice = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=1.0, seed=3,
                                           extra_body={"guided_choice": [" blue", " green", " red"]})
        assert choice.choices[0].text in (" blue", " green", " red")
        for bad, param in (({"response_format": {"type": "xml"}}, "response_format"),
                           ({"guided_regex": "("}, "guided_regex"),
                           ({"guided_json": {"type": "nonsense"}}, "guided_json"),
                           ({"guided_json": "[" * 70000}, "guided_json")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=bad)
            assert e.value.response.json()["error"]["param"] == param
