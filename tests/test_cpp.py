"""Chunked pipeline parallel prefill (CPP, instance/pipeline.py) against one whole engine.

A group of 2 or 3 prefill stages, each an engine holding only its layers, computes a prompt chunk
by chunk: boundary hidden states cross to the next stage over real transfer engines on loopback,
each stage pushes its own layers' KV into the decode's reserved blocks, the last stage samples the
first token, and the decode streams the rest. The oracle is ``Engine.generate`` of the whole model:
greedy tokens must be equal, for a prompt shorter than one chunk, one of many chunks, and a prefix
hit (where every stage starts after the blocks all of them hold).
"""

from __future__ import annotations

import pytest

from inproc_cluster import BLOCK, KV_BYTES, Cluster
from mooncaked.conductor.core import GenerateSpec
from mooncaked.engine import Engine, SamplingParams
from tiny_models import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(300)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
CHUNK = 8  # tokens a stage computes per step: a 37-token prompt is five chunks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models of each architecture with 3 layers, so a 3-stage group has a layer per stage."""
    return {arch: make_tiny_model(arch, tmp_path_factory.mktemp(f"cpp-{arch}"), num_layers=3)[1] for arch in ARCHS}


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _tokens(cluster: Cluster, prompt: list[int], n: int):
    chunks = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=prompt, sampling=_params(n)))]
    return [t for c in chunks for t in c.token_ids], chunks[0]


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
async def test_a_pipeline_group_equals_one_engine(arch, stages, models):
    folder = models[arch]
    ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    cluster = Cluster(folder)
    try:
        links = await cluster.group("g", stages, CHUNK)
        await cluster.serve("d1", "decode")
        # each stage holds only its layers: together the model's three, once
        held = [len(link.worker.engine.runner.model.layers) for link in links]
        assert sum(held) == 3 and all(held)
        assert [link.worker.layout.num_layers for link in links] == held
        short, long_ = random_prompts([5, 37], seed=3)
        for prompt in (short, long_):
            want = ref.generate(prompt, _params(6))[0].token_ids
            got, first = await _tokens(cluster, prompt, 6)
            assert got == want, f"{arch}, {stages} stages, {len(prompt)}-token prompt"
            assert first.prefill_instance == "g-s0"
        # every stage computed its layers of both prompts
        for link in links:
            assert link.worker.engine.stats().prefill_tokens_computed == len(short) + len(long_)
        # a prefix hit: the long prompt again with a new ending starts after the blocks every stage holds
        again = long_[:32] + [9, 8, 7]
        want = ref.generate(again, _params(6))[0].token_ids
        got, first = await _tokens(cluster, again, 6)
        assert got == want
        assert first.cached_tokens == 32
        for link in links:
            assert link.worker.engine.stats().prefill_tokens_computed == len(short) + len(long_) + 3
            assert not link.worker.pipeline.jobs and len(link.worker.pipeline.free_slots) == 2
    finally:
        ref.close()
        await cluster.close()


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
async def test_a_pipeline_group_equals_one_engine_on_the_default_model(stages):
    """SmolLM2-135M (30 layers: 15+15, or 10+10+10): a prompt under one chunk, one of many chunks (a
    real text), and a prefix hit of it."""
    from mooncaked.engine.loader import resolve_model_dir

    folder = resolve_model_dir("default")
    kv = 64 << 20
    ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=kv)
    cluster = Cluster(folder, kv_bytes=kv)
    try:
        links = await cluster.group("g", stages, 64)
        await cluster.serve("d1", "decode")
        assert [len(link.worker.engine.runner.model.layers) for link in links] == [30 // stages] * stages
        text = ref.tokenizer.encode("The history of Paris, the capital of France, begins with a Celtic people "
                                    "called the Parisii. " * 20)
        assert len(text) > 4 * 64  # many chunks
        short = text[:20]
        for prompt in (short, text, text[:200] + text[:17]):
            want = ref.generate(prompt, _params(8))[0].token_ids
            got, first = await _tokens(cluster, prompt, 8)
            assert got == want, f"{stages} stages, {len(prompt)}-token prompt"
        assert first.cached_tokens == 200  # the last prompt shares 50 blocks with the long one
    finally:
        ref.close()
        await cluster.close()


async def test_bad_input_between_stages_is_a_clear_error(models):
    """Every stage call refuses what does not fit, naming it, and the stage serves on."""
    from mooncaked.conductor.engine_link import INVALID, NOT_FOUND, PRECONDITION, EngineError, StageOpen

    folder = models["llama"]
    cluster = Cluster(folder)
    try:
        s0, s1 = await cluster.group("g", 2, CHUNK)
        d1 = await cluster.serve("d1", "decode")
        prompt = random_prompts([20], seed=4)[0]
        target = await d1.reserve("r1", prompt, _params(2), 5)
        cases = [
            (s1.stage_input("nobody", 0, 8, 5), NOT_FOUND, "no request 'nobody'"),
            (s1.stage_finish("nobody", 5), NOT_FOUND, "no request"),
            (s0.stage_open(StageOpen("r1", prompt, _params(2), target, []), 5), PRECONDITION, "not a later stage"),
            (s1.stage_open(StageOpen("r1", prompt, _params(2), target, ["x"]), 5), INVALID, "names 1"),
            (s0.prefill("r1", prompt, _params(2), target, 5), PRECONDITION, "addresses of its 1 later"),
            (d1.prefill("r1", prompt, _params(2), target, 5, None, ["somewhere"]), PRECONDITION, "prefill"),
        ]
        for call, kind, words in cases:
            with pytest.raises(EngineError, match=words) as e:
                await call
            assert e.value.kind == kind
        # a request open on stage 1: input that is not a block boundary, runs backwards or past the prompt
        opened = await s1.stage_open(StageOpen("r2", prompt, _params(2), target, []), 5)
        assert opened.row_bytes == 64 * 4 and opened.cached_blocks == 0
        for start, ready, words in ((3, 8, "block boundary"), (0, 21, "outside"), (0, 0, "outside")):
            with pytest.raises(EngineError, match=words) as e:
                await s1.stage_input("r2", start, ready, 5)
            assert e.value.kind == INVALID
        await s1.abort("r2", 5)
        assert not s1.worker.pipeline.jobs and len(s1.worker.pipeline.free_slots) == 2
        # and the group still serves
        await d1.abort("r1", 5)
        ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
        got, _ = await _tokens(cluster, prompt, 4)
        assert got == ref.generate(prompt, _params(4))[0].token_ids
        ref.close()
    finally:
        await cluster.close()


async def test_a_client_that_leaves_mid_pipeline_stops_every_stage_before_the_decode_frees(models):
    """The head's abort answers once every stage's pushes stopped: only then are the decode's blocks
    freed, and no stage keeps the request, its slot or its blocks."""
    import asyncio

    cluster = Cluster(models["llama"])
    try:
        stages = await cluster.group("g", 3, 1)  # one token a chunk: the prompt takes hundreds of steps
        d1 = await cluster.serve("d1", "decode")
        bm = d1.engine.block_manager
        prompt = random_prompts([400], seed=8)[0]
        task = asyncio.ensure_future(anext(cluster.conductor.generate(GenerateSpec(token_ids=prompt,
                                                                                   sampling=_params(4)))))
        last = stages[-1].worker
        while not last.pipeline.jobs or last.engine.stats().prefill_tokens_computed < 20:
            await asyncio.sleep(0.005)  # the last stage is computing: every stage holds the request
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while d1.reserved or bm.num_free_blocks < bm.num_blocks:
            await asyncio.sleep(0.01)
        for link in stages:
            w = link.worker
            assert not w.pipeline.jobs and len(w.pipeline.free_slots) == 2 and not w.prefiller.pushes
            assert w.engine.block_manager.num_free_blocks == w.engine.block_manager.num_blocks
        assert stages[0].calls["abort"] == 1
    finally:
        await cluster.close()


async def test_an_abort_during_the_heads_own_ending_answers_only_once_every_stage_gave_back(models):
    """The cancelled head ends its job itself; an abort arriving meanwhile must not answer (and so let
    the conductor free the decode's blocks) before that ending stopped every stage's pushes."""
    import asyncio

    cluster = Cluster(models["llama"])
    try:
        stages = await cluster.group("g", 3, 1)
        await cluster.serve("d1", "decode")
        prompt = random_prompts([400], seed=9)[0]
        task = asyncio.ensure_future(anext(cluster.conductor.generate(GenerateSpec(token_ids=prompt,
                                                                                   sampling=_params(4)))))
        head, last = stages[0].worker.pipeline, stages[-1].worker
        while not last.pipeline.jobs or last.engine.stats().prefill_tokens_computed < 20:
            await asyncio.sleep(0.005)
        (rid, job), = head.jobs.items()
        first = asyncio.ensure_future(head._end(job))  # as the head's cancelled prefill does
        await asyncio.sleep(0)
        assert job.ended.is_set() and not job.closed.is_set()
        assert await head.abort(rid)  # the second ender: answers only after the first one finished
        for link in stages:
            w = link.worker
            assert not w.pipeline.jobs and len(w.pipeline.free_slots) == 2 and not w.prefiller.pushes
        await first
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await cluster.close()


async def test_a_stage_whose_data_plane_dies_fails_its_request_at_once_and_it_is_retried(models, monkeypatch):
    """A later stage's transfer engine goes away mid-prompt: the stage before it fails the request from the
    failed write itself (its next write, or at the latest when it awaits its sends), never by waiting out an
    idle timeout (set out of reach here), and the conductor redoes it on the other group with the tokens of
    one whole engine. The process test (test_cpp_processes.py) kills a stage for real, with a hang bound."""
    import asyncio

    from mooncaked.instance import pipeline

    monkeypatch.setattr(pipeline, "INPUT_IDLE_S", 3600.0)  # were the failure noticed only by waiting, this hangs
    monkeypatch.setattr(pipeline, "FINISH_WAIT_S", 3600.0)
    folder = models["llama"]
    cluster = Cluster(folder)
    try:
        groups = [await cluster.group(name, 2, 1) for name in ("a", "b")]
        await cluster.serve("d1", "decode")
        prompt = random_prompts([400], seed=10)[0]
        task = asyncio.ensure_future(_tokens(cluster, prompt, 4))
        busy = None
        while busy is None:
            busy = next((g for g in groups if g[1].worker.pipeline.jobs
                         and g[1].worker.engine.stats().prefill_tokens_computed >= 20), None)
            assert not task.done(), "the prompt finished before a stage could be cut off"
            await asyncio.sleep(0.005)
        await busy[1].worker.transfer.close()  # the later stage's data plane is gone
        got, first = await task
        ref = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
        assert got == ref.generate(prompt, _params(4))[0].token_ids
        ref.close()
        other = next(g for g in groups if g is not busy)
        assert first.prefill_instance == other[0].worker.name  # redone on the other group
        assert not busy[0].worker.pipeline.jobs and len(busy[0].worker.pipeline.free_slots) == 2
    finally:
        await cluster.close()


async def test_the_conductor_sees_a_group_as_one_unit_with_a_pipeline_time_model(models):
    """Only the head is offered (and only while every stage serves); its view spans S machines, pulls
    nothing, and predicts with the pipeline model that the group's measured times calibrate."""
    from mooncaked.conductor.pipeline_cost import PipelinePrefillModel
    from mooncaked.conductor.router import cluster_view

    cluster = Cluster(models["llama"])
    try:
        await cluster.group("g", 2, CHUNK)
        await cluster.serve("d1", "decode")
        c = cluster.conductor
        await _tokens(cluster, random_prompts([30], seed=9)[0], 2)  # through the group: its measured time
        model = c.scheduler.model("g-s0").prefill
        assert isinstance(model, PipelinePrefillModel) and model.shape.chunk_tokens == CHUNK
        assert len(model) == 1
        await cluster.serve("p1", "prefill")
        by_name = {v.name: v for v in cluster_view(c.registry, c.index, [], c.scheduler).prefills}
        assert sorted(by_name) == ["g-s0", "p1"]
        assert (by_name["g-s0"].pipeline_stages, by_name["g-s0"].pulls) == (2, False)
        assert (by_name["p1"].pipeline_stages, by_name["p1"].pulls) == (1, True)
        c.registry.mark_dead("g-s1", "test")  # a group missing a stage gets no work
        assert [v.name for v in cluster_view(c.registry, c.index, [], c.scheduler).prefills] == ["p1"]
    finally:
        await cluster.close()
