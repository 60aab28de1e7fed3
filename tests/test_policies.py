"""Scheduling policies, cost model, early rejection and the prefix index in constructed situations.

No timing: every situation is built from views with known models, so each assertion is
about a choice (which instance, how many blocks, from where, rejected or not and why).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from mooncaked.conductor.cost_model import (A800_LLAMA2_70B, GENERIC, DecodeTimeModel, PrefillBacklog,
                                            PrefillTimeModel, Profile)
from mooncaked.conductor.early_rejection import SLO, forecast_decode
from mooncaked.conductor.policies import HOT_MIN_DEMAND, POLICY_NAMES, make_policy
from mooncaked.conductor.prefix_demand import PrefixDemand
from mooncaked.conductor.prefix_index import PrefixIndex
from mooncaked.conductor.views import ClusterView, Decision, InstanceView, Rejection, RequestView, SeqLoad

PROFILE = A800_LLAMA2_70B
BS = PROFILE.block_size


def request(blocks: int = 40, max_tokens: int = 100, extra_tokens: int = 100) -> RequestView:
    return RequestView(prompt_len=blocks * BS + extra_tokens, block_hashes=tuple(range(blocks)), block_size=BS,
                       max_tokens=max_tokens)


def prefill(name: str, own: int = 0, pool: int = 0, queued_s: float = 0.0, profile: Profile = PROFILE,
            available: bool = True, pending: int = 0) -> InstanceView:
    return InstanceView(name, "prefill", profile.instance_model(), available=available, own_blocks=own,
                        pool_blocks=max(pool, own), queued_s=queued_s, queued_tokens=int(queued_s * 8000),
                        pending_blocks=pending)


def decode(name: str, batch: tuple[SeqLoad, ...] = (), total_blocks: int = 10_000) -> InstanceView:
    return InstanceView(name, "decode", PROFILE.instance_model(), batch=batch, total_kv_blocks=total_blocks,
                        free_kv_blocks=total_blocks)


def cluster(prefills, decodes=None, source: str | None = None, demand: int = 0) -> ClusterView:
    return ClusterView(0.0, tuple(prefills), tuple(decodes or [decode("d0"), decode("d1")]), source, demand)


# -- every policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_cold_cluster_every_policy_routes_without_reuse(name):
    """Nothing cached anywhere, nothing queued: a plain decision, no pull, no replication."""
    c = cluster([prefill(f"p{i}") for i in range(4)])
    d = make_policy(name).decide(request(), c)
    assert isinstance(d, Decision)
    assert d.prefill in {"p0", "p1", "p2", "p3"} and d.decode in {"d0", "d1"}
    assert d.reuse_blocks == 0 and d.pull_from is None and not d.replicate
    assert d.predicted_ttft_s > 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_instances_is_a_rejection_naming_the_role(name):
    policy = make_policy(name)
    r = policy.decide(request(), cluster([prefill("p0", available=False)]))
    assert isinstance(r, Rejection) and r.reason == "no_prefill"
    r = policy.decide(request(), ClusterView(0.0, (prefill("p0"),), (), None))
    assert isinstance(r, Rejection) and r.reason == "no_decode"


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="mooncake"):
        make_policy("fastest")


def test_cold_cluster_cost_aware_policies_prefer_the_fast_instance():
    """Per-instance models: an instance measured 2x slower loses when everything else is equal."""
    slow = prefill("p0")
    for _ in range(16):
        n, p = random.Random(_).randint(1000, 30000), 0
        slow.model.prefill.observe(n, p, 2 * PROFILE.prefill_s(n, p))
    c = cluster([slow, prefill("p1")])
    for name in ("cache_aware_local", "mooncake", "mooncaked_static"):
        assert make_policy(name).decide(request(), c).prefill == "p1"


def test_round_robin_cycles_and_random_spreads():
    c = cluster([prefill(f"p{i}") for i in range(3)])
    rr = make_policy("round_robin")
    assert len({rr.decide(request(), c).prefill for _ in range(3)}) == 3
    rnd = make_policy("random", seed=1)
    assert len({rnd.decide(request(), c).prefill for _ in range(30)}) == 3


def test_load_balance_ignores_the_cache():
    c = cluster([prefill("p0", own=40, queued_s=1.0), prefill("p1", pool=40)], source="p0")
    d = make_policy("load_balance").decide(request(), c)
    assert d.prefill == "p1" and d.reuse_blocks == 0


# -- hot prefix on a loaded instance ------------------------------------------------------------------
def hot_spot(holder_queue_s: float, demand: int = HOT_MIN_DEMAND) -> ClusterView:
    """``demand``: requests routed lately whose prompts held the holder's 40 blocks."""
    return cluster([prefill("holder", own=40, queued_s=holder_queue_s), prefill("idle", pool=40),
                    prefill("busy", pool=40, queued_s=30.0)], source="holder", demand=demand)


