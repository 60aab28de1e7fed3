"""Chunked pipeline parallel (CPP) groups in the simulator: the time model and the policies over groups."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mooncaked.conductor.cost_model import A800_LLAMA2_70B, PrefillTimeModel
from mooncaked.conductor.pipeline_cost import (PipelinePrefillModel, PipelineShape, chunk_plan, pipeline_prefill_s,
                                               pipeline_seconds)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

PROF = A800_LLAMA2_70B


def flat(c: int, p: int) -> float:
    """A step time linear in new tokens and blind to the prefix: the schedule's arithmetic alone."""
    return c * 1e-3


def test_chunks_cover_the_uncached_tokens_after_the_prefix():
    assert chunk_plan(10_000, 2048, 4096) == [(4096, 2048), (4096, 6144), (1808, 10240)]
    assert chunk_plan(1, 0, 4096) == [(1, 0)]
    assert chunk_plan(0, 512, 4096) == []


def test_a_one_chunk_prompt_gains_nothing_from_stages():
    shape = PipelineShape.even(4, chunk_tokens=4096)
    one = pipeline_prefill_s(PROF.prefill_s, 3000, 0, shape)
    assert one == pytest.approx(PROF.prefill_s(3000, 0))  # every stage in turn: the whole model, once


def test_many_chunks_approach_one_over_n_plus_one_chunk_fill_and_drain():
    n, c, stages = 64 * 4096, 4096, 4
    shape = PipelineShape.even(stages, chunk_tokens=c)
    t = pipeline_prefill_s(flat, n, 0, shape)
    # steady state: one stage's share of every chunk; fill and drain: the first chunk's other stages
    assert t == pytest.approx(n * 1e-3 / stages + (stages - 1) * c * 1e-3 / stages)
    assert n * 1e-3 / stages < t < n * 1e-3 / stages * 1.1


def test_the_real_profile_is_neither_one_machine_nor_n_times_faster():
    shape = PipelineShape.for_profile(PROF, 2, 4096)
    for n in (8192, 40_000, 128_000):
        one = PROF.prefill_s(n, 0)
        group = pipeline_prefill_s(PROF.prefill_s, n, 0, shape)
        assert one / 2 < group < one, n
    # the longer the prompt, the closer to 1/2 (fill and drain are one chunk's)
    ratios = [pipeline_prefill_s(PROF.prefill_s, n, 0, shape) / PROF.prefill_s(n, 0) for n in (8192, 40_000, 128_000)]
    assert ratios == sorted(ratios, reverse=True)


def test_the_hidden_state_hop_is_counted_once_per_chunk_and_boundary():
    c, hop = 1000, 1e-5
    plain = PipelineShape.even(3, chunk_tokens=c)
    hopping = PipelineShape.even(3, chunk_tokens=c, hop_s_per_token=hop)
    one_chunk = pipeline_prefill_s(flat, c, 0, hopping) - pipeline_prefill_s(flat, c, 0, plain)
    assert one_chunk == pytest.approx(2 * c * hop)  # two stage boundaries
    # the profile's figure: 16 KiB of hidden state per token over the 100 GB/s link
    assert PipelineShape.for_profile(PROF, 2).hop_s_per_token == pytest.approx(8192 * 2 / PROF.remote_bps)


def test_the_slowest_stage_sets_the_steady_state():
    shape = PipelineShape.even(2, chunk_tokens=1000)
    fast = pipeline_seconds([1.0] * 10, [1000] * 10, shape, speeds=(1.0, 1.0))
    slow = pipeline_seconds([1.0] * 10, [1000] * 10, shape, speeds=(1.0, 0.5))
    assert fast == pytest.approx(5.5) and slow == pytest.approx(0.5 + 10 * 1.0)


def test_uneven_layers_split_into_contiguous_whole_ranges():
    shape = PipelineShape.even(3, num_layers=80)
    assert [round(f * 80) for f in shape.stage_fractions] == [27, 27, 26]
    with pytest.raises(ValueError):
        PipelineShape((0.5, 0.4), 4096)


