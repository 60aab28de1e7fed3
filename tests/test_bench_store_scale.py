"""`tools/bench_store.py --scale` runs end to end on a small pool: a real `mooncaked --role store`
process driven by simulated engines, the state machine in-process, and Mooncake's master (or the
reason it could not run); one JSON object, every object put and found again, nobody dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scale_json_small_pool() -> None:
    proc = subprocess.run([sys.executable, "tools/bench_store.py", "--scale", "--json", "--objects", "1024",
                           "--segments", "8", "--batch", "32", "--depth", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["mode"] == "scale" and out["shape"]["objects"] == 1024 and out["shape"]["segments"] == 8
    for name in ("ours_process", "ours_inprocess"):
        r = out[name]
        assert r["put"]["no_room"] == 0, r
        # 32 sampled chains of 32 keys, all present
        assert r["get"]["found"] == 1024 and r["longest_prefix"]["found"] == 1024, r
        assert r["bytes_per_object"] > 0 and r["rss_mib"]["full"] >= r["rss_mib"]["start"], r
        assert len(r["eviction_round_ms"]) == 3 and all(n > 0 for n in r["evicted_per_round"]), r
    assert out["ours_process"]["clients_lost"] == [] and out["ours_process"]["tasks_stream"]["errors"] == []
    assert out["ours_inprocess"]["traced"]["bytes_per_object"] > 0
    mc = out["mooncake"]
    if "skipped" in mc:
        assert mc["skipped"], "a skipped baseline says why"
        assert out["ratios"] is None
    else:
        assert mc["put"]["failed"] == 0 and mc["get"]["found"] == 1024, mc
        assert set(out["ratios"]) >= {"put", "get", "longest_prefix", "bytes_per_object"}
