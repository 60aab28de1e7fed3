"""Live replay agrees with the simulator (issue 14): 100 requests of the bundled trace slice, 2 prefill + 2
decode real processes, each policy: the live ``cache_hit_rate`` is within 0.05 of what ``tools/simulate.py``
predicts for the same slice with a profile measured on the same (tiny) model.

One set of engines serves every policy through its own conductor side by side (tools/replay_vs_sim.py
``--cluster shared``): each policy's replay synthesizes its own tokens, so none finds another's prefixes.
TTFTs and the order of the policies are reported by the tool, not asserted (timing on a noisy machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from replay_vs_sim import (BOTH_POLICIES, Slice, cluster_env, compare, cut_trace, format_table,  # noqa: E402
                           measure_profile, replay_live, shared_cluster, simulate_slice)

pytestmark = pytest.mark.timeout(400)

BLOCK = 4
KV_BYTES = 64 << 20  # no policy's blocks evict another's (6 x ~16k prompt tokens over two prefills)
SLICE = Slice(max_requests=100, time_scale=0.2, length_scale=0.01, request_timeout_s=120.0)


def test_live_hit_rates_agree_with_the_simulator_for_every_policy(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    profile = measure_profile(str(folder), tmp_path / "profile.json", BLOCK, KV_BYTES)
    policies = list(BOTH_POLICIES)
    assert {"random", "load_balance", "mooncake", "mooncaked_static"} <= set(policies)
    sim = simulate_slice(profile, SLICE, policies)
    live = {}
    with shared_cluster(cluster_env(str(folder), BLOCK, KV_BYTES, 0.2), tmp_path, policies) as urls:
        for i, p in enumerate(policies):
            live[p] = replay_live(urls[p], SLICE, seed=i)
    cmp = compare(live, sim)
    print(format_table(cmp))
    for p in policies:
        assert live[p]["requests"]["completed"] == SLICE.max_requests, (p, live[p]["error_samples"])
        row = cmp["policies"][p]
        assert row["hit_rate_gap"] <= 0.05, (p, row)
    # the slice does share prefixes, and the live cluster finds them
    assert max(r["live"]["cache_hit_rate"] for r in cmp["policies"].values()) > 0.02


def test_a_slice_cut_later_in_the_trace_starts_at_zero_and_keeps_its_requests(tmp_path):
    import json

    from sim.trace import DEFAULT_TRACE, load_trace

    rows = [json.loads(line) for line in DEFAULT_TRACE.read_text().splitlines()]
    cut = cut_trace(DEFAULT_TRACE, 3500, tmp_path / "cut.jsonl")
    reqs = load_trace(cut, max_requests=5)
    assert reqs[0].arrival_s == 0.0
    assert [r.input_length for r in reqs] == [r["input_length"] for r in rows[3500:3505]]
    assert reqs[4].arrival_s == (rows[3504]["timestamp"] - rows[3500]["timestamp"]) / 1000.0
    assert cut_trace(DEFAULT_TRACE, 0, tmp_path / "none.jsonl") == DEFAULT_TRACE
    with pytest.raises(ValueError, match="only"):
        cut_trace(DEFAULT_TRACE, len(rows) + 1, tmp_path / "past.jsonl")


def test_the_order_check_leaves_out_pairs_the_simulator_cannot_separate():
    from replay_vs_sim import pair_agreement

    def row(sim: float, live: float) -> dict:
        return {"sim": {"mean_ttft_s": sim}, "live": {"mean_ttft_s": live}}

    rows = {"random": row(5.0, 9.0), "round_robin": row(3.0, 10.0), "mooncake": row(2.0, 4.1),
            "mooncaked_static": row(2.05, 4.0)}
    pairs = pair_agreement(rows, 0.10)
    assert pairs["tied_in_sim"] == [["mooncake", "mooncaked_static"]]  # 2.5 % apart: the live order is not judged
    assert pairs["disagree"] == [["random", "round_robin"]]  # the simulator says round_robin is faster
    assert len(pairs["agree"]) == 4
    assert pair_agreement(rows, 0.0)["disagree"] == [["random", "round_robin"], ["mooncake", "mooncaked_static"]]


def test_rounds_are_averaged_and_each_kept():
    from replay_vs_sim import mean_of_rounds

    def run(ttft, hit, computed):
        return {"requests": {"sent": 10, "completed": 10, "failed": 0}, "mean_ttft_s": ttft, "p90_ttft_s": 2 * ttft,
                "cache_hit_rate": hit, "prefill_tokens_computed": computed}

    one = run(1.0, 0.2, 100)
    assert mean_of_rounds([one]) is one
    two = mean_of_rounds([run(1.0, 0.2, 100), run(3.0, 0.3, 103)])
    assert two["mean_ttft_s"] == 2.0 and two["p90_ttft_s"] == 4.0 and two["prefill_tokens_computed"] == 102
    assert abs(two["cache_hit_rate"] - 0.25) < 1e-12
    assert two["requests"] == {"sent": 20, "completed": 20, "failed": 0}
    assert [r["mean_ttft_s"] for r in two["rounds"]] == [1.0, 3.0]
    sim = {"a": run(1.0, 0.2, 100), "b": run(2.0, 0.2, 100)}
    cmp = compare({"a": two, "b": run(5.0, 0.2, 100)}, sim)
    assert [r["mean_ttft_s"] for r in cmp["policies"]["a"]["live_rounds"]] == [1.0, 3.0]
    assert "a: live mean TTFT ms by round: 1000.0, 3000.0" in format_table(cmp)
    assert cmp["pairs"]["agree"] == [["a", "b"]]
