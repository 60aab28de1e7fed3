"""Elastic CPP (instance/pipeline.py): whole-model prefill instances lent to one prompt.

The lead computes the first even share of the layers, each helper the next, chunk by chunk, with
the boundary hidden states crossing over real transfer engines on loopback; every stage pushes its
layers into the decode's blocks and, for the new tokens, into the lead's blocks, so that the lead
caches the prompt whole while the helpers publish nothing. The oracle is ``Engine.generate`` of
one whole engine: greedy tokens must be equal, for a cold prompt of many chunks, and for one that
shares a prefix with the lead's cache (the helpers read the lead's run and the group starts after it).
"""

from __future__ import annotations

import asyncio

import pytest

from inproc_cluster import BLOCK, KV_BYTES, Cluster, Counted
from mooncaked.conductor.engine_link import ELASTIC_ALONE, INVALID, PRECONDITION, EngineError, PrefillPlan, StageOpen
from mooncaked.engine import Engine, SamplingParams
from mooncaked.hashing import block_hashes
from tiny_models import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(300)

CHUNK = 8  # tokens an engine computes per step: a 37-token prompt is five chunks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model with 3 layers, so a 3-stage group has a layer per stage."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("elastic"), num_layers=3)[1]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _cluster(folder, prefills: int, chunk: int = CHUNK) -> tuple[Cluster, list[Counted], Counted]:
    cluster = Cluster(folder)
    links = []
    for k in range(prefills):
        worker = await cluster.worker(f"p{k}", "prefill", max_num_batched_tokens=chunk)
        links.append(cluster.join(f"p{k}", "prefill", Counted(worker)))
    decode = await cluster.serve("d1", "decode")
    return cluster, links, decode


async def _run(lead: Counted, decode: Counted, rid: str, prompt: list[int], n: int, helpers: list[str]):
    """Reserve on the decode, prefill through the lead with these helpers, stream the rest."""
    params = _params(n)
    target = await decode.worker.reserve(rid, prompt, params)
    first = await lead.worker.prefill(rid, prompt, params, target, PrefillPlan(helpers=helpers))
    tokens = [t async for chunk in decode.worker.decode(rid, first) for t in chunk.token_ids]
    return first, tokens


@pytest.mark.parametrize("helpers", [1, 2])
async def test_an_elastic_group_equals_one_engine_and_the_lead_caches_the_prompt_whole(folder, helpers):
    ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    cluster, links, decode = await _cluster(folder, 3)
    try:
        lead, lent = links[0], links[1:1 + helpers]
        names = [f"inproc:p{k}" for k in range(1, 1 + helpers)]
        prompt, = random_prompts([37], seed=5)
        first, got = await _run(lead, decode, "r1", prompt, 6, names)
        assert got == ref.generate(prompt, _params(6))[0].token_ids
        assert first.cached_tokens == 0 and first.computed_tokens == len(prompt)
        # every stage computed its layers of every token; helpers publish none of their partial blocks
        for link in (lead, *lent):
            assert link.worker.engine.stats().prefill_tokens_computed == len(prompt)
        hashes = block_hashes(prompt, BLOCK, 0)
        for link in lent:
            assert link.worker.engine.block_manager.cached_prefix_len(hashes) == 0
            assert not link.worker.pipeline.jobs and not link.worker.prefiller.copies
        assert lead.worker.engine.block_manager.cached_prefix_len(hashes) == len(prompt) // BLOCK

        # the lead alone, on a prompt sharing 32 tokens: its cache holds every layer of them (the
        # helpers' layers arrived in its blocks), so the tokens equal a cold run's
        alone = prompt[:32] + [9, 8, 7]
        first, got = await _run(lead, decode, "r2", alone, 6, [])
        assert first.cached_tokens == 32
        assert got == ref.generate(alone, _params(6))[0].token_ids

        # elastic again on another prompt sharing the prefix: the helpers read the lead's run and the
        # group starts after it, computing only the rest on every stage
        before = [link.worker.engine.stats().prefill_tokens_computed for link in (lead, *lent)]
        again = prompt[:32] + [4, 5, 6, 7, 1]
        first, got = await _run(lead, decode, "r3", again, 6, names)
        assert got == ref.generate(again, _params(6))[0].token_ids
        assert first.cached_tokens == 32
        after = [link.worker.engine.stats().prefill_tokens_computed for link in (lead, *lent)]
        assert [a - b for a, b in zip(after, before)] == [len(again) - 32] * (1 + helpers)
        for link in (lead, *lent):
            assert not link.worker.pipeline.jobs and len(link.worker.pipeline.free_slots) == 2
    finally:
        ref.close()
        await cluster.close()


