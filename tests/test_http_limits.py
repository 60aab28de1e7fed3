"""A conductor no HTTP client can stall (issue 12): bodies and prompts bounded before any work,
prompts tokenized off the event loop while heartbeats keep flowing, partial requests dropped,
connections capped, and malformed text a 400, never a 500.

The cluster is real processes (conductor, one prefill, one decode) with the HTTP limits set
small so the tests see them act; timings are printed, never asserted."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import socket
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from cluster import Cluster
from mooncaked.conductor.json_body import MAX_DEPTH, decode_json
from mooncaked.conductor.openai_schema import ApiError, ServedModel, parse_completion
from mooncaked.conductor.prompt_tokenizer import PromptTokenizer, TextTooLong, chars_per_token
from mooncaked.engine.tokenizer import Tokenizer
from mooncaked.proto.mooncake.v1 import common_pb2

pytestmark = pytest.mark.timeout(300)

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 300
CAP = 50  # of the second conductor (no engines), whose silent connections wait long: the cap test's
TIMEOUT = aiohttp.ClientTimeout(total=60)


# -- the character bound: never refuses a prompt that fits ---------------------------------------------
def _bpe_folder(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer (the kind real models use) trained here on mixed text."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "    indented    code = 1\n" * 30,
              "========================================\n" * 10, "naïve café über straße 東京 日本語 " * 20]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end|>", "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end|>"
                                                 "{% endfor %}assistant:"}))
    return tmp_path


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = [" ", "    ", "\n", "=", "the ", "quick", "東京", "é", "e\u0301", "🙂", "<|end|>", "x" * 7, "\t"]
    return ["".join(rng.choice(pieces) * rng.randint(1, 60) for _ in range(rng.randint(1, 200))) for _ in range(300)]


def test_the_character_bound_never_refuses_a_prompt_that_fits(tmp_path):
    folder = _bpe_folder(tmp_path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bound = chars_per_token(spec)
    assert bound is not None and bound >= 1
    tok = Tokenizer(folder)
    worst = 0.0
    for text in _texts(1):
        n = len(tok.encode(text))
        worst = max(worst, len(text) / n)
        assert len(text) <= n * bound, (text[:80], n, bound)
    print(f"chars per token: at most {worst:.1f} seen, bound {bound:g}")


def test_the_character_bound_is_none_where_a_token_can_swallow_any_text(tmp_path, tiny_model_factory):
    _, tiny = tiny_model_factory("llama")
    assert chars_per_token(json.loads((tiny / "tokenizer.json").read_text())) is None  # word-level + [UNK]
    spec = json.loads((_bpe_folder(tmp_path) / "tokenizer.json").read_text())
    for normalizer in ({"type": "Strip", "strip_left": True, "strip_right": True},
                       {"type": "Replace", "pattern": {"String": " "}, "content": ""},
                       {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "StripAccents"}]}):
        assert chars_per_token({**spec, "normalizer": normalizer}) is None, normalizer
    assert chars_per_token({**spec, "pre_tokenizer": {"type": "WhitespaceSplit"}}) is None
    lstrip = [{**t, "lstrip": True} for t in spec["added_tokens"]]
    assert chars_per_token({**spec, "added_tokens": lstrip}) is None
    plain = chars_per_token(spec)
    assert chars_per_token({**spec, "normalizer": {"type": "NFC"}}) == 4 * plain  # composition shrinks text


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(tmp_path):
    folder = _bpe_folder(tmp_path)
    prompts = PromptTokenizer.for_model(Tokenizer(folder), folder, max_context=64)
    assert prompts.max_chars is not None
    fits = "the quick brown fox"
    assert await prompts.encode(fits) == Tokenizer(folder).encode(fits)
    with pytest.raises(TextTooLong, match="too long: .* characters cannot fit"):
        await prompts.encode("x" * (prompts.max_chars + 1))
    with pytest.raises(TextTooLong, match="conversation is too long"):
        await prompts.encode_chat([{"role": "user", "content": "x" * (prompts.max_chars + 1)}])
    prompts.close()


# -- malformed text ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, says", [
    (b'{"prompt": "\\ud800"}', "prompt holds a lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}', "messages[0].content holds a lone"),
    (b'{"stop": ["ok", "\\uDBFF"]}', "stop[1] holds a lone"),
    (b'{"x\\ud800": 1}', "key"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested too deep"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_malformed_text_is_a_400(raw, says):
    with pytest.raises(ApiError) as e:
        decode_json(raw)
    assert e.value.status == 400 and says in e.value.message, e.value.message


def test_paired_surrogates_and_plain_nesting_pass():
    assert decode_json(b'{"prompt": "\\ud83d\\ude00", "x": [[[1]]]}') == {"prompt": "\U0001F600", "x": [[[1]]]}


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty", "max_tokens",
                                   "seed", "top_k", "logprobs", "n"])
def test_huge_numbers_are_a_400(field):
    served = ServedModel(("m",), 512, 256)
    for value in (10 ** 400, -(10 ** 400), 1e308 * 10):
        with pytest.raises(ApiError) as e:
            parse_completion({"model": "m", "prompt": "t1", field: value}, served)
        assert e.value.status == 400 and e.value.param == field


def test_a_long_token_id_list_is_refused_by_its_length():
    served = ServedModel(("m",), 512, 256)
    with pytest.raises(ApiError, match="has 600 tokens; the model's context is 512"):
        parse_completion({"model": "m", "prompt": [1] * 600}, served)


# -- a real cluster -----------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    _, folder = tiny_model_factory("llama")
    logs = tmp_path_factory.mktemp("http-limits-logs")
    c, capped = Cluster(folder, logs), Cluster(folder, logs)
    c.capped = capped
    try:
        capped.start("capped", "conductor", "--http", "127.0.0.1:0", "--http-header-timeout-s", "60",
                     "--http-max-connections", str(CAP))
        c.start("conductor", "conductor", "--http", "127.0.0.1:0",
                "--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                "--http-idle-timeout-s", str(IDLE_TIMEOUT_S), "--http-max-connections", str(MAX_CONNECTIONS))
        c.http_at = ("127.0.0.1", c.http_port("conductor"))
        c.http = "http://%s:%d" % c.http_at
        c.start("p1", "prefill")
        c.start("d1", "decode")
        c.wait_serving(["p1", "d1"])
        c.pid = c.procs["conductor"].pid
        capped.http_at = ("127.0.0.1", capped.http_port("capped"))
        yield c
    finally:
        c.stop()
        capped.stop()


@pytest.fixture
async def http(cluster):
    # a fresh connection per request: a test's error answer that closes its connection touches no other
    async with aiohttp.ClientSession(cluster.http, timeout=TIMEOUT,
                                     connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


def _none_dead(cluster) -> None:
    states = {i.name: i.state for i in cluster.status().instances}
    assert states == {"p1": common_pb2.INSTANCE_STATE_SERVING, "d1": common_pb2.INSTANCE_STATE_SERVING}, states
    assert "marked dead" not in cluster.log("conductor")


class HealthProbe:
    """Asks /health every 50 ms while a test works, and keeps each latency."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http, self.latencies, self.statuses = http, [], []

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            async with self.http.get("/health") as r:
                await r.read()
                self.statuses.append(r.status)
            self.latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)

    def report(self, what: str) -> str:
        lat = sorted(self.latencies)
        return (f"{what}: /health answered {len(lat)} times, median {lat[len(lat) // 2] * 1e3:.0f} ms, "
                f"max {lat[-1] * 1e3:.0f} ms")