@pytest.mark.parametrize("name", ["mooncake", "mooncaked_static", "mooncaked"])
def test_hot_prefix_on_loaded_holder_is_replicated_elsewhere(name):
    """The holder is 20 s behind: pulling its 40 blocks to an idle instance wins, and they stay there."""
    d = make_policy(name).decide(request(), hot_spot(20.0))
    assert d.prefill == "idle"
    assert d.reuse_blocks == 40 and d.local_blocks == 0
    assert d.pull_from == "holder" and d.replicate
    assert d.predicted_ttft_s < 20.0


def test_mooncaked_pulls_a_prefix_too_few_asked_for_lately_but_does_not_replicate_it():
    """The same pull, but fewer other requests held the prefix lately: used for this request, not kept."""
    d = make_policy("mooncaked_static").decide(request(), hot_spot(20.0, demand=HOT_MIN_DEMAND - 1))
    assert d.prefill == "idle" and d.reuse_blocks == 40 and d.pull_from == "holder"
    assert not d.replicate


def test_mooncake_replicates_every_pull_its_balancing_threshold_allows_whatever_the_demand():
    """Algorithm 1 pulls only on its kvcache_balancing_threshold path, which is its hot-spot replication."""
    d = make_policy("mooncake").decide(request(), hot_spot(20.0, demand=0))
    assert d.pull_from == "holder" and d.replicate


@pytest.mark.parametrize("name", ["cache_aware_local", "mooncake", "mooncaked_static", "mooncaked"])
def test_hot_prefix_on_idle_holder_stays_there(name):
    d = make_policy(name).decide(request(), hot_spot(0.0))
    assert d.prefill == "holder" and d.reuse_blocks == 40 and d.local_blocks == 40
    assert d.pull_from is None and not d.replicate


def test_local_cache_aware_cannot_pull_so_recomputes_off_a_loaded_holder():
    d = make_policy("cache_aware_local").decide(request(), hot_spot(20.0))
    assert d.prefill == "idle" and d.reuse_blocks == 0


# -- remote prefix pulls: kvcache_balancing_threshold ----------------------------------------------------
@pytest.mark.parametrize("best, pulls", [(12, False), (13, True), (40, True)])
def test_mooncake_pulls_only_past_the_balancing_threshold(best, pulls):
    """Own run 10 blocks; pull the pool's run only when it is longer than 1.25 x 10."""
    c = cluster([prefill("p0", own=10, pool=best)], source="elsewhere")
    d = make_policy("mooncake", kvcache_balancing_threshold=1.25).decide(request(), c)
    assert d.reuse_blocks == (best if pulls else 10)
    assert (d.pull_from == "elsewhere") == pulls and d.replicate == pulls


def test_threshold_one_pulls_any_longer_prefix_and_below_one_is_refused():
    c = cluster([prefill("p0", own=10, pool=11)], source="elsewhere")
    assert make_policy("mooncake", kvcache_balancing_threshold=1.0).decide(request(), c).reuse_blocks == 11
    with pytest.raises(ValueError):
        make_policy("mooncake", kvcache_balancing_threshold=0.5)


