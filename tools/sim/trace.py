"""Mooncake-format traces: JSONL with ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Mooncake's public synthetic trace, shipped in the repository (tools/traces/README.md names its source)
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "synthetic_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one per 512-token block, the last one possibly partial


def load_trace(path: str | Path, max_requests: int | None = None, time_scale: float = 1.0) -> list[TraceRequest]:
    """The first ``max_requests`` requests in arrival order; ``time_scale`` < 1 compresses arrivals."""
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    out: list[TraceRequest] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = TraceRequest(len(out), float(row["timestamp"]) / 1000.0 * time_scale, int(row["input_length"]),
                                   int(row["output_length"]), tuple(int(h) for h in row.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e})") from None
            if req.input_length < 1 or req.output_length < 0 or req.arrival_s < 0:
                raise ValueError(f"{path}:{n}: lengths and timestamp must be non-negative (input >= 1)")
            out.append(req)
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out