def test_the_group_model_learns_its_measured_times_not_an_assumed_speedup():
    """A group measured 1.5x slower than the schedule of one machine predicts: the model follows."""
    shape = PipelineShape.for_profile(PROF, 2)
    model = PipelinePrefillModel(PrefillTimeModel(PROF.prefill_coef), shape)
    truth = [(n, p, 1.5 * pipeline_prefill_s(PROF.prefill_s, n, p, shape))
             for n in (2000, 9000, 30000) for p in (0, 8192)]
    before = model.predict(20000, 4096)
    for _ in range(20):
        for n, p, s in truth:
            model.observe(n, p, s)
    assert model.predict(20000, 4096) == pytest.approx(1.5 * before, rel=0.05)


def test_a_group_in_the_simulator_runs_the_schedule(tmp_path):
    from sim.engine import SimConfig, Simulation
    from sim.trace import TraceRequest
    from mooncaked.conductor.policies import make_policy

    trace = [TraceRequest(0, 0.0, 40_960, 2, tuple(range(80)))]
    cfg = SimConfig(prefill=2, decode=1, profile=PROF, pipeline_groups=1, pipeline_stages=2, noise=0.0,
                    heterogeneity=0.0, cpp_chunk_tokens=4096)
    sim = Simulation(trace, cfg, make_policy("mooncake"))
    result = sim.run()
    shape = PipelineShape.for_profile(PROF, 2, 4096)
    assert sim.outcomes[0].prefill == "group-0"
    assert result.mean_ttft_s == pytest.approx(pipeline_prefill_s(PROF.prefill_s, 40_960, 0, shape))
    assert PROF.prefill_s(40_960, 0) / 2 < result.mean_ttft_s < PROF.prefill_s(40_960, 0)