def test_mooncaked_pulls_by_predicted_time_not_ratio():
    """Fast link: pull even 2 extra blocks. Link slower than recomputing: never pull, whatever the ratio."""
    fast = cluster([prefill("p0", own=10, pool=12)], source="elsewhere")
    assert make_policy("mooncaked_static").decide(request(), fast).reuse_blocks == 12
    from dataclasses import replace
    crawl = replace(PROFILE, remote_bps=1e8)  # 0.1 GB/s: a 160 MiB block takes 1.7 s, recomputing it ~0.1 s
    slow = cluster([prefill("p0", own=10, pool=40, profile=crawl)], source="elsewhere")
    assert make_policy("mooncaked_static").decide(request(), slow).reuse_blocks == 10
    assert make_policy("mooncake").decide(request(), slow).reuse_blocks == 40  # the ratio rule pulls anyway


# -- a prefix still being computed (mooncaked_static; ours inherits it) ---------------------------------------------------------
def in_flight(holder_queue_s: float) -> ClusterView:
    """p0 is computing the prompt's 40-block prefix for an earlier request, ``holder_queue_s`` from done."""
    return cluster([prefill("p0", queued_s=holder_queue_s, pending=40), prefill("p1")])


def test_mooncaked_queues_behind_a_prefix_in_flight_when_that_beats_recomputing():
    """Recomputing 40 blocks (~20k tokens) takes ~3.4 s; waiting 1 s for p0 to hold them wins."""
    recompute = PROFILE.prefill_s(40 * BS + 100, 0)
    d = make_policy("mooncaked_static").decide(request(), in_flight(1.0))
    assert d.prefill == "p0" and d.reuse_blocks == 40 and d.local_blocks == 40
    assert d.pull_from is None and not d.replicate
    assert d.predicted_ttft_s < 0.5 * recompute
    # Algorithm 1 sees only cached blocks: the prompt looks cold everywhere, so it recomputes on the idle p1
    d = make_policy("mooncake").decide(request(), in_flight(1.0))
    assert d.prefill == "p1" and d.reuse_blocks == 0


def test_mooncaked_recomputes_rather_than_wait_long_for_a_prefix_in_flight():
    d = make_policy("mooncaked_static").decide(request(), in_flight(10.0))
    assert d.prefill == "p1" and d.reuse_blocks == 0


# -- overloaded decode pool: prediction-based early rejection --------------------------------------------
def heavy_batch(n: int, context: int = 40_000, remaining: int = 10_000) -> tuple[SeqLoad, ...]:
    return tuple(SeqLoad(context, remaining) for _ in range(n))


@pytest.mark.parametrize("name", ["mooncake", "mooncaked_static", "mooncaked"])
def test_overloaded_decode_pool_is_rejected_early(name):
    """Every decode instance would step slower than the TBT SLO: reject before any prefill."""
    c = cluster([prefill("p0")], [decode("d0", heavy_batch(30)), decode("d1", heavy_batch(30))])
    slo = SLO(ttft_s=30.0, tbt_s=0.05)
    r = make_policy(name, slo=slo).decide(request(), c)
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"


@pytest.mark.parametrize("name", ["random", "round_robin", "load_balance", "cache_aware_local"])
def test_baselines_do_not_reject_on_load(name):
    c = cluster([prefill("p0")], [decode("d0", heavy_batch(30)), decode("d1", heavy_batch(30))])
    assert isinstance(make_policy(name, slo=SLO(tbt_s=0.05)).decide(request(), c), Decision)


def test_decode_choice_is_the_least_loaded_that_meets_the_slo():
    c = cluster([prefill("p0")], [decode("d0", heavy_batch(20)), decode("d1", heavy_batch(5)), decode("d2", heavy_batch(30))])
    d = make_policy("mooncake", slo=SLO(tbt_s=0.05)).decide(request(), c)
    assert d.decode == "d1" and d.predicted_tbt_s <= 0.05


def test_forecast_counts_only_sequences_still_running_when_the_request_arrives():
    """The batch is heavy now but finishes within the request's prefill: accept (no load swing)."""
    ending = heavy_batch(30, remaining=3)
    c = cluster([prefill("p0")], [decode("d0", ending)])
    slo = SLO(ttft_s=30.0, tbt_s=0.05)
    req = request()
    f_now = forecast_decode(c.decodes[0], req, 0.0, 0.0)
    f_later = forecast_decode(c.decodes[0], req, 0.0, 5.0)
    assert f_now.batch == 31 and f_now.tbt_s > slo.tbt_s
    assert f_later.batch == 1 and f_later.tbt_s < slo.tbt_s
    d = make_policy("mooncake", slo=slo).decide(req, c)
    assert isinstance(d, Decision) and d.decode == "d0"


