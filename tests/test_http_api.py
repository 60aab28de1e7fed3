"""The conductor's HTTP front against a real cluster (conductor + one prefill + one decode, as
processes) with a real HTTP client: OpenAI completions and chat (streaming and not) equal to
the gRPC path, usage and cached tokens, bad input, the bearer token, client disconnects, the
KV-indexer API and /metrics."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import grpc
import pytest

from cluster import Cluster
from mooncaked.conductor import errors
from mooncaked.conductor.http_api import api_error
from mooncaked.hashing import block_hashes
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(120)

TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    """The cluster, and beside it (started at the same time, to save the wait) a conductor with
    an API key and no engines: ``cluster.keyed``."""
    _, folder = tiny_model_factory("llama")
    logs = tmp_path_factory.mktemp("http-logs")
    c, keyed = Cluster(folder, logs), Cluster(folder, logs)
    c.keyed = keyed
    try:
        # its startup window (requests wait for engines) is short: the tests see it refuse at once after
        keyed.start("keyed", "conductor", "--http", "127.0.0.1:0", "--api-key", "s3cret", "--ready-timeout-s", "1")
        c.start("conductor", "conductor", "--http", "127.0.0.1:0")
        keyed.http = f"http://127.0.0.1:{keyed.http_port('keyed')}"
        c.http = f"http://127.0.0.1:{c.http_port('conductor')}"
        c.start("p1", "prefill")
        c.start("d1", "decode")
        c.wait_serving(["p1", "d1"])
        yield c
    finally:
        keyed.kill("keyed", signal.SIGTERM)  # both stop at once
        c.stop()
        keyed.stop()


@pytest.fixture
async def http(cluster):
    async with aiohttp.ClientSession(cluster.http, timeout=TIMEOUT) as s:
        yield s


async def _grpc_text(cluster, **fields) -> tuple[str, list[int]]:
    req = conductor_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True), **fields)
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        chunks = [c async for c in conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=30)]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


async def _sse(resp: aiohttp.ClientResponse) -> list:
    """The stream's events in order: parsed JSON, and the final "[DONE]" as a string."""
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line:
            assert line.startswith("data: "), line
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _model(cluster) -> str:
    return cluster.model.name


