"""tools/bench_cluster.py end to end: a real `mooncaked --role all` on a tiny model, then the engine alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_cluster_bench_measures_both_sides_and_their_ratios(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_cluster.py"), "--quick", "--json",
                           "--model", str(folder), "--long-words", "40", "--kv-cache-bytes", str(64 << 20)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    figures = ["tok_s_c1", "tok_s_c2", "ttft_short_s", "ttft_long_s"]
    for side in ("cluster", "engine"):
        assert sorted(result[side]) == sorted(figures)
        assert all(v > 0 for v in result[side].values()), result
    assert result["ratios"] == pytest.approx({
        "cluster_vs_engine_tok_s_c1": result["cluster"]["tok_s_c1"] / result["engine"]["tok_s_c1"],
        "cluster_vs_engine_tok_s_c2": result["cluster"]["tok_s_c2"] / result["engine"]["tok_s_c2"],
        "engine_vs_cluster_ttft_short_s": result["engine"]["ttft_short_s"] / result["cluster"]["ttft_short_s"],
        "engine_vs_cluster_ttft_long_s": result["engine"]["ttft_long_s"] / result["cluster"]["ttft_long_s"],
    }, rel=0.01)
