"""What the prefill instances did, from the conductor's per-request route lines (DEBUG).

The conductor logs one ``route`` line per placed request at DEBUG (``conductor/placement.py``:
predicted queue and prefill against the time it took, the engine's compute, cached and computed
tokens). ``tools/replay_vs_sim.py --log-level DEBUG`` keeps them in its logs folder. This reads them
back, per log file and per prefill instance, into the figures that tell a slow engine from a
misrouted request:

- busy seconds (the union of the requests' compute intervals) and seconds per computed token;
- for prompts with nothing cached, ms per computed token by how much of each prompt's compute the
  other prefills' compute overlapped (cores shared on one host show as a rising row);
- a least-squares fit of one request's compute: seconds per computed token, per cached token, and a
  constant.

    python tools/route_trace.py LOGS/all-*.log
    python tools/route_trace.py --json - LOGS/all-mooncake.log
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

LINE = re.compile(r"^(\S+ \d\d:\d\d:\d\d,\d+) DEBUG .*?route \S+: (\d+) tokens -> ([^/\s]+)/\S+; .*?"
                  r"took ([\d.]+) s \(compute ([\d.]+) s, cached (\d+), computed (\d+)")
OVERLAP_BUCKETS = 4  # quarters of a prompt's compute that other prefills spent computing too
MIN_TOKENS = 32  # shorter prompts are mostly the step's fixed cost: left out of the per-token rows


@dataclass(frozen=True)
class Routed:
    """One request as its route line tells it; ``start``/``end``: its compute, in seconds of the log's clock."""

    instance: str
    start: float
    end: float
    compute_s: float
    cached: int
    computed: int


def read(path: Path) -> list[Routed]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if not m:
            continue
        end = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        compute = float(m[5])
        out.append(Routed(m[3], end - compute, end, compute, int(m[6]), int(m[7])))
    return out


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(a: float, b: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def fit(rows: list[Routed]) -> dict[str, float] | None:
    """compute_s ~ per_computed * computed + per_cached * cached + constant, by least squares."""
    import numpy as np

    if len(rows) < 3:
        return None
    x = np.array([[r.computed, r.cached, 1.0] for r in rows])
    y = np.array([r.compute_s for r in rows])
    (per_computed, per_cached, constant), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"s_per_computed_token": float(per_computed), "s_per_cached_token": float(per_cached),
            "constant_s": float(constant)}


def summarize(rows: list[Routed]) -> dict[str, Any]:
    by_instance: dict[str, list[Routed]] = defaultdict(list)
    for r in rows:
        by_instance[r.instance].append(r)
    busy = {i: merged([(r.start, r.end) for r in rs]) for i, rs in by_instance.items()}
    instances = {}
    buckets: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, rs in by_instance.items():
        others = [iv for other, ivs in busy.items() if other != name for iv in ivs]
        busy_s = sum(b - a for a, b in busy[name])
        computed = sum(r.computed for r in rs)
        instances[name] = {"requests": len(rs), "computed_tokens": computed, "cached_tokens": sum(r.cached for r in rs),
                           "busy_s": busy_s, "busy_ms_per_computed_token": 1e3 * busy_s / computed if computed else None}
        for r in rs:
            if r.cached or r.computed < MIN_TOKENS or r.end <= r.start:
                continue
            k = min(int(overlap(r.start, r.end, others) / (r.end - r.start) * OVERLAP_BUCKETS), OVERLAP_BUCKETS - 1)
            buckets[k][0] += r.compute_s
            buckets[k][1] += r.computed
    uncached = {f"{k / OVERLAP_BUCKETS:.2f}-{(k + 1) / OVERLAP_BUCKETS:.2f}": {"ms_per_token": 1e3 * s / n, "tokens": int(n)}
                for k, (s, n) in sorted(buckets.items())}
    return {"requests": len(rows), "instances": instances, "uncached_by_overlap": uncached, "fit": fit(rows)}


def format_summary(name: str, s: dict[str, Any]) -> str:
    lines = [f"{name}: {s['requests']} requests"]
    for inst, v in s["instances"].items():
        per = v["busy_ms_per_computed_token"]
        lines.append(f"  {inst}: {v['requests']} requests, {v['computed_tokens']:,} computed + {v['cached_tokens']:,} "
                     f"cached tokens, busy {v['busy_s']:.1f} s, " + (f"{per:.2f} ms a computed token" if per else "-"))
    if s["uncached_by_overlap"]:
        lines.append("  nothing cached, ms a token by overlap with the other prefills: "
                     + ", ".join(f"{k}: {v['ms_per_token']:.1f} ({v['tokens']:,} tokens)"
                                 for k, v in s["uncached_by_overlap"].items()))
    if s["fit"]:
        f = s["fit"]
        lines.append(f"  fit: compute = {1e3 * f['s_per_computed_token']:.2f} ms x computed + "
                     f"{1e3 * f['s_per_cached_token']:.2f} ms x cached + {1e3 * f['constant_s']:.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path, help="logs holding the conductor's DEBUG route lines")
    ap.add_argument("--json", metavar="OUT", help="write one JSON object {log: figures} to OUT ('-': stdout)")
    args = ap.parse_args(argv)
    result = {}
    for path in args.logs:
        try:
            rows = read(path)
        except OSError as e:
            print(f"route_trace: {path}: {e}", file=sys.stderr)
            return 2
        result[str(path)] = summarize(rows)
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.json != "-":
        for path, s in result.items():
            print(format_summary(path, s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