def test_incoming_sequences_count_against_the_decode_instance():
    """Sequences still prefilling toward d0 make it the busier one even though nothing runs there."""
    incoming = tuple(SeqLoad(40_000, 500, joins_at_s=3.0) for _ in range(10))
    c = cluster([prefill("p0")], [decode("d0", incoming), decode("d1", heavy_batch(2))])
    assert make_policy("mooncake").decide(request(), c).decode == "d1"


def test_no_kv_room_is_rejected_and_baselines_pick_the_roomiest():
    full = decode("d0", heavy_batch(4, context=100_000), total_blocks=800)
    c = cluster([prefill("p0")], [full])
    r = make_policy("mooncake", slo=SLO()).decide(request(), c)
    assert isinstance(r, Rejection) and r.reason == "kv_capacity"
    # early rejection is opt-in: without an SLO the request goes to the least loaded decode anyway
    assert isinstance(make_policy("mooncake").decide(request(), c), Decision)
    c2 = cluster([prefill("p0")], [full, decode("d1", heavy_batch(10))])
    assert make_policy("load_balance").decide(request(), c2).decode == "d1"


def test_ttft_rejection_only_for_load_it_can_shed():
    slo = SLO(ttft_s=10.0, tbt_s=0.1)
    queued = cluster([prefill("p0", queued_s=60.0), prefill("p1", queued_s=50.0)])
    r = make_policy("mooncake", slo=slo).decide(request(), queued)
    assert isinstance(r, Rejection) and r.reason == "ttft_slo"
    huge = request(blocks=300)  # ~150k tokens: over 10 s even on an idle cluster
    assert isinstance(make_policy("mooncake", slo=slo).decide(huge, cluster([prefill("p0")])), Decision)


# -- the fitted step-time models ------------------------------------------------------------------------
def test_prefill_model_recovers_a_known_polynomial_from_a_wrong_prior():
    true = (0.03, 0.2, 0.004, 0.0015)
    m = PrefillTimeModel(prior=(1.0, 0.0, 0.0, 0.0), window=256)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, p = int(rng.integers(100, 60_000)), int(rng.integers(0, 60_000))
        m.observe(n, p, sum(c * f for c, f in zip(true, PrefillTimeModel.features(n, p))))
    m.refit()
    # the prior is worth a hundredth of a sample: it shifts the constant a little, not the predictions
    np.testing.assert_allclose(m.coef[1:], true[1:], rtol=3e-2)
    for n in (100, 1000, 10_000, 60_000):
        for p in (0, 10_000, 60_000):
            truth = sum(c * f for c, f in zip(true, PrefillTimeModel.features(n, p)))
            assert m.predict(n, p) == pytest.approx(truth, rel=0.04)
    truth = sum(c * f for c, f in zip(true, PrefillTimeModel.features(8000, 4000)))
    assert m.predict(8000, 4000) == pytest.approx(truth, rel=1e-2)


@pytest.mark.parametrize("prior", [PROFILE, GENERIC], ids=lambda p: p.name)
def test_a_few_short_samples_do_not_swing_long_prompt_predictions(prior):
    """Two tiny prompts (3% measurement noise) say nothing about a 37k-token one: the prior still does.

    The old fit (ridge scaled by the data's own features) predicted 440 s after the first
    and 25 ms after the second for a 7 s prefill, and the scheduler queued long prompts there.
    """
    m = prior.instance_model().prefill
    m.observe(29, 0, prior.prefill_s(29, 0) * 1.03)
    assert 0.5 < m.predict(37_064, 0) / prior.prefill_s(37_064, 0) < 2.0
    m.observe(39, 0, prior.prefill_s(39, 0) * 0.97)
    assert 0.5 < m.predict(37_064, 0) / prior.prefill_s(37_064, 0) < 2.0
    assert m.predict(29, 0) == pytest.approx(prior.prefill_s(29, 0), rel=0.05)