async def test_bad_elastic_calls_are_clear_errors_and_the_instance_serves_on(folder):
    ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    cluster, links, decode = await _cluster(folder, 2)
    try:
        lead, helper = links
        prompt, = random_prompts([20], seed=6)
        params = _params(3)
        target = await decode.worker.reserve("bad", prompt, params)
        cases = [
            (lambda: lead.worker.prefill("bad", prompt, params, target,
                                         PrefillPlan(helpers=["inproc:p1", "inproc:p1"])), INVALID, "distinct"),
            # the lead named as its own helper: its StageOpen finds the request already there
            (lambda: lead.worker.prefill("bad", prompt, params, target, PrefillPlan(helpers=["inproc:p0"])),
             INVALID, "unused"),
            (lambda: lead.worker.prefill("bad", prompt, params, target, PrefillPlan(helpers=["a", "b", "c"])),
             INVALID, "one stage a layer"),
            (lambda: decode.worker.prefill("bad", prompt, params, target, PrefillPlan(helpers=["inproc:p1"])),
             PRECONDITION, "decode instance"),
            (lambda: helper.worker.stage_open(StageOpen("bad", prompt, params, target, [])), PRECONDITION,
             "elastic helper"),
            (lambda: helper.worker.stage_open(StageOpen("bad", prompt, params, target, [], elastic=(1, 2))),
             INVALID, "lead's KV endpoint"),
            (lambda: helper.worker.stage_open(StageOpen("bad", prompt, params, target, [], elastic=(1, 9),
                                                        lead_endpoint=lead.worker.endpoint())),
             INVALID, "at most 3"),
        ]
        for call, kind, words in cases:
            with pytest.raises(EngineError) as e:
                await call()
            assert e.value.kind == kind and words in e.value.detail, e.value
        assert not helper.worker.pipeline.jobs
        await decode.worker.abort("bad")
        first, got = await _run(lead, decode, "ok", prompt, 3, ["inproc:p1"])
        assert got == ref.generate(prompt, _params(3))[0].token_ids
    finally:
        ref.close()
        await cluster.close()


def _all_given_back(links: list[Counted]) -> bool:
    for link in links:
        w, bm = link.worker, link.worker.engine.block_manager
        if w.pipeline.jobs or w.prefiller.pushes or w.prefiller.copies or len(w.pipeline.free_slots) != 2:
            return False
        if bm.num_free_blocks != bm.num_blocks:
            return False
    return True


async def _computing(helper: Counted, task: asyncio.Future) -> None:
    """Until the last helper is computing the prompt (every stage holds the request)."""
    while not helper.worker.pipeline.jobs or helper.worker.engine.stats().prefill_tokens_computed < 20:
        assert not task.done(), "the prompt finished before it could be cut off"
        await asyncio.sleep(0.005)


