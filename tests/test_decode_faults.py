"""Waiting instead of failing, and surviving a lost decode instance (issue 12).

- A decode instance out of KV room makes requests wait, not fail: three 8,000-token prompts on a
  decode that holds two complete.
- A reservation lives while it is renewed and only then: the decode side's Reserve / Renew /
  Abort rules, on a real engine behind a real gRPC server.
- `kill -9` of the only decode under 30 concurrent streams, restarted at once: every request not
  yet past its first token completes, broken streams end with an error naming the decode, none
  hangs, and new requests succeed soon after it registers again (the time is printed).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import grpc
import pytest

from cluster import Cluster
from mooncaked.conductor.decode_lease import DecodeLease
from mooncaked.conductor.engine_link import Reservation, TransferEndpoint
from mooncaked.conductor.grpc_engine import GrpcEngineLink
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.registry import Instance
from mooncaked.conductor.router import SchedulerState, _Seq, predict_kv_wait
from mooncaked.engine import Engine
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc
from mooncaked.instance.kv_push import KV_REGION
from mooncaked.roles.worker import WorkerService
from mooncaked.transfer import TransferEngine
from tiny_models import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(600)

LONG = 8000          # prompt tokens
LONG_OUT = 8         # tokens generated for each
TOKEN_BYTES = 512    # KV bytes per token of the tiny model: 2 layers x (K, V) x 2 heads x 16 dims x fp32


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny model whose context holds an 8,000-token prompt."""
    _, folder = make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2-long"), max_position_embeddings=16384)
    return folder


def _request(ids: list[int], max_tokens: int) -> conductor_pb2.GenerateRequest:
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# -- waiting for decode KV room ------------------------------------------------------------------
async def test_three_long_prompts_on_a_decode_that_holds_two_all_complete(long_model, tmp_path):
    # the decode holds two prompts (with their output) and a quarter more: never three
    decode_kv = int(2.25 * (LONG + LONG_OUT) * TOKEN_BYTES)
    c = Cluster(long_model, tmp_path)
    try:
        c.start("conductor", "conductor")
        c.start("p1", "prefill", "--kv-cache-bytes", str(40 << 20))
        c.start("d1", "decode", "--kv-cache-bytes", str(decode_kv))
        c.wait_serving(["p1", "d1"])
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            st = await stub.Status(conductor_pb2.StatusRequest(), timeout=10)
            d1 = next(i for i in st.instances if i.name == "d1")
            assert 2 * LONG <= d1.load.total_kv_blocks * 4 < 3 * LONG, "the decode must hold two prompts, not three"
            prompts = random_prompts([LONG] * 3, seed=7)
            start = time.monotonic()

            async def one(ids):
                chunks = [ch async for ch in stub.Generate(_request(ids, LONG_OUT), timeout=400)]
                return time.monotonic() - start, chunks

            results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"requests failed: {errors}\n{c.log('conductor')[-3000:]}"
        for seconds, chunks in results:
            assert sum(len(x.token_ids) for x in chunks) == LONG_OUT and chunks[-1].finish_reason == "length"
        print(f"3 x {LONG}-token prompts on a decode holding 2: done after "
              f"{', '.join(f'{s:.1f}' for s, _ in sorted(results, key=lambda r: r[0]))} s")
        # the third really had to wait for room (not merely arrive after the others finished)
        assert "no decode KV room" in c.log("conductor")
    finally:
        c.stop()


def test_predicted_wait_for_kv_room_counts_the_sequences_that_finish_first():
    state = SchedulerState(make_policy("mooncake"))
    layout = KVLayout(num_layers=2, num_blocks=100, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32",
                      element_size=4)
    d = Instance("d1", "decode", "127.0.0.1:1", "m", layout, common_pb2.TransferEndpoint(),
                 load=common_pb2.InstanceLoad(free_kv_blocks=2, total_kv_blocks=100))
    assert predict_kv_wait(state, d, 8) == 0.0  # two free blocks hold 8 tokens: no wait
    assert predict_kv_wait(state, d, 100) is None  # nothing this conductor routed there will free room
    state.seqs["a"] = _Seq("d1", context=40, remaining=50, joins_at_s=0.0)   # frees 90 tokens after 50 steps
    state.seqs["b"] = _Seq("d1", context=400, remaining=10, joins_at_s=0.0)  # frees 410 tokens after 10 steps
    step = state.model("d1").decode.predict(2, 440)
    assert predict_kv_wait(state, d, 100) == pytest.approx(10 * step)  # b's end makes room
    assert predict_kv_wait(state, d, 500) == pytest.approx(50 * step)  # a's end too
    assert predict_kv_wait(state, d, 1000) is None  # never, on what is known