async def test_completions_equal_the_grpc_path(cluster, http):
    model = _model(cluster)
    text_prompt = "t5 t6 t7 t8 t9 t10 t11"
    want, _ = await _grpc_text(cluster, prompt=text_prompt, raw=True)
    base = {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/completions", json={**base, "prompt": text_prompt}) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["object"] == "text_completion" and body["model"] == model
    assert body["choices"][0]["text"] == want and body["choices"][0]["finish_reason"] == "length"
    use = body["usage"]
    assert use["prompt_tokens"] == 7 and use["completion_tokens"] == 8 and use["total_tokens"] == 15
    assert "cached_tokens" in use["prompt_tokens_details"]

    ids = random_prompts([13], seed=70)[0]
    want_ids_text, _ = await _grpc_text(cluster, token_ids=conductor_pb2.TokenIds(ids=ids))
    async with http.post("/v1/completions", json={**base, "prompt": ids, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as r:
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert "".join(e["choices"][0]["text"] for e in chunks) == want_ids_text
    assert all(e["usage"] is None for e in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["prompt_tokens"] == 13


async def test_chat_equals_the_grpc_path(cluster, http):
    model = _model(cluster)
    msgs = [{"role": "user", "content": "t20 t21 t22"}]
    want, _ = await _grpc_text(cluster, messages=conductor_pb2.ChatMessages(
        messages=[conductor_pb2.ChatMessage(**m) for m in msgs]))
    base = {"model": model, "messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/chat/completions", json=base) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert body["usage"]["completion_tokens"] == 8
    async with http.post("/v1/chat/completions", json={**base, "stream": True}) as r:
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_repeated_long_prompt_reports_cached_tokens(cluster, http):
    ids = random_prompts([42], seed=71)[0]
    body = {"model": _model(cluster), "prompt": ids, "max_tokens": 2, "temperature": 0}
    cached = []
    for _ in range(2):
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            use = (await r.json())["usage"]
        assert use["prompt_tokens"] == 42
        cached.append(use["prompt_tokens_details"]["cached_tokens"])
        await asyncio.sleep(0.8)  # the prefill's KV events reach the conductor with its heartbeat
    assert cached[0] == 0 and cached[1] >= 36, cached


async def test_models(cluster, http):
    async with http.get("/v1/models") as r:
        body = await r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [_model(cluster)]
    assert body["data"][0]["max_model_len"] == 512 and body["data"][0]["vocab_size"] == 256
    async with http.get(f"/v1/models/{_model(cluster)}") as r:
        assert r.status == 200
    async with http.get("/v1/models/nope") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


BAD = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "t5"}, "model"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [5, 999]}, "prompt"),
    ("completions", {"prompt": [5, -1]}, "prompt"),
    ("completions", {"prompt": ["t5", 6]}, "prompt"),  # neither a batch nor token ids
    ("completions", {"prompt": "t5", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "t5", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "t5", "max_tokens": 10**9}, "max_tokens"),
    ("completions", {"prompt": "t5", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "t5", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "t5", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "t5", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "t5", "seed": -1}, "seed"),
    ("completions", {"prompt": "t5", "n": 0}, "n"),
    ("completions", {"prompt": "t5", "stop": [""]}, "stop"),
    ("completions", {"prompt": "t5", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "t5", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "t5", "logprobs": 6}, "logprobs"),
    ("completions", {"prompt": [5] * 600}, "prompt"),  # longer than the context: refused by its length at once
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "t5"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
]


async def _samples(http) -> dict[str, float]:
    async with http.get("/metrics") as r:
        assert r.status == 200
        return {name: float(value) for name, value in
                (line.rsplit(" ", 1) for line in (await r.text()).splitlines() if line and not line.startswith("#"))}


async def test_bad_requests_get_400_and_the_server_keeps_serving(cluster, http):
    model = _model(cluster)
    counted = ('mooncaked_conductor_requests_total{front="http",outcome="rejected"}',
               'mooncaked_conductor_rejections_total{reason="invalid_argument"}')
    before = await _samples(http)
    for path, body, param in BAD:
        if isinstance(body, dict):  # cases about the model send their own; the others the served one
            data = json.dumps(body if param == "model" else {"model": model, **body}).encode()
        else:
            data = body
        async with http.post(f"/v1/{path}", data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            assert r.status == 400, (body, text)
            err = json.loads(text)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], text
            assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    # a model this server does not serve is not found, as OpenAI answers it
    async with http.post("/v1/completions", json={"model": "gpt-4", "prompt": "t5"}) as r:
        err = (await r.json())["error"]
        assert r.status == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
    after = await _samples(http)  # each refusal counted once as a request, once as a rejection
    assert [after.get(name, 0) - before.get(name, 0) for name in counted] == [len(BAD) + 1] * 2
    # ignore_eos: sampled at temperature 1, the tiny random model draws its EOS now and then
    async with http.post("/v1/completions", json={"model": model, "prompt": "t5 t6", "max_tokens": 3,
                                                  "ignore_eos": True}) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3


async def _running(cluster, name: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.ports[name]}") as ch:
        reply = await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=5)
    return reply.load.running_requests + reply.load.waiting_requests


