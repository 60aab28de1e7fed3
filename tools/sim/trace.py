"""Mooncake-format traces: JSONL with ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # Mooncake's traces hash 512-token blocks

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
    """The first ``max_requests`` requests in arrival order; ``time_scale`` < 1 compresses arrivals
    (0: all at once, as ``tools/replay.py --time-scale 0`` sends them)."""
    if time_scale < 0:
        raise ValueError("time_scale must not be negative")
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


def synth_block_tokens(length_scale: float) -> int:
    """Tokens per trace block after length scaling (``tools/replay.py``'s ``Synthesizer.block_tokens``)."""
    return max(1, round(TRACE_BLOCK_TOKENS * length_scale))


def scaled_lengths(req: TraceRequest, length_scale: float, max_prompt_tokens: int | None = None) -> tuple[int, int]:
    """(prompt tokens, output tokens) as ``tools/replay.py`` sends them (``Synthesizer.lengths``):
    scaled, at least 1, the prompt clipped to leave room for the output within the context."""
    n_out = max(1, round(req.output_length * length_scale))
    n_in = max(1, round(req.input_length * length_scale))
    if max_prompt_tokens is not None:
        n_out = min(n_out, max(1, max_prompt_tokens // 2))
        n_in = max(1, min(n_in, max_prompt_tokens - n_out))
    return n_in, n_out


def scale_trace(trace: list[TraceRequest], length_scale: float, block_size: int,
                max_prompt_tokens: int | None = None) -> list[TraceRequest]:
    """The trace as a live cluster with ``block_size``-token blocks sees it under ``tools/replay.py``.

    Replay draws each trace block's ``round(512 x length_scale)`` tokens from its hash id
    alone and gives a prompt longer than its hash ids cover a private tail. So two prompts
    share an engine block exactly when every token up to its end comes from the same hash
    ids: the engine block ending at token ``e`` is named by the hash id of the trace block
    holding token ``e - 1`` (which names its whole prefix, as trace hash ids do) and the
    offset of ``e`` in it. Only full engine blocks are named (the engine hashes only those);
    a block reaching into the private tail gets a name of its own (negative).
    """
    if length_scale <= 0 or block_size < 1:
        raise ValueError("length_scale and block_size must be positive")
    bt = synth_block_tokens(length_scale)
    out = []
    for r in trace:
        n_in, n_out = scaled_lengths(r, length_scale, max_prompt_tokens)
        covered = min(n_in, len(r.hash_ids) * bt)
        names = []
        for j in range(n_in // block_size):
            end = (j + 1) * block_size
            if end <= covered:
                m = (end - 1) // bt
                names.append(r.hash_ids[m] * (bt + 1) + end - m * bt)
            else:
                names.append(-((r.index << 24) | j) - 1)
        out.append(TraceRequest(r.index, r.arrival_s, n_in, n_out, tuple(names)))
    return out