async def test_a_body_over_the_limit_is_a_quick_413_and_leaves_no_memory_behind(cluster, http):
    model = cluster.model.name
    async with http.post("/v1/completions", json={"model": model, "prompt": "t1 t2", "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()  # warm: the first request's imports and buffers
    start_rss = _rss_mb(cluster.pid)
    probe = HealthProbe(http)
    task = asyncio.create_task(probe.run())
    big = json.dumps({"model": model, "prompt": "t1 " * (2 << 20), "max_tokens": 2}).encode()  # 6 MiB
    for chunked in (False, True):
        t = time.perf_counter()
        body = _chunks(big) if chunked else big  # chunked: no Content-Length, so read up to the limit, then cut
        async with http.post("/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
            status, answer = r.status, await r.json()
        took = time.perf_counter() - t
        print(f"{len(big) / 2**20:.0f} MiB body ({'chunked' if chunked else 'with Content-Length'}): "
              f"{status} in {took:.2f} s")
        assert status == 413, answer
        assert "--max-request-bytes" in answer["error"]["message"] and str(4 << 20) in answer["error"]["message"]
    await asyncio.sleep(0.5)
    task.cancel()
    print(probe.report("during the 6 MiB bodies"))
    assert probe.statuses and set(probe.statuses) == {200}
    end_rss = _rss_mb(cluster.pid)
    print(f"conductor RSS {start_rss:.0f} MB before, {end_rss:.0f} MB after")
    assert end_rss - start_rss < 100
    _none_dead(cluster)


async def _chunks(data: bytes):
    for i in range(0, len(data), 1 << 16):
        yield data[i:i + (1 << 16)]


async def test_big_allowed_prompts_do_not_starve_heartbeats(cluster, http):
    """Prompts of 1 MiB, tokenized (this word-level tokenizer has no character bound) and then refused
    as too long, sent many at once while the engines' heartbeats (every 0.3 s, dead after 2 s) keep
    coming. Tokenized on the event loop, as before, they stalled it ~1 s each: engines marked dead."""
    model = cluster.model.name
    text = "t1 " * ((1 << 20) // 3)  # 350k tokens
    chat = [{"role": "user", "content": text}]
    start_rss = _rss_mb(cluster.pid)
    probe = HealthProbe(http)
    task = asyncio.create_task(probe.run())

    async def one(i: int) -> tuple[int, dict, float]:
        t = time.perf_counter()
        path, body = (("/v1/completions", {"model": model, "prompt": text, "max_tokens": 2}) if i % 2 else
                      ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 2}))
        async with http.post(path, json=body, timeout=aiohttp.ClientTimeout(total=240)) as r:
            return r.status, (await r.json())["error"], time.perf_counter() - t

    t = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(8)))
    wall = time.perf_counter() - t
    async with http.post("/v1/completions", json={"model": model, "prompt": "t1 t2 t3", "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()  # and the cluster still serves
    task.cancel()
    for status, err, took in results:  # OpenAI's code for it, whichever check caught it
        assert status == 400 and "tokens; the model's context is 512" in err["message"], err
        assert err["code"] == "context_length_exceeded", err
    print(f"8 prompts of {len(text) / 2**20:.1f} MiB (4 chat, 4 plain): all 400 in {wall:.2f} s "
          f"(each {min(r[2] for r in results):.2f}-{max(r[2] for r in results):.2f} s)")
    print(probe.report("while tokenizing"))
    end_rss = _rss_mb(cluster.pid)
    print(f"conductor RSS {start_rss:.0f} MB before, {end_rss:.0f} MB after")
    assert end_rss - start_rss < 100
    _none_dead(cluster)


async def test_a_long_token_id_list_is_refused_at_once(cluster, http):
    async with http.post("/v1/completions", json={"model": cluster.model.name, "prompt": [1] * 500_000}) as r:
        answer = await r.json()
        assert r.status == 400 and "has 500000 tokens" in answer["error"]["message"], answer


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "M", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "M", "prompt": "t1", "stop": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "t1\\udbff"}]}]}'),
    ("/v1/completions", b'{"model": "M", "prompt": "t1 \xc3\x28"}'),
    ("/v1/completions", b'{"model": "M", "prompt": "t1", "temperature": ' + b"9" * 400 + b"}"),
    ("/v1/completions", b'{"model": "M", "prompt": "t1", "seed": ' + b"9" * 5000 + b"}"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/query", b'{"model": "M", "block_size": 4, "token_ids": [1], "tenant_id": "\\ud800"}'),
    ("/register", b'{"modelname": "M", "block_size": 4, "instance_id": "x", "dp_rank": ' + b"9" * 300 + b"}"),
])
async def test_malformed_text_over_http_is_a_400(cluster, http, path, body):
    async with http.post(path, data=body.replace(b'"M"', json.dumps(cluster.model.name).encode()),
                         headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
    assert r.status == 400, text
    assert json.loads(text)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("encoding, body", [
    ("gzip", b"\x1f\x8b\x08\x00 not gzip at all"),
    # cut off; mtime=0: the bytes (and so the test's id) must not change with the second it was collected in,
    # or two xdist workers collect different tests
    ("gzip", gzip.compress(b'{"model": "m", "prompt": "t1"}', mtime=0)[:-12]),
    ("deflate", b"\x00\x01\x02 not deflate"),
], ids=["gzip-garbage", "gzip-cut-off", "deflate-garbage"])
async def test_a_body_that_does_not_decode_is_a_400(cluster, http, encoding, body):
    async with http.post("/v1/completions", data=body, headers={"Content-Encoding": encoding,
                                                                "Content-Type": "application/json"}) as r:
        text = await r.text()
    assert r.status == 400 and "request body" in json.loads(text)["error"]["message"], text
    async with http.get("/health") as r:
        assert r.status == 200
    assert "Traceback" not in cluster.log("conductor")


async def test_a_gzip_body_is_read(cluster, http):
    body = gzip.compress(json.dumps({"model": cluster.model.name, "prompt": "t1 t2", "max_tokens": 2}).encode())
    async with http.post("/v1/completions", data=body, headers={"Content-Encoding": "gzip",
                                                                "Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _wait_closed(socks: list[socket.socket], limit_s: float) -> tuple[int, float]:
    """How many of ``socks`` the server closed within ``limit_s``, and when the last one went."""
    for s in socks:
        s.setblocking(False)
    t, open_ = time.perf_counter(), set(range(len(socks)))
    while open_ and time.perf_counter() - t < limit_s:
        open_ -= {i for i in open_ if _closed_by_server(socks[i])}
        time.sleep(0.05)
    return len(socks) - len(open_), time.perf_counter() - t


async def test_partial_requests_are_dropped_and_others_served_meanwhile(cluster, http):
    fds_before = _fds(cluster.pid)
    socks = []
    for i in range(200):
        s = socket.create_connection(cluster.http_at)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le" if i % 2 else b"GET /hea")
        socks.append(s)
    async with http.post("/v1/completions", json={"model": cluster.model.name, "prompt": "t1 t2",
                                                  "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()  # served while the 200 half-heads are open
    closed, took = await asyncio.to_thread(_wait_closed, socks, 30 * HEADER_TIMEOUT_S)
    print(f"200 half-sent request heads: {closed} closed by the server, the last after {took:.2f} s "
          f"(--http-header-timeout-s {HEADER_TIMEOUT_S})")
    for s in socks:
        s.close()
    assert closed == 200
    await asyncio.sleep(0.5)
    print(f"conductor fds: {fds_before} before, {_fds(cluster.pid)} after")
    assert _fds(cluster.pid) <= fds_before + 5


async def test_a_body_that_stops_coming_gets_408(cluster):
    s = socket.create_connection(cluster.http_at)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    s.settimeout(30 * BODY_TIMEOUT_S)
    t = time.perf_counter()
    answer = b""
    while chunk := s.recv(4096):
        answer += chunk
    s.close()
    print(f"a stalled body: answered and closed after {time.perf_counter() - t:.2f} s "
          f"(--http-body-timeout-s {BODY_TIMEOUT_S})")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--http-body-timeout-s" in answer


async def test_an_idle_keep_alive_connection_is_closed(cluster):
    s = socket.create_connection(cluster.http_at)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200"), first
    closed, took = await asyncio.to_thread(_wait_closed, [s], 30 * IDLE_TIMEOUT_S)
    s.close()
    print(f"an idle keep-alive connection: closed after {took:.2f} s (--http-idle-timeout-s {IDLE_TIMEOUT_S})")
    assert closed == 1


async def test_connections_over_the_cap_are_refused_without_taking_the_server_down(cluster):
    capped = cluster.capped
    pid, at = capped.procs["capped"].pid, capped.http_at
    fds_before = _fds(pid)
    held = [socket.create_connection(at) for _ in range(CAP)]
    deadline = time.monotonic() + 60
    while _fds(pid) < fds_before + CAP and time.monotonic() < deadline:  # until the server took them all
        await asyncio.sleep(0.05)
    fds_at_cap = _fds(pid)
    answers = []
    for _ in range(3 * CAP):
        with socket.create_connection(at) as s:
            s.settimeout(30)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            answers.append(data)
    fds_after_refusals = _fds(pid)
    print(f"{CAP} silent connections, then {3 * CAP} more: {sum(a.startswith(b'HTTP/1.1 503') for a in answers)} "
          f"answered 503; conductor fds {fds_before} before, {fds_at_cap} at the cap, {fds_after_refusals} after "
          "the refusals")
    assert all(a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a for a in answers), answers[0]
    assert fds_at_cap <= fds_before + CAP + 2 and fds_after_refusals <= fds_at_cap + 2
    assert "Traceback" not in capped.log("capped")
    for s in held:
        s.close()
    async with aiohttp.ClientSession(f"http://{at[0]}:{at[1]}", timeout=TIMEOUT) as http:
        for _ in range(100):  # the server notices the closed ones within a loop turn or so
            async with http.get("/v1/models") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert r.status == 200, await r.text()


async def test_grpc_generate_tokenizes_off_the_loop_too(cluster):
    from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc

    req = conductor_pb2.GenerateRequest(prompt="t1 " * 1_000_000, raw=True,
                                        sampling=common_pb2.SamplingParams(max_tokens=2))
    async with grpc.aio.insecure_channel(cluster.conductor, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=60):
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context is 512" in e.value.details()