async def test_client_disconnect_cancels_the_request(cluster):
    body = {"model": _model(cluster), "prompt": [5, 6, 7], "max_tokens": 450, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(cluster.http, timeout=TIMEOUT) as s:
        r = await s.post("/v1/completions", json=body)
        assert r.status == 200
        await r.content.readline()
        assert await _running(cluster, "d1") == 1
        r.close()  # drop the connection mid-stream
    for _ in range(40):
        await asyncio.sleep(0.1)
        if await _running(cluster, "d1") == 0:
            break
    assert await _running(cluster, "d1") == 0, "the decode kept generating for a client that left"


async def test_bearer_token_and_no_instance(cluster):
    """The conductor with an API key and no engines: 401 without the key, 503 with it."""
    body = {"model": _model(cluster), "prompt": "t5", "max_tokens": 2}
    async with aiohttp.ClientSession(cluster.keyed.http, timeout=TIMEOUT) as s:
        for _ in range(100):  # "starting" for ready_timeout_s, then "unavailable"
            async with s.get("/health") as r:
                health = r.status, await r.json()
            if health[1]["status"] != "starting":
                break
            await asyncio.sleep(0.2)
        assert health == (503, {"status": "unavailable", "prefill": 0, "decode": 0})  # open without a key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            async with s.post("/v1/completions", json=body, headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.post("/query", json={}) as r:
            assert r.status == 401
        good = {"Authorization": "Bearer s3cret"}
        async with s.get("/v1/models", headers=good) as r:
            assert r.status == 200
        async with s.post("/v1/completions", json=body, headers=good) as r:
            err = (await r.json())["error"]
            assert r.status == 503 and err["code"] == "service_unavailable" and "prefill" in err["message"]
        async with s.get("/metrics") as r:
            assert r.status == 200 and 'mooncaked_conductor_rejections_total{reason="unavailable"}' in await r.text()


def test_status_table_maps_rejection_and_unavailability():
    assert api_error(errors.Rejected("TTFT SLO", "ttft_slo")).status == 429
    assert api_error(errors.NoInstance("none", "prefill")).status == 503
    assert api_error(errors.BadRequest("bad")).status == 400
    too_long = api_error(errors.too_long(9, 8))  # OpenAI's code, as the token-id check gives it
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded") and "9 tokens" in too_long.message
    assert api_error(errors.PeerFailed("boom", "p1", "internal")).status == 500


async def test_kv_indexer_query_register_unregister(cluster, http):
    model = _model(cluster)
    ids = random_prompts([14], seed=72)[0]  # 3 full blocks of 4
    async with http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1}) as r:
        assert r.status == 200
    await asyncio.sleep(0.8)
    q = {"model": model, "token_ids": ids, "block_size": 4}
    async with http.post("/query", json=q) as r:
        answer = await r.json()
    p1 = answer["default"]["p1"]
    assert p1["longest_matched"] == 12 and p1["CPU"] == 12 and p1["GPU"] == 0 and p1["DP"] == {"0": 12}
    assert "d1" in answer["default"]
    assert "store" not in answer["default"], "a conductor without a store master lists no pool"
    async with http.post("/query", json={**q, "token_ids": [9] + ids[1:]}) as r:
        assert (await r.json())["default"]["p1"]["longest_matched"] == 0
    hashes = block_hashes(ids, 4)
    async with http.post("/query_by_hash", json={"model": model, "seq_hashes": hashes, "block_size": 4}) as r:
        assert (await r.json())["default"]["p1"]["longest_matched"] == 12
    for bad, param in (({**q, "block_size": 16}, "block_size"), ({**q, "model": "x"}, "model"),
                       ({**q, "token_ids": "t5"}, "token_ids"), ({"model": model, "block_size": 4}, "token_ids"),
                       ({**q, "lora_name": "sql"}, "lora_name"), ({**q, "token_ids": [-1]}, "token_ids")):
        async with http.post("/query", json=bad) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param, bad

    reg = {"endpoint": "tcp://10.0.0.9:5557", "type": "vLLM", "modelname": model, "instance_id": "ext-1",
           "block_size": 4, "dp_rank": 0}
    for bad, param in (({**reg, "block_size": 8}, "block_size"), ({**reg, "instance_id": "p1"}, "instance_id"),
                       ({**reg, "instance_id": "store"}, "instance_id"),  # the KV pool's name in the index
                       ({k: v for k, v in reg.items() if k != "endpoint"}, "endpoint"),
                       ({**reg, "dp_rank": -1}, "dp_rank"), ({**reg, "modelname": "x"}, "modelname")):
        async with http.post("/register", json=bad) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param, bad
    async with http.post("/register", json=reg) as r:
        assert await r.json() == {"status": "registered successfully", "instance_id": "ext-1"}
    async with http.post("/query", json=q) as r:
        assert (await r.json())["default"]["ext-1"]["longest_matched"] == 0
    event = {"event_type": "stored", "instance_id": "ext-1", "medium": "disk", "seq_hashes": hashes[:2]}
    async with http.post("/events", json={"events": [event]}) as r:
        assert r.status == 200, await r.text()
    async with http.post("/query", json=q) as r:
        ext = (await r.json())["default"]["ext-1"]
    assert ext["longest_matched"] == 8 and ext["DISK"] == 8 and ext["CPU"] == 0
    async with http.post("/unregister", json={"instance_id": "ext-1"}) as r:
        assert (await r.json())["removed_instances"] == ["ext-1|default|0"]
    async with http.post("/query", json=q) as r:
        assert "ext-1" not in (await r.json())["default"]
    async with http.post("/unregister", json={"instance_id": "ext-1"}) as r:
        assert r.status == 404
    async with http.post("/events", json={"events": [event]}) as r:
        assert r.status == 400  # no longer registered


