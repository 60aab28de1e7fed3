"""Two conductors side by side (real processes): one prefill and one decode registered with both
(`--conductor A,B`); each conductor serves on its own with the whole picture (instances, the
engines' KV events). One conductor that stops answering delays no heartbeat to the other; one
killed (`kill -9`) under load leaves every request sent to the other succeeding; `mooncakectl
--conductor DEAD,ALIVE` answers; the killed one, restarted on its port, gets the engines back
with a snapshot of their caches. Also the pieces: the heartbeat fan-out and the flag."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import grpc
import pytest

from cluster import Cluster
from mooncaked.conductor.engine_link import REMOVED, STORED, DecodeSample, Heartbeat, KVEvent
from mooncaked.config import ConfigError, HostPort, PrefillConfig
from mooncaked.hashing import block_hashes
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from mooncaked.instance.heartbeat import HeartbeatFeed
from mooncaked.rpc import RPC_TIMEOUT_S
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(420)

SERVING = common_pb2.INSTANCE_STATE_SERVING
DRAINING = common_pb2.INSTANCE_STATE_DRAINING

# -- the pieces ------------------------------------------------------------------------------------

def _event(kind: str, *hashes: int) -> KVEvent:
    return KVEvent(kind, list(hashes), "dram", "p1")


class _Engine:
    """What the instance's heartbeat callable would drain: events queued by the test."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.cached: set[int] = set()

    def store(self, *hashes: int) -> None:
        self.cached.update(hashes)
        self.events.append(_event(STORED, *hashes))

    def remove(self, *hashes: int) -> None:
        self.cached.difference_update(hashes)
        self.events.append(_event(REMOVED, *hashes))

    def heartbeat(self) -> Heartbeat:
        events, self.events = self.events, []
        return Heartbeat("p1", events=events, decode_samples=[DecodeSample(1, 0, 0.0)])

    async def snapshot(self) -> list[KVEvent]:
        return [_event(STORED, *sorted(self.cached))] if self.cached else []


def _apply(index: set[int], hb: Heartbeat) -> None:
    """What a conductor's prefix index does with a heartbeat (stored/removed are set operations)."""
    for e in hb.events:
        (index.update if e.kind == STORED else index.difference_update)(e.block_hashes)


async def test_the_feed_gives_every_conductor_every_event_once_acknowledged():
    engine = _Engine()
    feed = HeartbeatFeed(engine.heartbeat, engine.snapshot)
    a, b = feed.subscribe("a"), feed.subscribe("b")
    index_a: set[int] = set()
    index_b: set[int] = set()
    await feed.resync(a)
    await feed.resync(b)
    engine.store(1, 2)
    hb = feed.beat(a)
    _apply(index_a, hb)
    feed.acknowledged(a, hb)
    assert index_a == {1, 2} and hb.decode_samples  # the samples of every pull since a's last beat
    assert not feed.beat(a).decode_samples[1:]  # samples go once (a lost one only thins the cost model)
    engine.store(3)
    engine.remove(1)
    lost = feed.beat(b)  # b does not answer: nothing is acknowledged, its backlog goes out again
    assert [list(e.block_hashes) for e in lost.events] == [[1, 2], [3], [1]]
    hb = feed.beat(a)
    _apply(index_a, hb)
    feed.acknowledged(a, hb)
    hb = feed.beat(b)
    _apply(index_b, hb)
    feed.acknowledged(b, hb)
    assert index_a == index_b == engine.cached == {2, 3}
    assert not feed.beat(a).events and not feed.beat(b).events


async def test_a_conductor_that_registers_us_again_starts_from_a_snapshot():
    engine = _Engine()
    feed = HeartbeatFeed(engine.heartbeat, engine.snapshot)
    a, b = feed.subscribe("a"), feed.subscribe("b")
    await feed.resync(a)
    engine.store(1, 2, 3)
    feed.acknowledged(a, feed.beat(a))
    assert not b.events  # b has not registered us: it collects nothing (it gets a snapshot)
    engine.remove(2)
    index_b: set[int] = set()
    await feed.resync(b)  # b restarted and registered us again: it dropped what it knew of us
    engine.store(4)
    hb = feed.beat(b)
    _apply(index_b, hb)
    assert index_b == engine.cached == {1, 3, 4}