# -- the decode side of a reservation -------------------------------------------------------------
async def test_reservation_lives_while_renewed_and_aborts_win_races(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    transfer = TransferEngine(backend="tcp", host="127.0.0.1", port=0)
    engine = Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=64 * 1024,
                                    kv_pool_alloc=lambda n: transfer.alloc_region(KV_REGION, n))
    loop = asyncio.get_running_loop()
    engine.start_driver(loop)
    await transfer.start()
    service = WorkerService("d-test", "decode", engine, transfer, folder.name, reservation_ttl_s=1.5)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    expiry = asyncio.ensure_future(service.expire_reservations())
    total = engine.block_manager.num_blocks
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)

            async def reserve(rid: str, n: int):
                return await stub.Reserve(engine_pb2.ReserveRequest(request_id=rid, prompt_token_ids=[5] * n,
                                                                    sampling=common_pb2.SamplingParams(max_tokens=4)),
                                          timeout=10)

            # a prompt this instance can never hold is OUT_OF_RANGE (waiting would never end) ...
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reserve("huge", total * 4 + 4)
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            # ... one that does not fit now is RESOURCE_EXHAUSTED ("no room now": the conductor waits)
            held = await reserve("held", (total - 2) * 4)
            assert held.ttl_s == 1.5
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reserve("later", 16)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # renewed by the conductor's lease (as while its prefill runs), it outlives its TTL several times
            link = GrpcEngineLink(f"127.0.0.1:{port}")
            decode = Instance("d-test", "decode", f"127.0.0.1:{port}", folder.name, service.layout, link=link)
            lease = DecodeLease(decode, "held", Reservation(list(held.block_ids), TransferEndpoint(), service.layout,
                                                            held.ttl_s))
            lease.start()
            await asyncio.sleep(5 * 1.5)
            assert "held" in service.reserved
            # left alone (the lease stops: its prefill instance could not confirm it stopped), it is given back
            lease.stop()
            for _ in range(200):
                if "held" not in service.reserved:
                    break
                await asyncio.sleep(0.1)
            assert "held" not in service.reserved
            assert not (await stub.Renew(engine_pb2.RenewRequest(request_id="held"), timeout=5)).found
            assert engine.block_manager.num_free_blocks == total
            # an Abort that overtakes its Reserve (a cancelled call still in flight) wins
            reply = await stub.Abort(engine_pb2.AbortRequest(request_id="overtaken"), timeout=5)
            assert not reply.found and reply.ended
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reserve("overtaken", 8)
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert engine.block_manager.num_free_blocks == total
            await link.close()
    finally:
        expiry.cancel()
        await server.stop(0)
        await transfer.close()
        engine.close()


# -- a lost decode --------------------------------------------------------------------------------
STREAMS = 30
HTTP_STREAMS = 5  # of the 30, these go through the HTTP front (SSE)
OUT = 48


async def _grpc_request(stub, ids: list[int], out: int) -> dict:
    rec = {"front": "grpc", "start": time.monotonic(), "first": None, "ok": False, "error": None, "decode": None}
    try:
        n = 0
        async for chunk in stub.Generate(_request(ids, out), timeout=120):
            if rec["first"] is None:
                rec["first"], rec["decode"] = time.monotonic(), chunk.decode_instance
            n += len(chunk.token_ids)
        rec["ok"] = n == out
    except grpc.aio.AioRpcError as e:
        rec["error"] = (e.code().name, e.details())
    rec["end"] = time.monotonic()
    return rec


