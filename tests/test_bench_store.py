"""`tools/bench_store.py` runs end to end on a few small objects (our TCP row against no baseline):
one JSON object with every row, the single puts with their commit behind, and the share of gets
the owner served by key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_store_json_small() -> None:
    proc = subprocess.run([sys.executable, "tools/bench_store.py", "--json", "--only", "ours", "--objects", "24",
                           "--object-kib", "64", "--batch", "8", "--reps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    ours = out["ours"]
    for row in ("put", "put_commit_behind", "get", "get_spin", "batch_put", "batch_get"):
        assert ours[row]["mb_s"] > 0, row
    assert 0 <= ours["get_share_by_owner"] <= 1
    assert ours["get_spin_share_by_owner"] == 1.0  # the polling client learned every owner in its untimed pass
    assert ours["get_share_by_index"] == 0  # over TCP no reader maps the owner's index
    assert out["mooncake"] is None and out["ratios"] is None and "not asked for" in out["baseline"]
    assert "tcp_ceilings" not in out and "aims" not in out  # no baseline, no ceiling or aim to show
    floors = out["floors"]
    assert floors["round_trip_p50_ms"] > 0 and floors["tcp_request_response_p50_ms"] > 0
    assert out["round_trips"]["mooncake"] == {"put": 3, "get": 2} and out["round_trips"]["ours"]["get"] == 1


def test_the_tcp_ceiling_is_the_baselines_p50_over_the_raw_floor() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_store import tcp_ceilings

    mooncake = {"put": {"p50_ms": 0.8}, "get": {"p50_ms": 0.33}}
    assert tcp_ceilings({"tcp_request_response_p50_ms": 0.25}, mooncake) == {"put": 3.2, "get": 1.32}


def test_the_aims_name_the_row_they_compare_and_whether_it_clears() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_store import aims

    ratios = {"ours": {"put": 2.2, "put_commit_behind": 3.4, "get": 1.97}, "ours_shm": {"put": 4.1, "get": 7.0}}
    got = aims(ratios)
    assert got["tcp_put"] == {"row": "ours.put_commit_behind", "ratio": 3.4, "aim": 3.0, "met": True,
                              "note": "the plain put, which waits for the master's commit: 2.20x"}
    assert got["tcp_get"] == {"row": "ours.get", "ratio": 1.97, "aim": 2.0, "met": False}
    polled = aims({"ours": {"get": 1.97, "get_spin": 2.3}})["tcp_get"]
    assert not polled["met"] and "2.30x" in polled["note"] and "owner_read_spin_us" in polled["note"]
    assert got["shm_put"]["met"] and got["shm_get"]["met"]
    assert set(aims({"ours": {"get": 2.5}})) == {"tcp_get"}  # rows a run did not measure are not judged