async def test_a_backlog_is_bounded_and_counts_what_it_dropped():
    engine = _Engine()
    feed = HeartbeatFeed(engine.heartbeat, max_pending_events=3)
    a, b = feed.subscribe("a"), feed.subscribe("b")
    await feed.resync(a)
    await feed.resync(b)
    for h in range(5):
        engine.store(h)
    sent = feed.beat(a)  # the newest three
    assert [e.block_hashes[0] for e in sent.events] == [2, 3, 4]
    for h in range(5, 7):
        engine.store(h)
    feed.beat(b)  # while a's heartbeat is on its way, b's pull drops two of the sent ones from a's front
    feed.acknowledged(a, sent)
    assert [e.block_hashes[0] for e in a.events] == [5, 6]


def test_conductor_takes_a_list():
    cfg = PrefillConfig(conductor="10.0.0.1:50051,10.0.0.2:50051")
    assert list(cfg.conductor) == [HostPort("10.0.0.1", 50051), HostPort("10.0.0.2", 50051)]
    assert str(cfg.conductor) == "10.0.0.1:50051,10.0.0.2:50051"
    assert str(PrefillConfig().conductor) == "127.0.0.1:50051"
    for bad, why in (("10.0.0.1:1,", "empty entry"), ("a:1,a:1", "listed twice"), ("a:1,0.0.0.0:2", "real host")):
        with pytest.raises(ConfigError, match=why):
            PrefillConfig(conductor=bad)


# -- the cluster -----------------------------------------------------------------------------------

def _request(ids: list[int], max_tokens: int) -> conductor_pb2.GenerateRequest:
    return conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _generate(address: str, ids: list[int], max_tokens: int = 4) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        chunks = [c async for c in conductor_pb2_grpc.ConductorStub(ch).Generate(_request(ids, max_tokens),
                                                                                   timeout=60)]
    return [t for c in chunks for t in c.token_ids]


def _states(cluster: Cluster, conductor: str) -> dict[str, int]:
    return {i.name: i.state for i in cluster.status(conductor).instances}


