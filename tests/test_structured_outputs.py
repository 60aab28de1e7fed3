"""Structured outputs (engine/grammar.py): a JSON schema, a regex or a list of choices as each step's
allowed tokens, with the bundled default model (a real tokenizer: the tiny test models' word-level one
has no JSON punctuation). In one engine, then through a cluster (conductor, prefill and decode as
processes): the prefill constrains the first token and the decode the rest, and the answer equals the
single engine's token for token."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import openai
import pytest

from cluster import Cluster
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from mooncaked.engine import Engine, RequestError, SamplingParams
from mooncaked.engine.grammar import json_schema_grammar, regex_grammar
from mooncaked.engine.engine_thread import THREAD_NAME
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


async def test_a_streamed_answer_follows_the_grammar_as_generate_does(model_dir, engine):
    """Engine.stream (an in-process engine on its driver thread) makes the grammar's state off the engine
    thread and streams the same tokens as generate."""
    ids = engine.tokenizer.encode_chat(ASK)
    params = SamplingParams(max_tokens=64, grammar=json_schema_grammar(PERSON))
    want = engine.generate([ids], params)[0]
    streaming = Engine.from_pretrained(model_dir, block_size=16, kv_cache_bytes=64 << 20)
    built_on: list[str] = []  # the thread each grammar state was made on
    make = streaming._new_constraint

    def recorded(grammar: str, tokens: list[int]):
        built_on.append(threading.current_thread().name)
        return make(grammar, tokens)

    streaming._new_constraint = recorded
    try:
        outs = [o async for o in streaming.stream(ids, params)]
    finally:
        streaming.close()
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids and outs[-1].finish_reason == "stop"
    assert len(built_on) == 1 and not built_on[0].startswith(THREAD_NAME), built_on


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


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tools_are_offered_and_read_back_in_openai_shapes():
    """conductor/tool_calls.py alone: what it takes, what it refuses, how a call and an earlier call read."""
    from mooncaked.conductor.tool_calls import Tools, ToolError, calls_in, parse_tools, shown_content

    assert parse_tools({}) is None and parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    tools = parse_tools({"tools": [WEATHER, ADD]})
    assert tools == Tools(tools.functions, "auto") and tools.names == {"get_weather", "add"}
    named = parse_tools({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.choice == "add"
    for body, param in (({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0]"),
                        ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": [WEATHER] * 65}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                         "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(ToolError) as e:
            parse_tools(body)
        assert e.value.param == param
    call = calls_in('{"name": "add", "arguments": {"a": 1, "b": 2}}', tools)
    assert call[0]["type"] == "function" and call[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert calls_in("It is sunny.", tools) is None and calls_in('{"name": "add", "argu', tools) is None
    assert calls_in('{"name": "other", "arguments": {}}', tools) is None
    earlier = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 1}'}}]}
    assert json.loads(shown_content(earlier, 1)) == {"name": "add", "arguments": {"a": 1}}
    with pytest.raises(ToolError):
        shown_content({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]}, 1)


def test_the_cluster_calls_tools_as_one_engine_does(cluster, engine):
    """A required call through the cluster equals the single engine's answer under the same grammar; a named
    function, a streamed call, a conversation that carries a call and its result back, and bad requests."""
    from mooncaked.conductor.tool_calls import grammar_source, parse_tools, system_text

    tools = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "required"})
    kind, source = grammar_source(tools)
    assert kind == "json"
    want = engine.generate([engine.tokenizer.encode_chat([{"role": "system", "content": system_text(tools)},
                                                          *WEATHER_ASK])],
                           SamplingParams(max_tokens=60, grammar=json_schema_grammar(json.loads(source))))[0]
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", timeout=60, max_retries=0) as client:
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=[WEATHER, ADD],
                                           tool_choice="required", max_tokens=60, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert {"name": call.function.name, "arguments": json.loads(call.function.arguments)} == json.loads(want.text)
        named = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=[WEATHER, ADD], temperature=0,
                                               tool_choice={"type": "function", "function": {"name": "add"}},
                                               max_tokens=60)
        args = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
        assert named.choices[0].message.tool_calls[0].function.name == "add" and set(args) == {"a", "b"}
        streamed = list(client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=[WEATHER, ADD],
                                                       tool_choice="required", max_tokens=60, temperature=0,
                                                       stream=True))
        deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
            [(call.function.name, json.loads(call.function.arguments))]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        back = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=[WEATHER], messages=[
            *WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
        assert back.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for bad, param in (({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
                           ({"tool_choice": "required"}, "tool_choice"),
                           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=model, messages=WEATHER_ASK, max_tokens=4, extra_body=bad)
            assert e.value.response.json()["error"]["param"] == param


def test_a_pipeline_group_constrains_as_one_engine_does(cluster, engine):
    """A two-stage CPP group (p1 drained, so the group prefills): its last stage, which samples, makes the
    grammar's state off its engine thread and constrains the first token; the decode the rest. Last in
    the module: it changes the cluster's shape."""
    for k in range(2):
        cluster.start(f"g-s{k}", "prefill", "--pipeline-group", "g", "--pipeline-stage", f"{k}/2",
                      "--cpp-chunk-tokens", "8")
    cluster.wait_serving(["g-s0", "g-s1"])
    out = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "--conductor", cluster.conductor, "drain", "p1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    prompt = engine.tokenizer.encode_chat(ASK)
    grammar = json_schema_grammar(PERSON)
    want = engine.generate([prompt], SamplingParams(max_tokens=64, grammar=grammar))[0]
    with grpc.insecure_channel(cluster.conductor) as ch:
        req = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=prompt),
                                            sampling=common_pb2.SamplingParams(max_tokens=64, grammar=grammar))
        chunks = list(conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=60))
    assert chunks[0].prefill_instance == "g-s0"
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert json.loads(want.text)["age"] >= 0