async def test_a_caller_that_leaves_mid_prompt_ends_it_on_every_stage(folder):
    """The lead's prefill cancelled (the conductor's client left): every stage stops its pushes and
    copies and gives back its slot and blocks; nothing partial is published anywhere."""
    cluster, links, decode = await _cluster(folder, 3, chunk=1)  # one token a step: hundreds of steps
    try:
        prompt, = random_prompts([400], seed=8)
        params = _params(4)
        target = await decode.worker.reserve("gone", prompt, params)
        task = asyncio.ensure_future(links[0].worker.prefill("gone", prompt, params, target,
                                                             PrefillPlan(helpers=["inproc:p1", "inproc:p2"])))
        await _computing(links[2], task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await links[0].worker.abort("gone")  # as the conductor does: answers once every push stopped
        for _ in range(500):
            if _all_given_back(links):
                break
            await asyncio.sleep(0.01)
        assert _all_given_back(links)
    finally:
        await cluster.close()


async def test_a_helper_whose_data_plane_dies_leaves_the_lead_to_compute_the_prompt_alone(folder, monkeypatch):
    """A helper's transfer engine goes away mid-prompt: the lead notices from the failed write itself, not an
    idle timeout (set out of reach), ends the pipeline on every stage and computes the prompt alone (counted
    as the deviation ``elastic_alone``), with the tokens of one engine."""
    from mooncaked.instance import pipeline

    monkeypatch.setattr(pipeline, "INPUT_IDLE_S", 3600.0)
    monkeypatch.setattr(pipeline, "FINISH_WAIT_S", 3600.0)
    cluster, links, decode = await _cluster(folder, 2, chunk=1)
    try:
        prompt, = random_prompts([400], seed=10)
        params = _params(4)
        target = await decode.worker.reserve("cut", prompt, params)
        task = asyncio.ensure_future(links[0].worker.prefill("cut", prompt, params, target,
                                                             PrefillPlan(helpers=["inproc:p1"])))
        await _computing(links[1], task)
        await links[1].worker.transfer.close()
        first = await asyncio.wait_for(task, 120)
        assert first.deviations == {ELASTIC_ALONE: 100} and first.computed_tokens == 400
        got = [t async for chunk in decode.worker.decode("cut", first) for t in chunk.token_ids]
        ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
        assert got == ref.generate(prompt, params)[0].token_ids
        ref.close()
        w = links[0].worker
        assert not w.pipeline.jobs and not w.prefiller.pushes and not w.prefiller.copies
    finally:
        await cluster.close()


def test_the_engine_refuses_bad_layer_ranges_and_steps_one_range_at_a_time(folder):
    """``add_request(layers=)``: a part of a whole-model engine's layers, hidden-state input exactly when it
    does not start at layer 0; a step never mixes a share with whole-model work (the model runs one range)."""
    from mooncaked.engine import RequestError

    engine = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=64)
    try:
        prompt, other = random_prompts([10, 7], seed=12)
        for layers, stage_input, words in [((0, 3), None, "a part of"), ((2, 2), 0, "a part of"),
                                           ((1, 4), 0, "a part of"), ((1, 3), None, "stage_input"),
                                           ((0, 2), 0, "stage_input")]:
            with pytest.raises(RequestError, match=words):
                engine.add_request(prompt, _params(1), f"bad-{layers}", layers=layers, stage_input=stage_input)
        rows: dict[str, list] = {}
        engine.hidden_sink = lambda rid, start, x: rows.setdefault(rid, []).append((start, x.shape[0]))
        engine.add_request(prompt, _params(1), "share", layers=(0, 2), hold_blocks=True)
        engine.add_request(other, _params(2), "whole")
        while engine.has_work():
            engine.step()
        assert rows == {"share": [(0, len(prompt))]}  # its first two layers, in one step of its own
        steps = engine.drain_step_log()
        assert [s.prefill_tokens for s in steps][:2] in ([10, 7], [7, 10])  # never 17 in one step
        assert engine.block_manager.cached_prefix_len(block_hashes(prompt, BLOCK, 0)) == 0  # nothing published
        assert engine.publish_held("share") == len(prompt) // BLOCK
        assert engine.block_manager.cached_prefix_len(block_hashes(prompt, BLOCK, 0)) == len(prompt) // BLOCK
        engine.release("share")
    finally:
        engine.close()


async def test_an_elastic_lead_carries_out_its_plans_pull_and_its_helpers_read_the_pulled_blocks(folder):
    """The plan says: pull the prefix from peer p2 (which computed it alone) and lend p1. The lead reads
    the blocks out of p2's KV cache, p1 reads its layers of them from the lead, and the group computes
    only the rest: one engine's tokens, the pull reported."""
    ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    cluster, links, decode = await _cluster(folder, 3)
    try:
        lead, helper, holder = links
        prompt, = random_prompts([37], seed=13)
        await _run(holder, decode, "warm", prompt[:33], 2, [])  # p2 holds the first 32 tokens' blocks
        before = [link.worker.engine.stats().prefill_tokens_computed for link in (lead, helper)]
        plan = PrefillPlan(reuse_blocks=0, pull_from="p2", pull_blocks=8, pull_address="inproc:p2",
                           helpers=["inproc:p1"])
        params = _params(6)
        target = await decode.worker.reserve("r", prompt, params)
        first = await lead.worker.prefill("r", prompt, params, target, plan)
        got = [t async for chunk in decode.worker.decode("r", first) for t in chunk.token_ids]
        assert got == ref.generate(prompt, params)[0].token_ids
        assert (first.cached_tokens, first.pulled_blocks, first.pulled_from, first.local_blocks) == (32, 8, "p2", 0)
        after = [link.worker.engine.stats().prefill_tokens_computed for link in (lead, helper)]
        assert [a - b for a, b in zip(after, before)] == [5, 5]
    finally:
        ref.close()
        await cluster.close()
