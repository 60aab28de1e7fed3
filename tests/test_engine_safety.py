"""No request can stop an engine (issue 12): hostile sampling settings get an answer or a 400, a NaN in
one request's logits fails that request alone, a dead engine driver takes its instance out of the
cluster and exits 1, and seeded sampling in the cluster equals one in-process engine's."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster
from mooncaked.engine import Engine, Output, RequestError, SamplingParams
from tiny_models import VOCAB, random_prompts

pytestmark = pytest.mark.timeout(300)

EXTREME_TEMPERATURES = [0.0, 1e-40, 1e-6, 1e-5, 0.3, 1.0, 2.0, 1e4, 1e30, 1e300]


# -- in-process: a real engine on a tiny model -------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(llama):
    e = Engine.from_pretrained(llama[1], block_size=4, kv_cache_bytes=4 << 20, max_num_seqs=64)
    yield e
    e.close()


INVALID = {  # one of these in a request must be refused with a RequestError, never reach a step
    "temperature": [-1.0, math.inf, math.nan], "top_p": [0.0, 1.5, math.nan], "top_k": [-1],
    "min_p": [1.5, -0.1], "presence_penalty": [2.5, math.inf], "frequency_penalty": [-2.5],
    "repetition_penalty": [0.0, math.inf], "seed": [-1, 2**64], "stop": [[""]], "stop_token_ids": [[-1]],
    "top_logprobs": [21],
}


def _random_params(rng: random.Random) -> dict:
    """Sampling settings as a hostile or careless client sends them: valid but often extreme, and
    now and then one value out of range."""
    kw: dict = {"max_tokens": rng.choice([1, 1, 2, 3, 5, 8])}
    pick = rng.random
    if pick() < 0.8:
        kw["temperature"] = rng.choice(EXTREME_TEMPERATURES + [rng.uniform(0, 3)])
    if pick() < 0.4:
        kw["top_p"] = rng.choice([1e-45, 1e-9, 1e-6, 0.01, 0.5, 0.999, 1.0, rng.random() or 1.0])
    if pick() < 0.4:
        kw["top_k"] = rng.choice([0, 1, 2, 5, VOCAB - 1, VOCAB, 10**9])
    if pick() < 0.4:
        kw["min_p"] = rng.choice([0.0, 1e-9, 0.5, 0.999, 1.0, rng.random()])
    for name in ("presence_penalty", "frequency_penalty"):
        if pick() < 0.3:
            kw[name] = rng.choice([-2.0, -1.999, 0.0, 2.0, rng.uniform(-2, 2)])
    if pick() < 0.3:
        kw["repetition_penalty"] = rng.choice([1e-40, 1e-6, 0.5, 1.0, 2.0, 1e6, 1e38, 1e300])
    if pick() < 0.4:
        kw["seed"] = rng.choice([0, 1, 7, 2**63 - 1, 2**64 - 1, rng.randint(0, 2**64 - 1)])
    if pick() < 0.3:
        kw["stop"] = rng.choice([["t5"], ["t1", "t2 t3"], [" "], ["t"], "t9"])
    if pick() < 0.2:
        kw["stop_token_ids"] = rng.choice([[2], list(range(VOCAB)), [VOCAB + 5], [0, 1]])
    if pick() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if pick() < 0.3:
        kw["logprobs"] = True
        kw["top_logprobs"] = rng.choice([0, 1, 5, 20])
    if pick() < 0.3:
        kw["ignore_eos"] = True
    if pick() < 0.15:
        name = rng.choice(sorted(INVALID))
        kw[name] = rng.choice(INVALID[name])
        if name == "top_logprobs":
            kw["logprobs"] = True
    return kw


def _run_batch(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Output]:
    """Add them all at once (so steps mix them) and step until each has its final output."""
    finals: dict[str, Output] = {}

    def keep(out: Output) -> None:
        if out.finished:
            finals[out.request_id] = out

    ids = [engine.add_request(prompt, params, sink=keep) for prompt, params in requests]
    while len(finals) < len(ids):
        engine.step()
    return [finals[i] for i in ids]


def test_a_temperature_below_the_floor_is_greedy(engine):
    prompt = random_prompts([7], seed=3)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    for t in (1e-40, 1e-300, 5e-6):
        out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, temperature=t))[0]
        assert out.finish_reason == "length" and out.token_ids == greedy.token_ids, t


def test_a_thousand_random_sampling_settings_never_stop_the_engine(engine):
    rng = random.Random(12)
    reference_prompt = random_prompts([9], seed=4)[0]
    reference = engine.generate([reference_prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    refused = answered = 0
    t0 = time.perf_counter()
    pending: list[tuple[list[int], SamplingParams]] = []
    for i in range(1000):
        kw = _random_params(rng)
        prompt = random_prompts([rng.randint(1, 24)], seed=1000 + i)[0]
        try:
            params = SamplingParams(**kw)
        except RequestError:
            refused += 1
            continue
        pending.append((prompt, params))
        if len(pending) == 48 or i == 999:
            for (p, sp), out in zip(pending, _run_batch(engine, pending)):
                # the model is sound, so no request may fail; each ends as its settings say
                assert out.finish_reason in ("stop", "length"), (sp, out)
                assert 1 <= len(out.token_ids) <= sp.max_tokens, (sp, out)
                assert all(0 <= t < VOCAB for t in out.token_ids)
                answered += 1
            pending = []
    print(f"1000 random settings: {answered} answered, {refused} refused (RequestError) "
          f"in {time.perf_counter() - t0:.1f}s")
    assert answered > 500 and refused > 50  # both kinds were really exercised
    after = engine.generate([reference_prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert after.token_ids == reference.token_ids
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_nan_logits_fail_that_request_alone(engine):
    """A NaN in one request's hidden states (as broken weights or a corrupted KV cache give) fails
    that request with an error naming the cause; the others in the same steps go on unchanged."""
    poison = VOCAB - 1  # a token only the victim's prompt holds
    prompts = random_prompts([6, 11, 5, 9], seed=21)
    for p in prompts:
        p[:] = [t if t != poison else poison - 1 for t in p]
    victim = prompts[2][:3] + [poison] + prompts[2][3:]
    params = [SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, seed=1),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=2)]
    clean = _run_batch(engine, [(p, params[i % 3]) for i, p in enumerate(prompts)])

    def poison_embedding(module, args, output):
        (input_ids,) = args
        return output.masked_fill((input_ids == poison)[:, None], float("nan"))

    handle = engine.runner.model.embed_tokens.register_forward_hook(poison_embedding)
    try:
        batch = [(p, params[i % 3]) for i, p in enumerate(prompts)]
        batch.insert(2, (victim, params[0]))
        outs = _run_batch(engine, batch)
    finally:
        handle.remove()
    failed = outs.pop(2)
    assert failed.finish_reason == "error" and "NaN" in (failed.error or ""), failed
    assert [o.token_ids for o in outs] == [o.token_ids for o in clean]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    # and the engine serves the next request as before
    assert _run_batch(engine, [(prompts[0], params[0])])[0].token_ids == clean[0].token_ids


def test_an_exception_in_a_model_run_fails_that_step_only(engine):
    prompt = random_prompts([5], seed=31)[0]
    before = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]

    def broken(layer, seqs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    engine.layer_hook = broken
    try:
        outs = engine.generate([prompt, prompt[:3]], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        engine.layer_hook = None
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("illegal memory access" in (o.error or "") for o in outs)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == before.token_ids


async def test_a_dead_driver_fails_what_waits_and_takes_no_more(llama):
    engine = Engine.from_pretrained(llama[1], block_size=4, kv_cache_bytes=4 << 20)

    class Fault(BaseException):
        """What no step catches (as a bug would raise)."""

    def fatal(layer, seqs):
        raise Fault("boom")

    deaths: list[BaseException] = []
    engine.on_driver_death = deaths.append
    engine.layer_hook = fatal
    try:
        outs = [o async for o in engine.stream([5, 6, 7], SamplingParams(max_tokens=3))]
        assert outs[-1].finish_reason == "error" and "boom" in (outs[-1].error or "")
        assert isinstance(engine.driver_failure, Fault) and deaths == [engine.driver_failure]
        from mooncaked.engine.llm_engine import EngineStoppedError

        with pytest.raises(EngineStoppedError):
            engine.add_request([5, 6], SamplingParams(max_tokens=2))
    finally:
        engine.close()


def test_sampling_settings_that_are_not_numbers_are_refused():
    for kw in (dict(temperature=math.inf), dict(temperature=math.nan), dict(top_p=math.nan), dict(min_p=math.nan),
               dict(seed=2**64), dict(top_k=True), dict(stop=5), dict(stop_token_ids="t1")):
        with pytest.raises(RequestError):
            SamplingParams(**kw)


# -- a real cluster over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(llama, tmp_path_factory):
    c = Cluster(llama[1], tmp_path_factory.mktemp("safety-logs"))
    try:
        yield c.start_serving()
    finally:
        c.stop()


def _post(c: Cluster, body: dict, timeout_s: float = 60) -> tuple[int, dict]:
    body = {"model": str(c.model), **body}
    req = urllib.request.Request(f"{c.http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def _serving(c: Cluster) -> set[str]:
    return {i.name for i in c.status().instances if i.state == 2}


def test_temperature_1e_40_over_http_gets_an_answer_and_the_next_request_too(cluster):
    status, body = _post(cluster, {"prompt": "t5 t6 t7", "max_tokens": 4, "temperature": 1e-40})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    _, greedy = _post(cluster, {"prompt": "t5 t6 t7", "max_tokens": 4, "temperature": 0})
    assert body["choices"][0]["text"] == greedy["choices"][0]["text"]
    status, body = _post(cluster, {"prompt": "t9 t10", "max_tokens": 3, "ignore_eos": True})  # sampled: EOS may come
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert _serving(cluster) == {"p1", "d1"}


def _random_body(rng: random.Random) -> dict:
    kw = _random_params(rng)
    body = {"prompt": " ".join(f"t{t}" for t in random_prompts([rng.randint(1, 12)], seed=rng.randint(0, 10**6))[0])}
    for k, v in kw.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = rng.choice(["NaN", 1e999, "hot", None])  # JSON has no inf/nan: what clients send instead
        body[k] = v
    if body.pop("logprobs", False):
        body["logprobs"] = body.pop("top_logprobs", 0)
    body.pop("top_logprobs", None)
    body.pop("min_tokens", None)
    return body


def test_hundreds_of_random_sampling_settings_over_http_get_an_answer_or_a_400(cluster):
    rng = random.Random(34)
    bodies = [_random_body(rng) for _ in range(300)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: _post(cluster, b), bodies))
    codes = [s for s, _ in results]
    print(f"300 random settings over HTTP: {codes.count(200)} x 200, {codes.count(400)} x 400 "
          f"in {time.perf_counter() - t0:.1f}s")
    for body, (status, answer) in zip(bodies, results):
        assert status in (200, 400), (body, status, answer)
    assert codes.count(200) > 100 and codes.count(400) > 10
    status, _ = _post(cluster, {"prompt": "t9 t10", "max_tokens": 3})
    assert status == 200
    assert _serving(cluster) == {"p1", "d1"}


def test_seeded_sampling_in_the_cluster_equals_one_engine(cluster):
    """The prefill draws the first token, the decode the rest: with draws a function of (seed,
    position), the split is invisible."""
    local = Engine.from_pretrained(cluster.model, block_size=4, kv_cache_bytes=4 << 20)
    try:
        for prompt, seed in (("t5 t6 t7", 7), ("t40 t41 t42 t43 t44 t45 t46 t47 t48", 7), ("t5 t6 t7", 8)):
            want = local.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                         ignore_eos=True))[0]
            status, got = _post(cluster, {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": seed,
                                          "ignore_eos": True})
            assert status == 200, got
            assert _ids(got["choices"][0]["text"]) == want.token_ids, (prompt, seed)
    finally:
        local.close()


# -- a driver that dies in a real process ---------------------------------------------------------------
def test_an_engine_whose_driver_dies_reports_dead_and_exits_1_even_under_sigterm(llama, tmp_path):
    """--debug-kill-engine-after-steps makes p1's driver die as a bug would. Requests go on through
    p2 (none hangs, none fails: the conductor retries the one p1 was holding), p1 answers gRPC health
    NOT_SERVING, and it exits 1 (systemd's Restart=on-failure restarts it); the SIGTERM sent once it
    is NOT_SERVING does not keep it from exiting."""
    c = Cluster(llama[1], tmp_path, extra_env={"MOONCAKED_DRAIN_TIMEOUT_S": "3"})
    try:
        # round robin: p1 gets every other request. A cost-aware policy may send every one to p2 with a
        # pull of p1's cached blocks (which runs no step on p1), as it did on a loaded CI machine
        c.start("conductor", "conductor", "--policy", "round_robin")
        c.http = f"http://127.0.0.1:{c.http_port('conductor')}"
        c.start("p1", "prefill", "--debug-kill-engine-after-steps", "1")
        c.start("d1", "decode")
        c.wait_serving(["p1", "d1"])
        prompt = "t40 t41 t42 t43 t44 t45 t46 t47 t48"
        status, body = _post(c, {"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        c.start("p2", "prefill")
        c.wait_serving(["p1", "p2", "d1"])
        seen: dict[str, float] = {}

        def watch() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{c.ports['p1']}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                while c.procs["p1"].poll() is None:
                    try:
                        st = stub.Check(health_pb2.HealthCheckRequest(service="mooncake.v1.Engine"), timeout=2)
                    except grpc.RpcError:
                        time.sleep(0.02)
                        continue
                    if st.status == health_pb2.HealthCheckResponse.NOT_SERVING and "not_serving" not in seen:
                        seen["not_serving"] = time.monotonic()
                        c.kill("p1", signal.SIGTERM)
                    time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for i in range(20):  # until one lands on p1 and kills its driver
            status, body = _post(c, {"prompt": prompt, "max_tokens": 3, "temperature": 0}, timeout_s=60)
            if "the engine driver died" in c.log("p1"):
                # the request p1 held was failed UNAVAILABLE at once (the conductor retries it elsewhere);
                # it must be answered, not hang
                print(f"the request p1 held when its driver died: {status} {body}")
                break
            assert status == 200, (i, body, c.log("p1")[-3000:])
        try:
            rc = c.procs["p1"].wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"p1 did not exit after its driver died: {c.log('p1')[-3000:]}")
        exited = time.monotonic()
        watcher.join(5)
        log = c.log("p1")
        assert "DebugEngineFault" in log and "the engine driver died" in log, log[-3000:]
        assert rc == 1, log[-3000:]
        assert "not_serving" in seen, "p1 never answered NOT_SERVING before it exited"
        print(f"p1: NOT_SERVING seen, SIGTERM sent, exited {exited - seen['not_serving']:.2f}s later with {rc}")
        assert _post(c, {"prompt": "t9 t10", "max_tokens": 3})[0] == 200
        assert "p1" not in _serving(c)
    finally:
        c.stop()
