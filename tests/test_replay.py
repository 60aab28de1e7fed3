"""tools/replay.py: its token synthesis (equal hash ids -> equal blocks), and whole replays
against `mooncaked --role all` over HTTP that must finish and write their report and plot."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster import Cluster, free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from replay import Synthesizer, TraceRequest, load_trace  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TRACE = ROOT / "tools" / "traces" / "synthetic_trace.jsonl"  # bundled: Mooncake's public trace


def test_equal_hash_ids_give_equal_token_blocks():
    s = Synthesizer(length_scale=0.01, vocab_size=256)
    assert s.block_tokens == 5
    a = s.prompt(0, TraceRequest(0, 0.0, 1500, 10, (7, 8, 9)))
    b = s.prompt(1, TraceRequest(0, 5.0, 1200, 10, (7, 8, 11)))
    c = Synthesizer(length_scale=0.01, vocab_size=256).prompt(2, TraceRequest(0, 9.0, 1500, 10, (7, 8, 9)))
    assert len(a) == 15 and len(b) == 12
    assert a[:10] == b[:10] and a[10:12] != b[10:12]  # shared hash ids, then a different block
    assert a == c  # deterministic: the same hash ids give the same tokens in any run
    assert all(s.low <= t < 256 for t in a + b)
    # a prompt longer than its hash ids cover gets a tail of its own
    d = s.prompt(3, TraceRequest(0, 0.0, 1000, 10, (7,)))
    e = s.prompt(4, TraceRequest(0, 0.0, 1000, 10, (7,)))
    assert d[:5] == e[:5] == a[:5] and d[5:] != e[5:]


def test_lengths_scale_and_fit_the_context():
    s = Synthesizer(length_scale=0.01, vocab_size=256, max_prompt_tokens=511)
    assert s.lengths(TraceRequest(0, 0.0, 40160, 600, ())) == (402, 6)
    n_in, n_out = s.lengths(TraceRequest(0, 0.0, 191378, 90000, ()))
    assert n_in + n_out <= 511 and n_out >= 1
    assert s.lengths(TraceRequest(0, 0.0, 28, 3, ())) == (1, 1)  # never zero


def test_bad_trace_lines_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    assert len(load_trace(bad, 1)) == 1  # reads no further than asked
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(bad, None)


@pytest.fixture(scope="module")
def all_role(tiny_model_factory, tmp_path_factory):
    """`mooncaked --role all` with its HTTP front; yields the base URL once /health says ready."""
    _, folder = tiny_model_factory("llama")
    logs = tmp_path_factory.mktemp("replay-logs")
    env = Cluster(folder, logs).env()
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "mooncaked.cli", "--role", "all", "--listen", f"127.0.0.1:{free_port()}",
           "--http", url.removeprefix("http://")]
    log = open(logs / "all.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (logs / "all.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the all role did not get ready"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _replay(url: str, trace: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "replay.py"), "--trace", str(trace), "--url", url,
           "--length-scale", "0.01", "--out", str(out), "--request-timeout", "30", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def _check_outputs(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("ttft_s", "tbt_s"):
        assert set(report[key]) >= {"p50", "p90", "p99"}
    return report


def test_replay_a_slice_of_the_trace(all_role, tmp_path):
    assert TRACE.is_file(), f"the bundled trace is missing: {TRACE}"
    done = _replay(all_role, TRACE, tmp_path, "--max-requests", "8", "--time-scale", "0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8/8" in done.stderr  # the progress bar ran to the end
    report = _check_outputs(tmp_path)
    assert report["requests"] == {"sent": 8, "completed": 8, "rejected": 0, "failed": 0, "timed_out": 0}
    assert report["ttft_s"]["p50"] > 0 and report["slo_attainment"] == 1.0 and report["goodput_rps"] > 0
    assert report["settings"]["block_tokens"] == 5
    assert "SLO attainment" in done.stdout and "hit rate" in done.stdout


def test_replay_shared_prefixes_hit_the_cache(all_role, tmp_path):
    """Requests whose hash ids share a prefix must find it cached: the synthesized tokens are equal."""
    trace = tmp_path / "shared.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1800 + 300 * i, "output_length": 300,
             "hash_ids": [0, 1, 2] + [10 + i, 20 + i]} for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _replay(all_role, trace, tmp_path / "out", "--time-scale", "5", "--no-progress",
                   "--slo-ttft", "0.000001")
    assert done.returncode == 0, done.stderr[-3000:]
    report = _check_outputs(tmp_path / "out")
    assert report["requests"]["completed"] == 4
    # requests 2..4 reuse the 15-token shared prefix (three 5-token blocks) at least
    assert report["cached_tokens"] >= 3 * 12 and 0 < report["hit_rate"] < 1
    assert report["slo_attainment"] == 0.0  # an SLO nothing can meet is reported as missed
    assert [r["completion_tokens"] for r in report["per_request"]] == [3] * 4