@pytest.mark.parametrize("seed", range(6))
def test_a_prompt_longer_than_any_measured_follows_the_priors_curve_at_the_measured_speed(seed):
    """Five prompts of up to 20k tokens (10% noise) on a machine at 0.9x the profile: a fitted polynomial
    predicted a 191k-token prompt at 0.37x-1.30x its time over these seeds (a simulated elastic run sent
    such a prompt to the instance that underpredicted most: short prompts then queued a minute behind
    it). Beyond the longest measured prompt the model takes the prior's curve from the fit's value there."""
    m = PrefillTimeModel(prior=PROFILE.prefill_coef)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        n = int(rng.integers(200, 20_000))
        m.observe(n, 0, PROFILE.prefill_s(n, 0) / 0.9 * float(np.exp(rng.normal(0, 0.1))))
    truth = PROFILE.prefill_s(191_000, 0) / 0.9
    assert 0.8 < m.predict(191_000, 0) / truth < 1.25
    reach = m.reach_tokens
    fitted = sum(c * f for c, f in zip(m.coef, PrefillTimeModel.features(reach, 0)))
    assert 10_000 < reach < 20_000 and m.predict(reach, 0) == pytest.approx(fitted)  # the fit, up to its reach
    fixed = PROFILE.prefill_coef[0]
    assert m.predict(2 * reach, 0) == pytest.approx(m.coef[0] + (fitted - m.coef[0]) * (
        PROFILE.prefill_s(2 * reach, 0) - fixed) / (PROFILE.prefill_s(reach, 0) - fixed))


def test_past_the_longest_measured_prompt_a_steps_fixed_cost_is_not_scaled():
    """A step's fixed cost (here 0.5 s, as a CPU engine's overheads can be) stays fixed past the reach, and
    the conductor's prior (GENERIC) has none: scaling the whole time at 256 tokens by the prior's
    2048/256 would predict 1.4x a 2048-token prompt's time. Only the variable part grows."""
    m = GENERIC.instance_model().prefill
    for n in range(64, 257, 16):
        m.observe(n, 0, 0.5 + 0.004 * n)
    m.refit()  # the reach moves with the fit (lazily, every few samples)
    truth = 0.5 + 0.004 * 2048
    assert m.reach_tokens == 256 and 0.9 < m.predict(2048, 0) / truth < 1.1
    assert m.predict(2048, 0) < 0.8 * m.predict(256, 0) * 2048 / 256


def test_prefill_model_follows_a_sliding_window():
    """The instance got 2x slower: once the window has only new samples, so has the model."""
    m = PrefillTimeModel(prior=PROFILE.prefill_coef, window=64)
    rng = np.random.default_rng(1)
    for speed in (1.0, 0.5):
        for _ in range(64):
            n, p = int(rng.integers(500, 40_000)), int(rng.integers(0, 40_000))
            m.observe(n, p, PROFILE.prefill_s(n, p) / speed)
    assert m.predict(10_000, 5_000) == pytest.approx(2 * PROFILE.prefill_s(10_000, 5_000), rel=1e-2)


def test_model_keeps_the_prior_where_the_data_says_nothing_and_never_goes_negative():
    """Only prefix-free samples: the n*p term stays at its prior; noisy data cannot fit a negative cost."""
    m = PrefillTimeModel(prior=PROFILE.prefill_coef)
    rng = np.random.default_rng(2)
    for _ in range(100):
        n = int(rng.integers(100, 30_000))
        m.observe(n, 0, PROFILE.prefill_s(n, 0) * float(np.exp(rng.normal(0, 0.3))))
    m.refit()
    assert m.coef[2] == pytest.approx(PROFILE.prefill_coef[2], rel=1e-3)
    assert all(c >= 0 for c in m.coef)
    assert m.predict(100_000, 100_000) > m.predict(100_000, 0) > 0


def test_decode_model_recovers_a_known_line():
    true = (0.02, 0.0005, 0.00004)
    m = DecodeTimeModel(prior=(0.0, 0.0, 0.0))
    for b in range(1, 64, 3):
        for ctx in (1_000, 50_000, 400_000):
            m.observe(b, ctx * b, sum(c * f for c, f in zip(true, DecodeTimeModel.features(b, ctx * b))))
    m.refit()
    np.testing.assert_allclose(m.coef, true, rtol=1e-2, atol=1e-6)


