"""The conductor's core (conductor/core.py) without gRPC: the request path against real engine
instances in this process (``mooncaked.instance.Worker`` behind ``LocalEngineLink``s, see
inproc_cluster.py). A prefill instance computes the prompt and its first token and pushes its KV,
layer by layer over a real transfer engine on loopback, into the blocks the decode instance
reserved; the decode instance streams the rest. No canned answers: tokens must equal one
``Engine.generate`` of the same prompt.

The outcomes are the ones the process tests check over gRPC and HTTP (test_cluster*.py,
test_fault_injection.py, test_early_rejection.py): a dead prefill is retried on the other; a client
that leaves frees the decode's blocks; an SLO no instance can meet refuses with the typed error.
"""

from __future__ import annotations

import asyncio

import pytest

from inproc_cluster import BLOCK, KV_BYTES, Cluster, HeldPrefill, Unreachable
from mooncaked.conductor import errors
from mooncaked.conductor.core import GenerateSpec
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.engine_link import PrefillPlan
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.registry import DEAD
from mooncaked.engine import Engine, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = [7, 21, 33, 40, 5, 9, 61, 62, 63, 12, 19]  # 11 tokens: two full blocks and a partial one


# -- a cluster in one process ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[1]


@pytest.fixture(scope="module")
def reference(folder):
    """One whole engine: what a disaggregated request must answer."""
    engine = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        return engine.generate(prompt, params)[0].token_ids

    yield run
    engine.close()


@pytest.fixture
async def cluster(folder):
    c = Cluster(folder)
    yield c
    await c.close()


async def _wait_for(condition, what: str) -> None:
    """Until ``condition()`` holds: background work (an abort) has landed. Bounded only by the test's timeout."""
    while not condition():
        await asyncio.sleep(0.01)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


# -- tests -----------------------------------------------------------------------------------------
async def test_a_request_completes_with_the_tokens_of_one_engine(cluster, reference):
    await cluster.serve("p1", "prefill")
    d1 = await cluster.serve("d1", "decode")
    chunks = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(12)))]
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference(PROMPT, _params(12))
    first = chunks[0]
    assert (first.prefill_instance, first.decode_instance, first.prompt_tokens) == ("p1", "d1", len(PROMPT))
    assert first.request_id and chunks[-1].finish_reason == "length"
    # the reservation went to Decode: nothing left reserved, every block back once the stream ended
    assert not d1.reserved and d1.engine.block_manager.num_free_blocks == d1.engine.block_manager.num_blocks
    # the policy's plan travelled with the prefill call
    assert isinstance(cluster.links["p1"].plans[0], PrefillPlan)
    # a second request with the same prompt hits the prefill's prefix cache and answers the same
    again = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(12)))]
    assert [t for c in again for t in c.token_ids] == tokens
    assert again[0].cached_tokens == (len(PROMPT) // BLOCK) * BLOCK


async def test_text_prompts_are_tokenized_and_bad_ones_refused(cluster, reference):
    await cluster.serve("p1", "prefill")
    await cluster.serve("d1", "decode")
    spec = GenerateSpec(prompt="t7 t21 t33 t40 t5", raw=True, sampling=_params(4))
    tokens = [t for c in [c async for c in cluster.conductor.generate(spec)] for t in c.token_ids]
    assert tokens == reference([7, 21, 33, 40, 5], _params(4))
    for bad, words in ((GenerateSpec(prompt=""), "empty"), (GenerateSpec(), "give a prompt"),
                       (GenerateSpec(token_ids=[1] * 600), "context"), (GenerateSpec(token_ids=[999]), "vocabulary")):
        with pytest.raises(errors.BadRequest, match=words):
            _ = [c async for c in cluster.conductor.generate(bad)]
    assert cluster.links["d1"].calls["reserve"] == 1  # the good request's: nothing was spent on the bad ones


async def test_a_dead_prefill_is_retried_on_the_other(cluster, reference):
    # the dead one looks idle and the live one busy: the policy picks the dead one first
    dead = cluster.join("p-dead", "prefill", Unreachable())
    await cluster.serve("p-live", "prefill", queued_prefill_tokens=100_000)
    d1 = await cluster.serve("d1", "decode")
    chunks = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(8)))]
    assert [t for c in chunks for t in c.token_ids] == reference(PROMPT, _params(8))
    assert chunks[0].prefill_instance == "p-live"
    assert dead.calls["prefill"] == 1
    assert cluster.conductor.registry.find("p-dead").state == DEAD
    # the failed attempt's reservation is not freed while its prefill may still push (it cannot say it
    # stopped: it is unreachable); the decode frees it at its TTL
    await _wait_for(lambda: dead.calls["abort"] == 1, "the attempt's end")
    assert len(d1.reserved) == 1