async def _until(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _cached_on_p1(http: str, model: str, ids: list[int]) -> int:
    """Tokens of ``ids`` the conductor at ``http`` believes p1 holds (KV-indexer /query)."""
    async with aiohttp.ClientSession(http, timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.post("/query", json={"model": model, "token_ids": ids, "block_size": 4}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["default"].get("p1", {}).get("longest_matched", 0)


def _ctl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def cluster(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path)
    try:
        c.start("c1", "conductor")
        c.start_conductor("c2")
        c.start("p1", "prefill")
        c.start("d1", "decode")
        for conductor in (c.conductor, *c.also_conductors):
            c.wait_serving(["p1", "d1"], conductor=conductor)
        yield c
    finally:
        c.stop()


async def test_two_conductors_serve_side_by_side_and_survive_each_other(cluster, tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    model = folder.name
    c1, c2 = cluster.conductor, cluster.also_conductors[0]
    http1, http2 = (f"http://127.0.0.1:{cluster.http_port(n)}" for n in ("c1", "c2"))
    prompts = random_prompts([38, 41, 35], seed=131)

    # each serves on its own, the same greedy tokens; each learns what the other's requests cached
    assert await _generate(c1, prompts[0]) == await _generate(c2, prompts[0])
    await _generate(c1, prompts[1])
    blocks = len(block_hashes(prompts[1], 4))
    await _until(lambda: _cached_on_p1(http2, model, prompts[1]), "c2 to hear of a prompt sent through c1 only")
    assert await _cached_on_p1(http2, model, prompts[1]) == blocks * 4

    # an operator's drain through one list reaches both; an undrain in the other order frees it on both
    out = _ctl("--conductor", f"{c2},{c1}", "drain", "p1")
    assert (out.returncode, out.stdout, out.stderr) == (0, "p1: draining\n", ""), out
    assert _states(cluster, c1)["p1"] == _states(cluster, c2)["p1"] == DRAINING
    out = _ctl("--conductor", f"{c1},{c2}", "undrain", "p1")
    assert (out.returncode, out.stdout) == (0, "p1: serving\n"), out
    await _until(lambda: _states(cluster, c1)["p1"] == _states(cluster, c2)["p1"] == SERVING, "p1 serving on both")

    # c1 stops answering (SIGSTOP) with a request of its own in flight: heartbeats to it hang until their
    # deadline, those to c2 do not wait for them, and every request through c2 succeeds meanwhile
    async with grpc.aio.insecure_channel(c1) as ch:
        stranded = conductor_pb2_grpc.ConductorStub(ch).Generate(_request(prompts[2], 400), timeout=120)
        assert (await stranded.read()).token_ids
        cluster.kill("c1", signal.SIGSTOP)
        stopped = time.monotonic()
        n = 0
        while time.monotonic() - stopped < RPC_TIMEOUT_S + 3:  # past a heartbeat's deadline: c2 must not notice
            assert len(await _generate(c2, prompts[n % 2], 3)) == 3
            n += 1
        assert _states(cluster, c2) == {"p1": SERVING, "d1": SERVING}
        assert "marked dead" not in cluster.log("c2")

        # kill -9 under load: a bounded loop of requests to c2, c1 killed once a few are through
        done = []

        async def load() -> None:
            for i in range(24):
                done.append(await _generate(c2, prompts[i % 3], 3))

        loader = asyncio.ensure_future(load())
        await _until(lambda: len(done) >= 4 or loader.done(), "the first requests through c2")
        cluster.kill("c1", signal.SIGKILL)
        await asyncio.wait_for(loader, 300)  # raises if any request to c2 failed
        assert len(done) == 24 and all(len(t) == 3 for t in done)
        try:  # the stream on the dead conductor ends (with an error, unless it was through), it does not hang
            while await asyncio.wait_for(stranded.read(), 60) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    cluster.procs.pop("c1").wait(30)
    assert _states(cluster, c2) == {"p1": SERVING, "d1": SERVING}
    assert "marked dead" not in cluster.log("c2")

    # mooncakectl asks the next conductor when the first does not answer
    out = _ctl("--conductor", f"{c1},{c2}", "status")
    assert out.returncode == 0 and out.stderr == "", out
    assert out.stdout.startswith(f"conductor  {c2} ")
    assert {line.split()[0] for line in out.stdout.splitlines()[1:]} >= {"p1", "d1"}, out.stdout
    out = _ctl("--conductor", f"{c1},{c2}", "generate", "t1 t2 t3 t4 t5", "--raw", "--max-tokens", "2")
    assert out.returncode == 0 and "[2 tokens" in out.stderr, out
    out = _ctl("--conductor", f"{c1},{c2}", "drain", "d1")
    assert (out.returncode, out.stdout) == (0, "d1: draining\n") and f"not told: {c1}" in out.stderr, out
    assert _ctl("--conductor", f"{c1},{c2}", "undrain", "d1").returncode == 0
    out = _ctl("--conductor", c1, "status")
    assert out.returncode == 1 and f"no conductor answers at {c1}" in out.stderr, out

    # c1 again on its port: the engines register with it again, and it knows their caches at once (a
    # snapshot at registration: it has seen no KV event of theirs)
    cluster.start_conductor("c1-again", port=int(c1.rsplit(":", 1)[1]))
    cluster.wait_serving(["p1", "d1"], conductor=c1)
    http1 = f"http://127.0.0.1:{cluster.http_port('c1-again')}"
    await _until(lambda: _cached_on_p1(http1, model, prompts[2]), "the restarted c1 to know p1's cache")
    assert await _cached_on_p1(http1, model, prompts[2]) == len(block_hashes(prompts[2], 4)) * 4
    assert await _generate(c1, prompts[0]) == await _generate(c2, prompts[0])
    for name in ("p1", "d1"):
        assert cluster.log(name).count(f"registered with conductor {c1}") == 2, cluster.log(name)[-3000:]