def test_backlog_counts_waiting_work_and_the_running_remainder():
    b = PrefillBacklog()
    b.add("a", 4.0, 1000)
    b.add("b", 2.0, 500)
    assert b.seconds(0.0) == pytest.approx(6.0) and b.waiting_tokens == 1500
    b.start("a", now_s=10.0)
    assert b.seconds(11.0) == pytest.approx(3.0 + 2.0) and b.waiting_tokens == 500
    b.finish("a")
    b.finish("b")  # finished without being seen to start
    assert b.seconds(12.0) == 0.0 and b.waiting_tokens == 0


# -- the prefix index --------------------------------------------------------------------------------
def test_index_own_runs_pool_run_and_slow_media():
    idx = PrefixIndex()
    idx.stored("p0", [1, 2, 3], "dram")
    idx.stored("p1", [1, 2], "hbm")
    idx.stored("store:a", [3, 4, 5], "lmdb")
    look = idx.lookup([1, 2, 3, 4, 5, 6])
    assert look.holders == {"p0": 3, "p1": 2}
    assert look.pool_blocks == 5 and look.pool_slow == 2  # blocks 4, 5 only on disk
    assert look.pool_source == "p0"
    assert idx.match([1, 2, 3]) == {"p0": 3, "p1": 2}
    idx.stored("p1", [3], "lmdb")
    look = idx.lookup([1, 2, 3])
    assert look.holders["p1"] == 3 and look.holder_slow["p1"] == 1


def test_index_lookup_stops_at_the_first_block_nobody_holds():
    """O(prompt blocks) at most, and in fact O(matched blocks): a 1000-block prompt with a miss at 5 reads 6."""
    class Counting(OrderedDict):
        gets = 0

        def get(self, key, default=None):
            type(self).gets += 1
            return super().get(key, default)

    idx = PrefixIndex()
    idx.stored("p0", list(range(10)), "dram")
    idx._holders = Counting(idx._holders)
    look = idx.lookup(list(range(5)) + [999] + list(range(5, 1000)))
    assert look.pool_blocks == 5 and Counting.gets == 6


def test_index_memory_is_bounded_and_hits_keep_a_prefix():
    idx = PrefixIndex(max_entries=4)
    idx.stored("p0", [1, 2], "dram")
    idx.stored("p0", [3, 4], "dram")
    idx.lookup([1, 2])          # a hit refreshes 1 and 2
    idx.stored("p0", [5, 6], "dram")
    assert len(idx) == 4
    assert idx.match([1, 2]) == {"p0": 2}
    assert idx.match([3]) == {}


def test_index_drop_instance_and_removed():
    idx = PrefixIndex()
    idx.stored("p0", [1, 2], "dram")
    idx.stored("p1", [1], "dram")
    idx.removed("p0", [2])
    assert idx.lookup([1, 2]).pool_blocks == 1
    idx.drop_instance("p1")
    assert idx.match([1]) == {"p0": 1}
    idx.drop_instance("p0")
    assert len(idx) == 0


# -- the live adapter --------------------------------------------------------------------------------
def live_registry(n_prefill: int = 2, n_decode: int = 2):
    from mooncaked.conductor.registry import Instance, Registry
    from mooncaked.engine.kv_cache import KVLayout
    from mooncaked.proto.mooncake.v1 import common_pb2

    layout = KVLayout(num_layers=2, num_blocks=100, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32",
                      element_size=4)
    reg = Registry(heartbeat_timeout_s=10.0)
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        for i in range(n):
            inst = Instance(f"{role[0]}{i}", role, "127.0.0.1:1", "m", layout, common_pb2.TransferEndpoint())
            inst.load = common_pb2.InstanceLoad(free_kv_blocks=100, total_kv_blocks=100)
            reg.instances[inst.name] = inst
    return reg