async def test_every_prefill_dead_is_unavailable_naming_the_failure(cluster):
    cluster.join("p1", "prefill", Unreachable())
    await cluster.serve("d1", "decode")
    with pytest.raises(errors.NoInstance) as err:
        _ = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(4)))]
    assert err.value.role == "prefill" and "p1" in str(err.value) and "connection refused" in str(err.value)


async def test_no_decode_at_all_is_unavailable_naming_the_decode_role(cluster):
    """A prefill serves but no decode was ever registered: the error says it is the decode that is
    missing (a full decode makes the request wait instead: tests/test_decode_faults.py)."""
    p1 = await cluster.serve("p1", "prefill")
    with pytest.raises(errors.NoInstance) as err:
        _ = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(4)))]
    assert err.value.role == "decode" and "decode" in str(err.value), err.value
    assert p1.calls["prefill"] == 0  # nothing was computed for a request that could not be decoded


async def test_a_client_that_leaves_mid_stream_frees_the_decode_blocks(cluster):
    await cluster.serve("p1", "prefill")
    d1 = await cluster.serve("d1", "decode")
    bm = d1.engine.block_manager
    stream = cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(200)))
    first = await anext(stream)
    assert first.token_ids and bm.num_free_blocks < bm.num_blocks
    await stream.aclose()  # the client went away
    assert d1.calls["decode_abandoned"] == 1
    await _wait_for(lambda: bm.num_free_blocks == bm.num_blocks, "the decode's blocks back")
    assert cluster.conductor.registry.find("d1").inflight == 0


async def test_a_client_that_leaves_during_prefill_aborts_the_decode_reservation(cluster):
    p1 = await cluster.serve("p1", "prefill", cls=HeldPrefill)
    d1 = await cluster.serve("d1", "decode")
    bm = d1.engine.block_manager
    task = asyncio.ensure_future(anext(cluster.conductor.generate(GenerateSpec(token_ids=PROMPT,
                                                                               sampling=_params(8)))))
    await p1.started.wait()
    assert len(d1.reserved) == 1 and bm.num_free_blocks < bm.num_blocks
    task.cancel()  # the client went away while the prefill waited
    with pytest.raises(asyncio.CancelledError):
        await task
    # the prefill is stopped first, and only once it said so are the decode's blocks given back
    await _wait_for(lambda: not d1.reserved, "the reservation aborted")
    assert p1.calls["abort"] == 1 and d1.calls["abort"] == 1 and not d1.calls["decode"]
    await _wait_for(lambda: bm.num_free_blocks == bm.num_blocks, "the decode's blocks back")
    p1.go.set()


async def test_an_unmeetable_slo_is_rejected_before_any_work(folder):
    c = Cluster(folder, make_policy("mooncake", slo=SLO(ttft_s=float("inf"), tbt_s=1e-9)))
    try:
        await c.serve("p1", "prefill")
        d1 = await c.serve("d1", "decode")
        with pytest.raises(errors.Rejected) as err:
            _ = [x async for x in c.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(4)))]
        assert err.value.reason == "tbt_slo" and "tbt" in str(err.value).lower()
        assert str(err.value).startswith("rejected early (tbt_slo)")
        assert not d1.calls["reserve"] and not c.links["p1"].calls["prefill"]
    finally:
        await c.close()


async def test_a_decode_lost_before_its_first_token_is_prefilled_again(cluster, reference):
    await cluster.serve("p1", "prefill")
    d1 = await cluster.serve("d1", "decode")
    lost = []
    decode = d1.decode

    async def forgets_once(request_id, first, timeout_s):
        if not lost:  # its reservation is gone (a restart): NOT_FOUND before any token
            lost.append(request_id)
            d1.reserved.pop(request_id)
        async for c in decode(request_id, first, timeout_s):
            yield c

    d1.decode = forgets_once
    chunks = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(6)))]
    assert [t for c in chunks for t in c.token_ids] == reference(PROMPT, _params(6))
    assert len(lost) == 1 and cluster.links["p1"].calls["prefill"] == 2