async def _http_request(session: aiohttp.ClientSession, url: str, model: str, ids: list[int], out: int) -> dict:
    rec = {"front": "http", "start": time.monotonic(), "first": None, "ok": False, "error": None, "decode": None}
    body = {"model": model, "prompt": ids, "max_tokens": out, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
            if resp.status != 200:
                rec["error"] = (str(resp.status), await resp.text())
            else:
                n, done = 0, False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec["error"] = ("sse", obj["error"].get("message", ""))
                        continue
                    if rec["first"] is None:
                        rec["first"] = time.monotonic()
                    n += sum(1 for c in obj["choices"] if c.get("text") is not None)
                rec["ok"] = done and rec["error"] is None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec["error"] = ("client", repr(e))
    rec["end"] = time.monotonic()
    return rec


async def test_kill_9_of_the_only_decode_under_load_loses_no_request_before_its_first_token(tiny_model_factory,
                                                                                            tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path)
    try:
        c.start("conductor", "conductor")
        http_port = c.http_port("conductor")
        for name in ("p1", "p2"):
            c.start(name, "prefill")
        d1_port = c.start("d1", "decode")
        c.wait_serving(["p1", "p2", "d1"])
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        rng = random.Random(3)
        records: list[dict] = []
        stop_at: list[float] = []
        timeline: dict[str, float] = {}

        async with grpc.aio.insecure_channel(c.conductor) as ch, aiohttp.ClientSession() as session:
            stub = conductor_pb2_grpc.ConductorStub(ch)

            async def client(i: int) -> None:
                while not stop_at or time.monotonic() < stop_at[0]:
                    # long outputs keep streams mid-decode; short ones keep requests in reserve and prefill
                    ids = [rng.randrange(3, 256) for _ in range(rng.randrange(8, 200))]
                    out = OUT if i % 2 else 2
                    rec = await (_http_request(session, url, folder.name, ids, out) if i < HTTP_STREAMS
                                 else _grpc_request(stub, ids, out))
                    records.append(rec)

            async def watch_registration() -> None:
                # when d1 serves again after the kill: its re-registration, as the conductor sees it
                while "reregistered" not in timeline:
                    st = await stub.Status(conductor_pb2.StatusRequest(without_pool_stats=True), timeout=5)
                    d1 = next((i for i in st.instances if i.name == "d1"), None)
                    if "restart" in timeline and d1 is not None and d1.state == common_pb2.INSTANCE_STATE_SERVING \
                            and c.procs["d1"].poll() is None and "registered with conductor" in c.log("d1"):
                        timeline["reregistered"] = time.monotonic()
                    await asyncio.sleep(0.05)

            clients = [asyncio.ensure_future(client(i)) for i in range(STREAMS)]
            await asyncio.sleep(4)  # load settles: streams run on d1
            timeline["kill"] = time.monotonic()
            c.kill("d1")
            c.procs["d1"].wait(10)
            await asyncio.sleep(2)
            timeline["restart"] = time.monotonic()
            watcher = asyncio.ensure_future(watch_registration())
            c.start("d1", "decode", "--listen", f"127.0.0.1:{d1_port}")  # same address, as systemd restarts it
            await asyncio.wait_for(watcher, 120)
            await asyncio.sleep(4)  # traffic after the return
            stop_at.append(time.monotonic())
            await asyncio.wait_for(asyncio.gather(*clients), 200)  # every client call has its own timeout too

        kill, back = timeline["kill"], timeline["reregistered"]
        spanning = [r for r in records if r["start"] < kill < r["end"]]
        # not yet past their first token when d1 died (in flight before it, or sent while it was gone): their
        # first token comes after d1 is back (one that arrives between kill and return left d1 before it died)
        before_first = [r for r in records if r["start"] < back and r["end"] > kill
                        and (r["first"] is None or r["first"] >= back)]
        broken = [r for r in records if not r["ok"]]
        summary = (f"{len(records)} requests; {len(spanning)} in flight at the kill; {len(before_first)} not yet "
                   f"past their first token at the kill or sent before d1 was back; {len(broken)} broken: "
                   f"{[r['error'] for r in broken][:3]}")
        print(summary)
        # every request not yet past its first token completes (it waited for d1, or was prefilled again)
        lost = [r for r in records if not r["ok"] and (r["first"] is None)]
        assert not lost, (f"{len(lost)} requests failed before their first token: {[r['error'] for r in lost][:5]}; "
                          f"d1 restarted {timeline['restart'] - kill:.1f} s and registered again {back - kill:.1f} s "
                          f"after the kill; the lost were sent at {[round(r['start'] - kill, 1) for r in lost]} s")
        assert before_first and all(r["ok"] for r in before_first), summary
        # broken streams end with an error event naming the decode; nothing timed out (hung)
        for r in broken:
            assert r["error"] is not None and "d1" in r["error"][1], (r, summary)
        assert not [r for r in records if r["error"] and ("DEADLINE" in r["error"][0] or "Timeout" in r["error"][1])]
        after = sorted((r for r in records if r["start"] >= back), key=lambda r: r["start"])
        assert after and all(r["ok"] for r in after), f"requests after d1 came back failed: {after[:3]}"
        first_ok = min(r["end"] for r in records if r["ok"] and r["end"] >= back)
        print(f"kill -9 d1 at 0.0 s, restarted at {timeline['restart'] - kill:.1f} s, registered again at "
              f"{back - kill:.1f} s; first request completed {first_ok - back:.2f} s after re-registration; "
              f"the first request sent after it took {after[0]['end'] - after[0]['start']:.2f} s")
        log = c.log("conductor")
        print(f"conductor: {log.count('prefilling it again')} requests prefilled again after losing d1 before their "
              f"first token, {log.count('KV push of')} KV pushes to the dead d1 failed and were routed again")
    finally:
        c.stop()