async def test_metrics_show_latency_of_both_fronts(cluster, http):
    await _grpc_text(cluster, prompt="t40 t41", raw=True)
    async with http.post("/v1/completions", json={"model": _model(cluster), "prompt": "t40 t41", "max_tokens": 4,
                                                  "ignore_eos": True}) as r:
        assert r.status == 200
    running = 'mooncaked_conductor_instance_running_requests{instance="p1",role="prefill"}'
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # an instance's load comes with its heartbeats: the one after the request says 0
        async with http.get("/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        if samples.get(running) == 0 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    for front in ("http", "grpc"):
        assert samples[f'mooncaked_conductor_ttft_seconds_count{{front="{front}"}}'] >= 1
        assert samples[f'mooncaked_conductor_tbt_seconds_count{{front="{front}"}}'] >= 1
    assert 'mooncaked_conductor_ttft_seconds_bucket{front="http",le="0.5"}' in samples
    assert samples[running] == 0
    prompt, cached = (samples[f"mooncaked_conductor_{n}_total"] for n in ("prompt_tokens", "cached_prompt_tokens"))
    assert prompt > 0 and samples["mooncaked_conductor_prefix_hit_rate"] == pytest.approx(cached / prompt)


async def test_a_starting_conductor_says_so_and_holds_requests(tiny_model_factory, tmp_path):
    """A conductor that has had no prefill and decode yet, within --ready-timeout-s: /health answers
    503 "starting", Status says so, and requests wait (here until the client gives up) instead of
    being refused at once. (The keyed conductor above shows the refusal once the window is over.)"""
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path)
    try:
        c.start("patient", "conductor", "--ready-timeout-s", "600")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{c.http_port('patient')}", timeout=TIMEOUT) as s:
            async with s.get("/health") as r:
                assert (r.status, await r.json()) == (503, {"status": "starting", "prefill": 0, "decode": 0})
            body = {"model": _model(c), "prompt": "t5", "max_tokens": 2}
            with pytest.raises(asyncio.TimeoutError):  # held, not answered 503
                async with s.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    await r.read()
        req = conductor_pb2.GenerateRequest(prompt="t5", sampling=common_pb2.SamplingParams(max_tokens=2))
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            st = await stub.Status(conductor_pb2.StatusRequest(), timeout=5)
            assert (st.conductor.state, st.conductor.ready_timeout_s) == ("starting", 600)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(req, timeout=1):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        c.stop()