def test_groups_use_machines_out_of_the_prefill_count(tmp_path, capsys):
    from test_simulate import BUNDLED_TRACE, load_simulate

    simulate = load_simulate()
    rc = simulate.main(["--trace", str(BUNDLED_TRACE), "--max-requests", "60", "--prefill", "5", "--decode", "2",
                        "--pipeline-groups", "2", "--pipeline-stages", "2", "--policy", "mooncake", "mooncaked_static",
                        "--json", "-"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["pipeline_groups"] == 2 and set(report["policies"]) == {"mooncake", "mooncaked_static"}
    assert all(row["served"] == 60 for row in report["policies"].values())
    with pytest.raises(SystemExit):
        simulate.main(["--prefill", "3", "--pipeline-groups", "2", "--pipeline-stages", "2", "--json", "-"])


# -- policies over groups ----------------------------------------------------------------------------
def _views(prompt_blocks: int, group_queued_s: float = 0.0):
    from mooncaked.conductor.pipeline_cost import pipeline_instance_model
    from mooncaked.conductor.views import ClusterView, InstanceView, RequestView

    shape = PipelineShape.for_profile(PROF, 4)
    group = InstanceView("group-0", "prefill", pipeline_instance_model(PROF, shape), pipeline_stages=4,
                         queued_s=group_queued_s)
    single = InstanceView("prefill-4", "prefill", PROF.instance_model())
    dec = InstanceView("decode-0", "decode", PROF.instance_model(), total_kv_blocks=10_000, free_kv_blocks=10_000)
    req = RequestView(prompt_blocks * PROF.block_size, tuple(range(prompt_blocks)), PROF.block_size, 10)
    return req, ClusterView(0.0, (group, single), (dec,))


@pytest.mark.parametrize("blocks, mooncake_to, mooncaked_to", [
    (4, "prefill-4", "prefill-4"),     # one chunk: no group is faster
    (9, "group-0", "prefill-4"),       # a chunk and a bit: a little faster, not worth 4 machines
    (80, "group-0", "group-0"),        # 10 chunks: nearly 4x
])
def test_mooncaked_keeps_prompts_a_group_barely_speeds_up_off_it(blocks, mooncake_to, mooncaked_to):
    from mooncaked.conductor.policies import make_policy

    req, view = _views(blocks)
    assert make_policy("mooncake").decide(req, view).prefill == mooncake_to
    assert make_policy("mooncaked_static").decide(req, view).prefill == mooncaked_to


def test_a_busy_group_loses_to_an_idle_single_when_the_wait_eats_the_gain():
    from mooncaked.conductor.policies import make_policy

    req, view = _views(80, group_queued_s=30.0)
    assert make_policy("mooncaked_static").decide(req, view).prefill == "prefill-4"


def test_elastic_pipelines_a_long_prompt_over_idle_singles_in_the_simulator():
    from sim.elastic import ElasticDecision, make_sim_policy
    from sim.engine import SimConfig, Simulation
    from sim.trace import TraceRequest

    # a long prompt, then a short one while the long one holds every machine
    trace = [TraceRequest(0, 0.0, 80 * 512, 2, tuple(range(80))), TraceRequest(1, 0.5, 1000, 2, (1000, 1001))]
    cfg = SimConfig(prefill=4, decode=1, profile=PROF, noise=0.0, heterogeneity=0.0)
    policy = make_sim_policy("mooncaked", PROF, chunk_tokens=4096, max_stages=4)
    sim = Simulation(trace, cfg, policy)
    decided = []
    decide = policy.decide
    policy.decide = lambda r, c: decided.append(decide(r, c)) or decided[-1]
    result = sim.run()
    first, second = decided
    assert isinstance(first, ElasticDecision) and len(first.helpers) >= 1
    stages = 1 + len(first.helpers)
    expected = pipeline_prefill_s(PROF.prefill_s, 80 * 512, 0, PipelineShape.for_profile(PROF, stages, 4096))
    assert sim.outcomes[0].ttft_s == pytest.approx(expected)
    assert sim.outcomes[0].ttft_s < PROF.prefill_s(80 * 512, 0) / 2
    # the lent machines are busy: the short prompt goes to one left idle, or waits
    assert second.prefill not in (first.prefill, *first.helpers) or sim.outcomes[1].wait_s > 0
    assert result.served == 2 and result.prefill_tokens_computed == 80 * 512 + 1000


def test_an_elastic_pipeline_on_shared_cores_runs_at_the_share_of_every_machine_it_holds():
    """``--shared-cores`` (the embedded cluster's one host) with elastic CPP: each stage of the pipeline is a
    busy instance. With a core per instance the pipeline takes its own-machines time; with both prefill
    instances on one core it takes twice that, and the helper is free again when the lead finishes."""
    from sim.elastic import ElasticDecision, make_sim_policy
    from sim.engine import SimConfig, Simulation
    from sim.trace import TraceRequest

    n = 80 * 512
    own = pipeline_prefill_s(PROF.prefill_s, n, 0, PipelineShape.for_profile(PROF, 2, 4096))

    def run(**kw):
        trace = [TraceRequest(0, 0.0, n, 1, tuple(range(80))), TraceRequest(1, 3 * own, 1000, 1, (1000, 1001))]
        policy = make_sim_policy("mooncaked", PROF, chunk_tokens=4096, max_stages=2)
        decided = []
        decide = policy.decide
        policy.decide = lambda r, c: decided.append(decide(r, c)) or decided[-1]
        sim = Simulation(trace, SimConfig(prefill=2, decode=1, profile=PROF, noise=0.0, heterogeneity=0.0, **kw),
                         policy)
        sim.run()
        assert isinstance(decided[0], ElasticDecision) and len(decided[0].helpers) == 1
        assert sim.outcomes[1].wait_s == 0  # both machines idle again long before the next prompt
        return sim.outcomes[0].ttft_s

    assert run() == pytest.approx(own) and own < 0.6 * PROF.prefill_s(n, 0)
    assert run(shared_cores=2) == pytest.approx(own)
    assert run(shared_cores=1) == pytest.approx(2 * own)


def test_elastic_gives_a_prompt_that_misses_the_slo_alone_a_pipeline_from_an_idle_machine():
    """128k tokens take ~39 s on one machine, past the 30 s TTFT SLO. The machine mooncaked picks (the
    fastest, 0.5 s behind) is busy, so elastic CPP would not start there; the prompt leads its
    pipeline from an idle one instead and meets the SLO."""
    import dataclasses

    from mooncaked.conductor.early_rejection import SLO
    from mooncaked.conductor.views import ClusterView, InstanceView, RequestView
    from sim.elastic import ElasticDecision, make_sim_policy

    blocks = 250
    req = RequestView(blocks * PROF.block_size, tuple(range(blocks)), PROF.block_size, 10)
    fast = dataclasses.replace(PROF, prefill_coef=tuple(0.9 * c for c in PROF.prefill_coef))
    busy = InstanceView("prefill-0", "prefill", fast.instance_model(), queued_s=0.5)
    idle = tuple(InstanceView(f"prefill-{i}", "prefill", PROF.instance_model()) for i in range(1, 5))
    dec = InstanceView("decode-0", "decode", PROF.instance_model(), total_kv_blocks=10_000, free_kv_blocks=10_000)
    view = ClusterView(0.0, (busy, *idle), (dec,))
    plain = make_sim_policy("mooncaked_static", PROF, chunk_tokens=4096, slo=SLO()).decide(req, view)
    assert plain.prefill == "prefill-0" and plain.predicted_ttft_s > SLO().ttft_s
    d = make_sim_policy("mooncaked", PROF, chunk_tokens=4096, slo=SLO()).decide(req, view)
    assert isinstance(d, ElasticDecision) and d.prefill != "prefill-0" and "prefill-0" not in d.helpers
    assert len(d.helpers) == 3 and d.predicted_ttft_s < SLO().ttft_s
    assert d.alone_prefill_s > SLO().ttft_s  # what it is booked for should its helpers turn out busy


def test_a_pipeline_whose_machines_turn_out_busy_runs_alone_and_is_booked_for_that():
    """The books are behind when a prefill overruns its prediction: prefill-1 looks idle while it still
    computes. A pipeline planned over it is not formed; the prompt runs alone on its lead and the
    lead's queue says so, or the next prompts would be sent behind it on a wrong estimate."""
    from mooncaked.conductor.early_rejection import SLO
    from mooncaked.conductor.views import Decision
    from sim.elastic import ElasticDecision, make_sim_policy
    from sim.engine import SimConfig, Simulation
    from sim.instances import Job
    from sim.trace import TraceRequest

    req = TraceRequest(0, 1.0, 80 * 512, 2, tuple(range(80)))
    cfg = SimConfig(prefill=2, decode=1, profile=PROF, noise=0.0, heterogeneity=0.0)
    policy = make_sim_policy("mooncaked", PROF, chunk_tokens=4096, slo=SLO())
    sim = Simulation([req], cfg, policy)
    other = TraceRequest(9, 0.0, 80 * 512, 2, tuple(range(1000, 1080)))
    sim._p["prefill-1"].enqueue(Job(other, Decision("prefill-1", "decode-0", 0, 0, predicted_prefill_s=1e-3), 0.0), 0.0)
    decided = []
    decide = policy.decide
    policy.decide = lambda r, c: decided.append(decide(r, c)) or decided[-1]
    started = sim._arrive(req, 1.0)
    (d,) = decided
    assert isinstance(d, ElasticDecision) and d.prefill == "prefill-0" and d.helpers == ("prefill-1",)
    assert [name for name, _ in started] == ["prefill-0"]  # no machine lent
    lead = sim._p["prefill-0"]
    assert lead.running.pipeline is None and lead.running.decision.predicted_prefill_s == d.alone_prefill_s
    assert lead.backlog.seconds(1.0) == pytest.approx(d.alone_prefill_s) and d.alone_prefill_s > d.predicted_prefill_s


# -- the held-out half of the bundled trace ----------------------------------------------------------
@pytest.fixture(scope="module")
def second_half(tmp_path_factory) -> Path:
    from test_simulate import BUNDLED_TRACE

    lines = BUNDLED_TRACE.read_text().splitlines(keepends=True)
    out = tmp_path_factory.mktemp("trace") / "second_half.jsonl"
    out.write_text("".join(lines[len(lines) // 2:]))  # lines 1997-3993
    return out


def _held_out(second_half: Path, capsys, *args: str) -> dict:
    from test_simulate import load_simulate

    capsys.readouterr()
    assert load_simulate().main(["--trace", str(second_half), "--seeds", "4", "--json", "-", *args]) == 0
    return json.loads(capsys.readouterr().out)["policies"]


def test_static_groups_mooncaked_beats_mooncake_on_the_held_out_half(second_half, capsys):
    """16 machines as 2 CPP groups of 4 + 8 single, seeds 0-3 (ratio 0.943 when written; the one
    constant, GROUP_MIN_GAIN, was chosen on the first half). Not the issue's 0.9: see docs."""
    rows = _held_out(second_half, capsys, "--pipeline-groups", "2", "--pipeline-stages", "4",
                     "--policy", "mooncake", "mooncaked_static")
    ours, theirs = rows["mooncaked_static"], rows["mooncake"]
    assert ours["mean_ttft_s"] < 0.97 * theirs["mean_ttft_s"], (ours["mean_ttft_s"], theirs["mean_ttft_s"])
    assert ours["slo_attainment"] >= theirs["slo_attainment"]


def test_mooncaked_reaches_0_9x_mooncake_on_the_held_out_half_with_slo_no_worse(second_half, capsys):
    """16 single prefill machines, seeds 0-3: mooncaked (ours) pipelines long prompts over idle ones
    (elastic CPP; live: docs/performance.md, "Elastic CPP live against the simulator"). Its rules were
    chosen on the first half and this half run once per rule: mean TTFT x0.721 when written, SLO
    attainment 99.912 % against 99.900 % (before a prefill model that follows the prior's curve past
    the longest prompt it measured: x0.732, 99.825 %; docs/performance.md, "Elastic CPP and the SLO")."""
    rows = _held_out(second_half, capsys, "--policy", "mooncake", "mooncaked")
    ours, theirs = rows["mooncaked"], rows["mooncake"]
    assert ours["mean_ttft_s"] <= 0.9 * theirs["mean_ttft_s"], (ours["mean_ttft_s"], theirs["mean_ttft_s"])
    assert ours["slo_attainment"] >= theirs["slo_attainment"]


@pytest.mark.parametrize("name", ["mooncake", "mooncaked_static", "mooncaked"])
def test_a_group_that_cannot_pull_is_never_told_to(name):
    """Live, a CPP group reuses only its stages' own caches; a policy must not plan a pull there."""
    import dataclasses

    from mooncaked.conductor.policies import make_policy

    req, view = _views(80)
    group, single = view.prefills
    group = dataclasses.replace(group, pool_blocks=60, pulls=False)
    single = dataclasses.replace(single, pool_blocks=60, queued_s=100.0)
    d = make_policy(name).decide(req, dataclasses.replace(view, prefills=(group, single)))
    assert d.prefill == "group-0" and d.reuse_blocks == d.local_blocks == 0 and d.pull_from is None
    pulling = make_policy(name).decide(req, dataclasses.replace(view, prefills=(dataclasses.replace(group, pulls=True),
                                                                               single)))
    assert pulling.prefill == "group-0" and pulling.reuse_blocks == 60
