"""Per-request outcomes and the per-policy summary the table and the JSON report show.

A served request meets the TBT SLO when at most 10% of its token gaps exceed it (its P90
gap is within the SLO), as ``tools/replay.py`` counts it; goodput counts requests meeting
both SLOs per second of the run (first arrival to last completion).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mooncaked.conductor.early_rejection import SLO


@dataclass(slots=True)
class Outcome:
    arrival_s: float
    input_length: int
    output_length: int
    prefill: str = ""
    decode: str = ""
    rejected: str = ""        # early rejection reason
    dropped: bool = False     # prefilled, then no room on decode: the prefill was wasted
    ttft_s: float | None = None
    finished_s: float | None = None
    computed_tokens: int = 0
    reused_tokens: int = 0
    pulled_blocks: int = 0
    wait_s: float = 0.0       # queued on the prefill instance before it started
    decode_tokens: int = 0
    slow_gaps: int = 0

    def tbt_ok(self) -> bool:
        return self.slow_gaps <= 0.1 * self.decode_tokens


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    requests: int
    served: int
    mean_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    mean_prefill_wait_s: float
    tbt_slo_attainment: float
    slo_attainment: float
    goodput_rps: float
    rejected: int
    dropped_after_prefill: int
    prompt_tokens: int            # of the requests prefilled
    cache_hit_rate: float         # prompt tokens reused (not computed) / prompt tokens, as replay's report counts it
    prefill_tokens_computed: int
    prefill_tokens_wasted: int
    prefill_tokens_reused: int
    blocks_pulled: int
    makespan_s: float
    wall_s: float

    def as_json(self) -> dict:
        d = asdict(self)
        d.pop("policy")
        return d


def summarize(policy: str, outcomes: list[Outcome], slo: SLO, wall_s: float) -> PolicyResult:
    served = [o for o in outcomes if o.ttft_s is not None and o.finished_s is not None]
    ttft = np.array([o.ttft_s for o in served]) if served else np.zeros(1)
    tbt_ok = [o.tbt_ok() for o in served]
    good = sum(1 for o, ok in zip(served, tbt_ok) if ok and o.ttft_s <= slo.ttft_s)
    prefilled = [o for o in outcomes if o.computed_tokens]
    prompt = sum(o.input_length for o in prefilled)
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.finished_s for o in served), default=start)
    span = max(end - start, 1e-9)
    return PolicyResult(
        policy=policy, requests=len(outcomes), served=len(served),
        mean_ttft_s=float(ttft.mean()), p90_ttft_s=float(np.percentile(ttft, 90)),
        p99_ttft_s=float(np.percentile(ttft, 99)),
        mean_prefill_wait_s=float(np.mean([o.wait_s for o in served])) if served else 0.0,
        tbt_slo_attainment=(sum(tbt_ok) / len(served)) if served else 0.0,
        slo_attainment=good / len(outcomes) if outcomes else 0.0,
        goodput_rps=good / span,
        rejected=sum(1 for o in outcomes if o.rejected),
        dropped_after_prefill=sum(1 for o in outcomes if o.dropped),
        prompt_tokens=prompt, cache_hit_rate=sum(o.reused_tokens for o in prefilled) / prompt if prompt else 0.0,
        prefill_tokens_computed=sum(o.computed_tokens for o in outcomes),
        prefill_tokens_wasted=sum(o.computed_tokens for o in outcomes if o.dropped),
        prefill_tokens_reused=sum(o.reused_tokens for o in outcomes),
        blocks_pulled=sum(o.pulled_blocks for o in outcomes),
        makespan_s=span, wall_s=wall_s)


def average(results: list[PolicyResult]) -> PolicyResult:
    """Field-wise mean over runs of one policy with different seeds (counts rounded)."""
    first = results[0]
    if len(results) == 1:
        return first
    fields = {}
    for key, value in asdict(first).items():
        if key == "policy":
            fields[key] = value
        elif isinstance(value, int):
            fields[key] = round(sum(getattr(r, key) for r in results) / len(results))
        else:
            fields[key] = sum(getattr(r, key) for r in results) / len(results)
    return PolicyResult(**fields)


COLUMNS = (("policy", "{:<18}", "policy"), ("mean_ttft_s", "{:>9.2f}", "TTFT mean"), ("p90_ttft_s", "{:>8.2f}", "TTFT p90"),
           ("mean_prefill_wait_s", "{:>6.2f}", "wait"),
           ("tbt_slo_attainment", "{:>8.1%}", "TBT ok"), ("slo_attainment", "{:>8.1%}", "SLO ok"),
           ("goodput_rps", "{:>8.3f}", "goodput"), ("cache_hit_rate", "{:>6.1%}", "hit"), ("rejected", "{:>5d}", "rej"),
           ("dropped_after_prefill", "{:>5d}", "late"), ("prefill_tokens_computed", "{:>12,d}", "computed"),
           ("prefill_tokens_wasted", "{:>10,d}", "wasted"), ("prefill_tokens_reused", "{:>12,d}", "reused"),
           ("wall_s", "{:>6.1f}", "wall"))


def format_table(results: list[PolicyResult]) -> str:
    """Fixed-width table, one row per policy; TTFT in seconds, goodput in requests/s."""
    widths = [len(fmt.format(0 if key != "policy" else "")) for key, fmt, _ in COLUMNS]
    head = " ".join(title.rjust(w) if i else title.ljust(w) for i, ((_, _, title), w) in enumerate(zip(COLUMNS, widths)))
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(" ".join(fmt.format(getattr(r, key)) for key, fmt, _ in COLUMNS))
    return "\n".join(lines)
