"""tools/route_trace.py reads back the conductor's route lines as the conductor writes them."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import route_trace  # noqa: E402

from mooncaked.cli import LOG_FORMAT  # noqa: E402
from mooncaked.conductor.engine_link import PrefillResult  # noqa: E402
from mooncaked.conductor.placement import _route_trace  # noqa: E402
from mooncaked.conductor.router import Route  # noqa: E402
from mooncaked.conductor.views import Decision  # noqa: E402


def _write_log(path: Path, requests: list[tuple[str, int, int, float, float]]) -> None:
    """One DEBUG route line per (instance, cached, computed, compute_s, end time), formatted as mooncaked
    formats its logs."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for i, (inst, cached, computed, compute_s, end) in enumerate(requests):
        route = Route(SimpleNamespace(name=inst), SimpleNamespace(name="decode-1"), 0,
                      Decision(prefill=inst, decode="decode-1", reuse_blocks=cached // 4, local_blocks=cached // 4,
                               predicted_ttft_s=1.0, predicted_prefill_s=0.5))
        result = PrefillResult(first_token_id=1, cached_tokens=cached, computed_tokens=computed, compute_s=compute_s)
        record = logging.LogRecord("mooncaked.conductor.placement", logging.DEBUG, __file__, 1, "%s",
                                   (_route_trace(f"r{i}", route, cached + computed, result, compute_s + 0.1),), None)
        record.created, record.msecs = end, (end % 1) * 1000
        handler.emit(record)
    handler.close()


def test_route_lines_are_read_back_per_instance(tmp_path):
    log = tmp_path / "all-x.log"
    t = 1_800_000_000.0
    _write_log(log, [
        ("prefill-a", 0, 100, 1.0, t + 1.0),  # a: 0.0-1.0
        ("prefill-b", 0, 100, 1.0, t + 1.5),  # b: 0.5-1.5, half of it overlapping a
        ("prefill-a", 40, 50, 0.6, t + 3.0),  # a: 2.4-3.0, cached, alone
        ("prefill-b", 0, 200, 2.0, t + 6.0),  # b: 4.0-6.0, alone
    ])
    with log.open("a") as f:
        f.write("2026-12-02 21:00:00,000 INFO mooncaked-conductor x: not a route line\n")
    rows = route_trace.read(log)
    assert [(r.instance, r.cached, r.computed) for r in rows] == [
        ("prefill-a", 0, 100), ("prefill-b", 0, 100), ("prefill-a", 40, 50), ("prefill-b", 0, 200)]
    s = route_trace.summarize(rows)
    a, b = s["instances"]["prefill-a"], s["instances"]["prefill-b"]
    assert (a["requests"], a["computed_tokens"], a["cached_tokens"]) == (2, 150, 40)
    assert abs(a["busy_s"] - 1.6) < 0.01 and abs(b["busy_s"] - 3.0) < 0.01
    # uncached prompts: a's first and b's first each half overlapped, b's second alone; a's second is cached
    assert set(s["uncached_by_overlap"]) == {"0.00-0.25", "0.50-0.75"}
    assert s["uncached_by_overlap"]["0.50-0.75"]["tokens"] == 200
    assert abs(s["uncached_by_overlap"]["0.00-0.25"]["ms_per_token"] - 10.0) < 0.1
    assert "prefill-a: 2 requests" in route_trace.format_summary(str(log), s)


def test_the_command_prints_each_log_and_writes_json(tmp_path, capsys):
    log = tmp_path / "all-y.log"
    _write_log(log, [("prefill-a", 0, 64, 0.7, 1_800_000_000.0 + i) for i in range(1, 5)])
    out = tmp_path / "out.json"
    assert route_trace.main([str(log), "--json", str(out)]) == 0
    assert "prefill-a: 4 requests" in capsys.readouterr().out
    assert '"requests": 4' in out.read_text()
    assert route_trace.main([str(tmp_path / "missing.log")]) == 2
