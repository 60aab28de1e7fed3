"""tools/simulate.py on a small slice of a trace: it runs every policy and writes the documented JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TRACE = ROOT / "tools" / "traces" / "synthetic_trace.jsonl"
SCHEMA = ("mean_ttft_s", "p90_ttft_s", "tbt_slo_attainment", "goodput_rps", "rejected", "prefill_tokens_computed")


def load_simulate():
    spec = importlib.util.spec_from_file_location("simulate", ROOT / "tools" / "simulate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def simulate():
    return load_simulate()


@pytest.fixture(scope="module")
def trace_slice(tmp_path_factory) -> Path:
    """The first 120 requests of the bundled trace (Mooncake's public synthetic trace)."""
    out = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    with open(BUNDLED_TRACE) as f:
        out.write_text("".join(next(f) for _ in range(120)))
    return out


def test_every_policy_runs_and_the_json_has_the_schema(simulate, trace_slice, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    rc = simulate.main(["--trace", str(trace_slice), "--prefill", "3", "--decode", "2", "--json", str(report_path)])
    assert rc == 0
    table = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    policies = report["policies"]
    from mooncaked.conductor.policies import POLICY_NAMES

    assert set(policies) == set(POLICY_NAMES)
    for name, row in policies.items():
        assert name in table
        for key in SCHEMA:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (name, key)
        assert isinstance(row["rejected"], int) and isinstance(row["prefill_tokens_computed"], int)
        assert 0.0 <= row["tbt_slo_attainment"] <= 1.0
        assert row["served"] + row["rejected"] + row["dropped_after_prefill"] == row["requests"] == 120
        assert row["prefill_tokens_computed"] + row["prefill_tokens_reused"] > 0
    # the cache-aware policies reuse more of the prompts than the cache-blind ones
    assert policies["mooncake"]["prefill_tokens_reused"] >= policies["round_robin"]["prefill_tokens_reused"]


def test_json_to_stdout_is_one_object(simulate, trace_slice, capsys):
    rc = simulate.main(["--trace", str(trace_slice), "--prefill", "2", "--decode", "1", "--policy", "mooncake",
                        "load_balance", "--max-requests", "40", "--json", "-"])
    assert rc == 0
    out = capsys.readouterr().out.strip()
    report = json.loads(out)  # one JSON object and nothing else
    assert set(report["policies"]) == {"mooncake", "load_balance"}
    assert report["config"]["requests"] == 40


def test_bad_trace_is_reported_not_raised(simulate, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "many"}\n')
    assert simulate.main(["--trace", str(bad), "--json", "-"]) == 2
    assert "not a Mooncake trace line" in capsys.readouterr().err


def test_a_measured_profile_file_is_fitted(simulate, trace_slice, tmp_path, capsys):
    """A profile of measured samples (as a real engine would give) replaces the built-in coefficients."""
    prefill = [[n, p, 0.001 + 0.0002 * n / 1000 + 1e-6 * n * p / 1e6] for n in (16, 256, 1024) for p in (0, 512)]
    decode = [[b, b * 500, 0.01 + 0.001 * b] for b in (1, 4, 16)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"name": "cpu-test", "prefill_samples": prefill, "decode_samples": decode}))
    from mooncaked.conductor.cost_model import Profile

    prof = Profile.from_json(path)
    assert prof.name == "cpu-test" and prof.prefill_s(1024, 0) < 0.01
    rc = simulate.main(["--trace", str(trace_slice), "--prefill", "2", "--decode", "2", "--policy", "mooncake",
                        "--profile", str(path), "--max-requests", "30", "--json", "-"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["policies"]["mooncake"]["mean_ttft_s"] < 1.0


def test_simulator_is_importable_without_torch_side_effects():
    """The scheduling modules the simulator drives import without the engine (no torch, no grpc)."""
    code = ("import sys; sys.path.insert(0, 'tools'); import sim.engine, mooncaked.conductor.policies; "
            "print('torch' in sys.modules, 'grpc' in sys.modules)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
