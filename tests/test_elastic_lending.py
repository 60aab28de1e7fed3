"""Elastic CPP, the conductor's side: ``--policy mooncaked`` lends idle prefill instances to a long
prompt, the registry keeps a lent one out of routing until the lead's prefill ends (however it ends), its
backlog is booked for the pipeline's predicted time, and the plan names it by its Engine address.

Policy cases are built from views (no timing); the lending cases run the conductor's core against real
instances in this process (inproc_cluster.py). The instance side of the pipeline is
``tests/test_cpp_elastic.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from inproc_cluster import BLOCK, KV_BYTES, Cluster, Counted, HeldPrefill, Unreachable
from mooncaked.conductor.core import GenerateSpec
from mooncaked.conductor.cost_model import A800_LLAMA2_70B
from mooncaked.conductor.pipeline_cost import PipelineShape, pipeline_prefill_s
from mooncaked.conductor.policies import ELASTIC_POLICY, LIVE_ELASTIC_CHUNK_TOKENS, POLICY_NAMES, make_policy
from mooncaked.conductor.registry import DEAD, Instance, Registry
from mooncaked.conductor.router import Route, SchedulerState
from mooncaked.conductor.status import ClusterStatus, ConductorInfo, instance_infos
from mooncaked.conductor.views import ClusterView, Decision, ElasticDecision, InstanceView, RequestView
from mooncaked.conductor.wire import status_to_proto
from mooncaked.config import add_config_args, load_config
from mooncaked.ctl import status_lines
from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.kv_cache import KVLayout
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

PROF = A800_LLAMA2_70B
CHUNK = 8  # the in-process engines' step budget and the policy's pipeline chunk there


# -- the policy, on views ----------------------------------------------------------------------------
def _request(tokens: int) -> RequestView:
    blocks = tokens // PROF.block_size
    return RequestView(tokens, tuple(range(blocks)), PROF.block_size, 10)


def _view(queued: dict[str, float], prefills: int = 4) -> ClusterView:
    ps = tuple(InstanceView(f"p{i}", "prefill", PROF.instance_model(), queued_s=queued.get(f"p{i}", 0.0))
               for i in range(prefills))
    d = InstanceView("d0", "decode", PROF.instance_model(), total_kv_blocks=100_000, free_kv_blocks=100_000)
    return ClusterView(0.0, ps, (d,))


def test_the_elastic_policy_is_a_live_choice_and_not_one_of_the_compared_ones():
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    assert load_config(parser.parse_args(["--role", "conductor", "--policy", ELASTIC_POLICY]), {}).policy == ELASTIC_POLICY
    assert ELASTIC_POLICY not in POLICY_NAMES  # made by make_policy with its pipeline's shape
    assert make_policy(ELASTIC_POLICY).name == ELASTIC_POLICY


def test_elastic_lends_idle_instances_to_a_long_prompt():
    req = _request(40_000)
    d = make_policy(ELASTIC_POLICY).decide(req, _view({}))
    assert isinstance(d, ElasticDecision) and d.helpers and d.prefill not in d.helpers
    assert set(d.helpers) <= {"p0", "p1", "p2", "p3"} and len(set(d.helpers)) == len(d.helpers)
    assert d.chunk_tokens == LIVE_ELASTIC_CHUNK_TOKENS
    # predicted on the live shape, and booked for its time alone should the pipeline not form
    shape = PipelineShape.even(1 + len(d.helpers), LIVE_ELASTIC_CHUNK_TOKENS)
    assert d.predicted_prefill_s == pytest.approx(pipeline_prefill_s(PROF.prefill_s, 40_000, 0, shape))
    assert d.alone_prefill_s == pytest.approx(PROF.prefill_s(40_000, 0))
    alone = d.alone()
    assert not alone.helpers and alone.predicted_prefill_s == d.alone_prefill_s and alone.prefill == d.prefill


def test_elastic_lends_nothing_when_the_other_instances_are_busy_or_the_prompt_is_one_chunk():
    req = _request(40_000)
    busy = {f"p{i}": 1.0 for i in range(1, 4)}  # only p0 is idle
    d = make_policy(ELASTIC_POLICY).decide(req, _view(busy))
    assert isinstance(d, Decision) and not getattr(d, "helpers", ())
    assert d == make_policy("mooncaked_static").decide(req, _view(busy))
    # a prompt of one chunk gains nothing from a pipeline: it runs alone
    short = make_policy(ELASTIC_POLICY).decide(_request(LIVE_ELASTIC_CHUNK_TOKENS), _view({}))
    assert not getattr(short, "helpers", ())


# -- the registry and the router -----------------------------------------------------------------------
def _registry(prefills: int = 3) -> Registry:
    layout = KVLayout(num_layers=2, num_blocks=100, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32",
                      element_size=4)
    reg = Registry(heartbeat_timeout_s=10.0)
    for i in range(prefills):
        reg.instances[f"p{i}"] = Instance(f"p{i}", "prefill", f"10.0.0.{i}:50061", "m", layout)
    reg.instances["d0"] = Instance("d0", "decode", "10.0.0.9:50071", "m", layout)
    return reg


def test_a_lent_instance_takes_no_work_until_given_back_and_lending_is_all_or_none():
    reg = _registry()
    names = lambda: [i.name for i in reg.available("prefill")]  # noqa: E731
    assert reg.lend(("p1", "p2"), "r1")
    assert names() == ["p0"] and reg.find("p1").lent_to == "r1"
    assert not reg.lend(("p0", "p1"), "r2") and not reg.find("p0").lent_to  # p1 is lent: nothing is
    reg.give_back("r2")  # another request's end gives back nothing of r1's
    assert names() == ["p0"]
    reg.give_back("r1")
    assert names() == ["p0", "p1", "p2"]
    reg.find("p2").inflight = 1  # a prefill is on its way there
    reg.mark_dead("p0", "test")
    assert not reg.lend(("p2",), "r3") and not reg.lend(("p0",), "r3") and not reg.lend(("gone",), "r3")
    assert not any(i.lent_to for i in reg.instances.values())


def test_the_plan_names_the_helpers_by_address_all_or_none():
    reg = _registry()
    d = ElasticDecision("p0", "d0", 0, 0, helpers=("p1", "p2"), chunk_tokens=CHUNK)
    route = Route(reg.find("p0"), reg.find("d0"), 0, d)
    assert route.plan(reg.find).helpers == ["10.0.0.1:50061", "10.0.0.2:50061"]
    reg.mark_dead("p2", "test")
    assert route.plan(reg.find).helpers == []  # one is gone: the lead runs alone, no error
    assert Route(reg.find("p0"), reg.find("d0"), 0, Decision("p0", "d0", 0, 0)).plan(reg.find).helpers == []


def test_helpers_are_booked_for_the_pipeline_and_freed_with_the_lead_whose_model_sees_one_machine():
    reg = _registry()
    shape = lambda s: PipelineShape.even(s, CHUNK)  # noqa: E731
    state = SchedulerState(make_policy(ELASTIC_POLICY, shape_for=shape), clock=lambda: 100.0)
    d = ElasticDecision("p0", "d0", 0, 0, predicted_prefill_s=2.0, helpers=("p1", "p2"), alone_prefill_s=5.0)
    state.routed("r1", Route(reg.find("p0"), reg.find("d0"), 0, d), 64, 4)
    assert [state.backlog(p).seconds(100.0) for p in ("p0", "p1", "p2")] == [2.0, 2.0, 2.0]
    assert state.backlog("p1").waiting_tokens == 0  # no prompt of its own: lent
    machine = state.model("p0").prefill
    before = machine.predict(64, 0)
    state.prefill_done("r1", "p0", uncached=64, prefix=0, compute_s=pipeline_prefill_s(machine.predict, 64, 0,
                                                                                        shape(3)))
    assert [state.backlog(p).seconds(100.0) for p in ("p0", "p1", "p2")] == [0.0, 0.0, 0.0]
    # the group's time, as long as predicted for the pipeline, is one machine's as predicted: the fit holds
    assert machine.predict(64, 0) == pytest.approx(before, rel=1e-3)
    assert not state.pipelines


# -- the conductor's core, in process -------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model with 3 layers: a 3-stage pipeline has a layer per stage."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("elastic-lend"), num_layers=3)[1]


@pytest.fixture(scope="module")
def reference(folder):
    engine = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    yield lambda prompt, params: engine.generate(prompt, params)[0].token_ids
    engine.close()


PROMPT = [(7 * i + 3) % 200 + 1 for i in range(61)]  # eight chunks: a pipeline is predicted to pay


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _cluster(folder, lead_cls: type[Counted] = Counted, gone_lead: Unreachable | None = None):
    """Three prefill instances (p0, the lead when all are alike: names break ties) and a decode."""
    c = Cluster(folder, make_policy(ELASTIC_POLICY, shape_for=lambda s: PipelineShape.even(s, CHUNK)))
    links = []
    for k in range(3):
        if k == 0 and gone_lead is not None:
            links.append(c.join("p0", "prefill", gone_lead))
            continue
        worker = await c.worker(f"p{k}", "prefill", max_num_batched_tokens=CHUNK)
        links.append(c.join(f"p{k}", "prefill", (lead_cls if k == 0 else Counted)(worker)))
    await c.serve("d1", "decode")
    return c, links


async def test_helpers_are_lent_until_the_leads_prefill_ends(folder, reference):
    c, (lead, *_) = await _cluster(folder, HeldPrefill)
    reg = c.conductor.registry
    try:
        gen = asyncio.ensure_future(_collect(c, PROMPT, 6))
        await asyncio.wait_for(lead.started.wait(), 60)
        lent = [i.name for i in reg.instances.values() if i.lent_to]
        assert lent and "p0" not in lent
        assert [i.name for i in reg.available("prefill")] == [n for n in ("p0", "p1", "p2") if n not in lent]
        state = c.conductor.scheduler
        assert all(state.backlog(n).seconds(state.clock()) > 0 for n in lent)  # booked for the pipeline
        # the operator's screen says so: the status on the wire and mooncakectl's line
        reply = status_to_proto(ClusterStatus(instance_infos(reg), "m", 0.0, ConductorInfo("a", "h", "p")))
        shown = {i.name: i.lent_to for i in reply.instances}
        assert all(shown[n] for n in lent) and not shown["p0"]
        assert sum("lent to" in line for line in status_lines(reply)) == len(lent)
        lead.go.set()
        tokens = await asyncio.wait_for(gen, 120)
        assert lead.plans[0].helpers == [f"inproc:{n}" for n in lent]
        assert tokens == reference(PROMPT, _params(6))  # the group answers as one engine
        assert not any(i.lent_to for i in reg.instances.values())
        assert [i.name for i in reg.available("prefill")] == ["p0", "p1", "p2"]
        assert all(state.backlog(n).seconds(state.clock()) == 0 for n in ("p0", "p1", "p2"))
    finally:
        await c.close()


class _FailingLead(Unreachable):
    """A lead whose process is gone; it notes which instances were lent when its prefill was called."""

    def __init__(self) -> None:
        super().__init__()
        self.registry: Registry | None = None
        self.lent_then: list[str] = []
        self.plans: list = []

    async def prefill(self, *a, **k):
        self.plans.append(a[5] if len(a) > 5 else k.get("plan"))
        self.lent_then = [i.name for i in self.registry.instances.values() if i.lent_to]
        return await super().prefill(*a, **k)


async def test_a_failed_elastic_prefill_gives_its_helpers_back_and_the_retry_runs_alone(folder, reference):
    failing = _FailingLead()
    c, (_, p1, p2) = await _cluster(folder, gone_lead=failing)
    failing.registry = reg = c.conductor.registry
    try:
        tokens = await asyncio.wait_for(_collect(c, PROMPT, 6), 120)
        assert tokens == reference(PROMPT, _params(6))
        assert failing.calls["prefill"] == 1 and failing.lent_then and failing.plans[0].helpers
        assert reg.find("p0").state == DEAD  # marked lost, as a static group's head is
        (retry,) = [plan for link in (p1, p2) for plan in link.plans]
        assert retry.helpers == []  # the retry plans no helpers
        assert not any(i.lent_to for i in reg.instances.values())
        assert [i.name for i in reg.available("prefill")] == ["p1", "p2"]
    finally:
        await c.close()


async def _collect(c: Cluster, prompt: list[int], n: int) -> list[int]:
    return [t async for chunk in c.conductor.generate(GenerateSpec(token_ids=prompt, sampling=_params(n)))
            for t in chunk.token_ids]
