"""The conductor's plan is what the cluster does: a request routed to P2 whose policy says "pull the
prefix from P1" gets those blocks straight out of P1's KV cache over the transfer engine (P1 lends
them), computes only the rest, and answers the tokens of a cold run. A lender that vanishes
mid-plan leaves the blocks to be computed, counted as a deviation; a replicated hot prefix is held
in the pool with a soft pin, a pulled prefix that is not hot is not copied there. In-process instances (inproc_cluster.py): real engines, real transfer
on loopback, the conductor's core without gRPC. test_plan_processes.py does (a) with processes.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

import store_helpers
from inproc_cluster import BLOCK, KV_BYTES, Cluster, Unreachable
from mooncaked.conductor.core import GenerateSpec
from mooncaked.conductor.engine_link import PrefillPlan
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.prefix_demand import DEMAND_WINDOW_S, PrefixDemand
from mooncaked.conductor.router import Route, cluster_view
from mooncaked.conductor.views import Decision
from mooncaked.engine import Engine, SamplingParams
from mooncaked.hashing import block_hashes

pytestmark = pytest.mark.timeout(300)

PROMPT = [7, 21, 33, 40, 5, 9, 61, 62, 63, 12, 19]  # 11 tokens: two full blocks and a partial one
FULL = len(PROMPT) // BLOCK


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[1]


@pytest.fixture(scope="module")
def cold(folder):
    """One whole engine, nothing cached: what every request here must answer."""
    engine = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=KV_BYTES)
    yield lambda n: engine.generate(PROMPT, _params(n))[0].token_ids
    engine.close()


@pytest.fixture
async def cluster(folder):
    c = Cluster(folder)
    yield c
    await c.close()


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _generate(cluster: Cluster, n: int = 6):
    chunks = [c async for c in cluster.conductor.generate(GenerateSpec(token_ids=PROMPT, sampling=_params(n)))]
    return chunks, [t for c in chunks for t in c.token_ids]


async def _p1_holds_the_prompt(cluster: Cluster, cold) -> None:
    """P1 computes the prompt (P2 is drained meanwhile), the index learns it, then P1 is drained: the
    policy must send the next request to P2 and, P1 holding the prefix, plan a pull from P1."""
    await cluster.conductor.set_drain("p2", True)
    chunks, tokens = await _generate(cluster)
    assert chunks[0].prefill_instance == "p1" and tokens == cold(6)
    await cluster.conductor.set_drain("p2", False)
    await cluster.beat()  # heartbeats: P1's KV events reach the conductor's prefix index
    hashes = block_hashes(PROMPT, BLOCK, 0)
    assert cluster.conductor.index.match(hashes).get("p1") == FULL
    await cluster.conductor.set_drain("p1", True)  # still holds, and lends, the prefix


async def _wait_for(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_decision_to_pull_from_a_live_peer_plans_its_address_else_the_pool():
    class Inst:
        def __init__(self, name, state="serving"):
            self.name, self.address, self.state, self.pipeline = name, f"at-{name}", state, None

    p1, p2, dead = Inst("p1"), Inst("p2"), Inst("p3", "dead")
    find = {"p1": p1, "p3": dead}.get

    def plan(pull_from, reuse=3, local=1, replicate=True):
        d = Decision("p2", "d1", reuse, local, pull_from, replicate)
        return Route(p2, Inst("d1"), reuse, d).plan(find)

    assert plan("p1") == PrefillPlan(1, "p1", 2, "at-p1", True)
    assert plan("store") == PrefillPlan(1, "pool", 2, "", True)  # the pool's holder in the prefix index
    assert plan("p3") == PrefillPlan(1, "pool", 2, "", True)  # a dead peer: the pool may still have them
    assert plan("nobody") == PrefillPlan(1, "pool", 2, "", True)
    assert plan(None, reuse=1) == PrefillPlan(1, "", 0, "", True)  # nothing to pull
    assert Route(p2, Inst("d1"), 0).plan(find) is None  # no decision (no policy): the prefill decides


async def test_the_policy_pulls_from_peer_p1_for_a_request_routed_to_p2(cluster, cold):
    p1 = await cluster.serve("p1", "prefill")
    p2 = await cluster.serve("p2", "prefill")
    await cluster.serve("d1", "decode")
    await _p1_holds_the_prompt(cluster, cold)
    p1_computed = p1.engine.stats().prefill_tokens_computed
    peer_blocks = _metric("mooncaked_plan_blocks_total", source="peer")

    chunks, tokens = await _generate(cluster)
    assert tokens == cold(6)
    assert chunks[0].prefill_instance == "p2" and chunks[0].cached_tokens == FULL * BLOCK
    # the plan named P1 and where to reach it; P2 did exactly that and said so
    plan = p2.plans[-1]
    assert (plan.pull_from, plan.pull_blocks, plan.pull_address, plan.reuse_blocks) == ("p1", FULL, "inproc:p1", 0)
    result = p2.results[-1]
    assert (result.pulled_from, result.pulled_blocks, result.local_blocks) == ("p1", FULL, 0)
    assert not result.deviations and not result.replicated  # no pool to replicate into
    # P2 computed only the rest; P1 computed nothing more: it lent its cache (the pool is not even configured)
    assert p2.engine.stats().prefill_tokens_computed == len(PROMPT) - FULL * BLOCK
    assert p1.engine.stats().prefill_tokens_computed == p1_computed
    assert p2.worker.pool is None and p1.calls["lend"] == 1
    assert _metric("mooncaked_plan_blocks_total", source="peer") - peer_blocks == FULL
    # the loan was released at once: P1's blocks are pinned no longer
    await _wait_for(lambda: p1.calls["release"] == 1)
    assert not p1.worker.lender.loans
    # P2 now holds the prefix itself (the pull replicated it P->P): the next one reuses it locally
    await cluster.beat()
    chunks, tokens = await _generate(cluster)
    assert tokens == cold(6) and chunks[0].prefill_instance == "p2"
    assert p2.results[-1].local_blocks == FULL and p2.results[-1].pulled_blocks == 0 and p1.calls["lend"] == 1


@pytest.mark.parametrize("how", ["gone_before_lending", "gone_after_lending"])
async def test_a_lender_that_disappears_mid_plan_leaves_the_blocks_computed_and_counted(cluster, cold, how):
    p1 = await cluster.serve("p1", "prefill")
    p2 = await cluster.serve("p2", "prefill")
    await cluster.serve("d1", "decode")
    await _p1_holds_the_prompt(cluster, cold)
    if how == "gone_before_lending":  # its process is gone: the Lend call is refused
        cluster.fabric["inproc:p1"] = Unreachable()
        reason = "peer_unavailable"
    else:  # it lends, then dies before the borrower reads: the read fails
        lend = p1.lend

        async def lend_then_die(*a, **k):
            loan = await lend(*a, **k)
            await p1.worker.transfer.close()
            return loan

        p1.lend = lend_then_die
        reason = "peer_read_failed"
    before = _metric("mooncaked_plan_deviations_total", reason=reason)

    chunks, tokens = await _generate(cluster)
    assert tokens == cold(6)  # still right: the prefill computed what it could not get
    assert chunks[0].prefill_instance == "p2" and chunks[0].cached_tokens == 0
    result = p2.results[-1]
    assert result.deviations == {reason: FULL} and result.pulled_blocks == 0
    assert p2.engine.stats().prefill_tokens_computed == len(PROMPT)
    assert _metric("mooncaked_plan_deviations_total", reason=reason) - before == FULL
    # every block P2 took for the pull went back
    bm = p2.engine.block_manager
    await _wait_for(lambda: bm.num_free_blocks == bm.num_blocks)


@pytest.mark.parametrize("policy, window_s, hot", [
    ("mooncake", DEMAND_WINDOW_S, True),  # Algorithm 1's balancing path: every pull it makes replicates
    ("mooncaked_static", DEMAND_WINDOW_S, True),  # the first request asked for the prefix within the window: hot
    ("mooncaked", 0.0, False),  # it asked longer ago than the window (0 s here): pulled, not hot
])
async def test_a_hot_prefix_is_replicated_into_the_pool_with_a_soft_pin_and_a_cold_one_is_not(
        folder, cold, policy, window_s, hot):
    cluster = Cluster(folder, make_policy(policy))
    cluster.conductor.scheduler.demand = PrefixDemand(window_s=window_s)
    runner, master = await store_helpers.start()
    store = await store_helpers.client(master, "p2", dram_bytes=4 << 20)
    try:
        p1 = await cluster.serve("p1", "prefill")  # P1 lends no memory to the pool: only P2 writes there
        p2 = await cluster.serve("p2", "prefill", store=store)
        await cluster.serve("d1", "decode")
        await _p1_holds_the_prompt(cluster, cold)
        hashes = block_hashes(PROMPT, BLOCK, 0)
        view = cluster_view(cluster.conductor.registry, cluster.conductor.index, hashes, cluster.conductor.scheduler)
        assert view.pool_demand == (1 if window_s else 0)  # the request P1 computed it for
        chunks, tokens = await _generate(cluster)
        assert tokens == cold(6) and chunks[0].prefill_instance == "p2"
        plan, result = p2.plans[-1], p2.results[-1]
        assert plan.pull_from == "p1" and plan.pull_blocks == FULL and plan.replicate == hot
        assert result.pulled_from == "p1" and result.pulled_blocks == FULL and p1.calls["lend"] == 1
        assert result.replicated == hot
        # P2's writes to the pool were started before its prefill answered: once they end, the pool shows them
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t.get_name().startswith("pool-")))
        keys = [f"{cluster.folder.name}/{h}" for h in hashes]
        objects = runner.master.objects
        if hot:  # the prefix copied P1 -> P2, held in the pool
            assert all(k in objects and objects[k].committed and objects[k].soft_pin for k in keys)
        else:  # used for this request only: not copied into the pool, nothing pinned
            assert not any(k in objects for k in keys)
        # nor kept in P2's own prefix cache (P1 still holds it), and the conductor's index says so
        bm = p2.engine.block_manager
        assert await p2.engine.call(bm.cached_prefix_len, hashes[:FULL]) == (FULL if hot else 0)
        await cluster.beat()
        assert cluster.conductor.index.match(hashes).get("p2", 0) == (FULL if hot else 0)
    finally:
        await store.close()
        await runner.stop()
        await cluster.close()