def test_live_pick_without_state_keeps_the_cache_aware_default():
    from mooncaked.conductor.router import pick

    reg = live_registry()
    idx = PrefixIndex()
    idx.stored("p1", [11, 12, 13], "dram")
    route = pick(reg, idx, [11, 12, 13], 14)
    assert route.prefill.name == "p1" and route.cached_blocks == 3 and route.decision is not None
    reg.find("d0").load.running_requests = 3
    assert pick(reg, idx, [11, 12, 13], 14).decode.name == "d1"
    assert pick(reg, idx, [11, 12, 13], 14, {"p1"}).prefill.name == "p0"


def test_live_pick_with_state_routes_books_and_rejects():
    from mooncaked.conductor.router import NoInstanceError, RejectedError, SchedulerState, pick

    reg = live_registry()
    idx = PrefixIndex()
    state = SchedulerState(make_policy("mooncake", slo=SLO(ttft_s=5.0, tbt_s=0.1)), clock=lambda: 100.0)
    route = pick(reg, idx, [1, 2], 10, state=state, max_tokens=4, request_id="r1")
    state.routed("r1", route, 10, 4)
    assert state.backlog(route.prefill.name).waiting_tokens == 10
    assert state.seqs["r1"].decode == route.decode.name
    state.tokens("r1", 2)
    assert state.seqs["r1"].remaining == 1
    state.prefill_done("r1", route.prefill.name, uncached=10, prefix=0, compute_s=0.01)
    state.finished("r1")
    assert not state.seqs and state.backlog(route.prefill.name).seconds(100.0) == 0.0
    for p in ("p0", "p1"):  # both prefill instances 60 s behind: over the 5 s TTFT SLO
        state.backlog(p).add(f"q-{p}", 60.0, 1000)
    with pytest.raises(RejectedError) as e:
        pick(reg, idx, [1, 2], 10, state=state, max_tokens=4)
    assert e.value.reason == "ttft_slo"
    with pytest.raises(NoInstanceError, match="prefill"):
        pick(reg, idx, [1, 2], 10, {"p0", "p1"}, state=state)


def test_live_transfers_are_predicted_in_the_instances_own_block_bytes():
    """The prior's block is 1 MiB; the instances here hold 2 layers x K,V x 4 tokens x 8 floats = 512 bytes a
    block. A pull is predicted in those bytes, so its predicted cost follows the blocks' real size."""
    from mooncaked.conductor.router import SchedulerState, pick

    reg = live_registry()
    idx = PrefixIndex()
    state = SchedulerState(make_policy("mooncake"), clock=lambda: 100.0)
    pick(reg, idx, [1, 2], 10, state=state, max_tokens=4)
    assert reg.find("p0").layout.whole_block_bytes == 512
    for name in ("p0", "p1", "d0", "d1"):
        assert state.models[name].transfer.block_bytes == 512
    t = state.models["p0"].transfer
    assert t.seconds(remote_blocks=10) == pytest.approx(10 * 512 / t.remote_bps)


# -- how hot a prefix is (PrefixDemand) ----------------------------------------------------------------
def test_demand_counts_recent_requests_that_held_the_whole_run_once_each():
    demand = PrefixDemand(window_s=60.0)
    demand.routed("a", (1, 2, 3), 0.0)
    demand.routed("a", (1, 2, 3), 1.0)  # a retry of the same request counts once
    demand.routed("b", (1, 2, 9), 10.0)  # shares the first two blocks only (chained hashes)
    assert [demand.count((1, 2, 3), n, 20.0) for n in (0, 1, 2, 3)] == [0, 2, 2, 1]
    assert demand.count((1, 2, 3), 4, 20.0) == 0  # more blocks than the prompt has
    assert demand.count((1, 2, 3), 2, 65.0) == 1  # "a" has left the window, "b" not yet
    assert demand.count((1, 2, 3), 2, 71.0) == 0


def test_demand_forgets_blocks_nobody_asked_for_within_the_window_and_saturates():
    demand = PrefixDemand(window_s=10.0, keep=2)
    for i in range(5):
        demand.routed(f"r{i}", (7,), float(i))
    assert demand.count((7,), 1, 5.0) == 2  # at most ``keep`` remembered: enough to tell hot from not
    demand.routed("late", (8,), 100.0)  # sweeps
    assert set(demand._seen) == {8}
    with pytest.raises(ValueError):
        PrefixDemand(window_s=-1.0)
