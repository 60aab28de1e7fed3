"""Prediction-based early rejection and SLO-aware decode choice (Mooncake's overload scheduling).

Rejecting at arrival, on the *current* decode load, makes load swing: by the time a
request's prefill ends, the sequences that filled the decode batch may have finished (and
the ones accepted meanwhile may have piled up). So the decode load is forecast at the time
the request would reach decode (now + its predicted TTFT): running sequences that will
have finished by then drop out, sequences still prefilling toward that instance join. A
request is rejected now, before any prefill is spent, when no decode instance would meet
the TBT SLO (or hold its KV) then, or when its predicted TTFT breaks the TTFT SLO.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mooncaked.conductor.views import InstanceView, Rejection, RequestView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives; configurable per deployment."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise ValueError("SLOs must be positive seconds")


@dataclass(frozen=True)
class DecodeForecast:
    """A decode instance's predicted state when the request would join it."""

    name: str
    batch: int               # sequences in the batch then, this request included
    context_tokens: int      # their KV, in tokens
    tbt_s: float             # predicted step time then
    kv_fits: bool            # full-length KV (context + tokens to come) of those ahead of it and its own fits


def forecast_decode(view: InstanceView, request: RequestView, now_s: float, reach_s: float) -> DecodeForecast:
    """Predict ``view``'s batch at ``reach_s`` with the request added.

    Steps are assumed to keep today's duration until then: a sequence with ``r`` tokens to
    go leaves after ``r`` steps. Sequences joining later than ``reach_s`` still count toward
    the step time (they share the batch with this request for most of its decode) but not
    toward its KV room: admission is first come, first served when the KV arrives (live,
    the decode instance's ``Reserve`` is the final check).
    """
    model = view.model.decode
    batch = view.batch
    step = model.predict(len(batch), sum(s.context_tokens for s in batch)) if batch else 0.0
    n = 1
    context = request.prompt_len + 1
    reserved = request.prompt_len + request.max_tokens
    for s in batch:
        start = max(now_s, s.joins_at_s)
        done = int((reach_s - start) / step) if step > 0 and reach_s > start else 0
        if done >= s.remaining_tokens:
            continue
        n += 1
        context += s.context_tokens + done
        if s.joins_at_s <= reach_s:  # KV is admitted first come, first served: later ones need room after us
            reserved += s.context_tokens + s.remaining_tokens
    capacity = view.total_kv_blocks * request.block_size
    fits = capacity <= 0 or reserved <= capacity
    return DecodeForecast(view.name, n, context, model.predict(n, context), fits)


def pick_decode(decodes: tuple[InstanceView, ...] | list[InstanceView], request: RequestView, now_s: float,
                reach_s: float, slo: SLO | None) -> DecodeForecast | Rejection:
    """The decode instance with the lowest forecast load that meets the TBT SLO and holds the KV.

    Without an SLO (``None``), the lowest forecast load among those with room, and when none
    has room the least loaded anyway (the request then waits or fails there, as without
    admission control).
    """
    candidates = [d for d in decodes if d.available]
    if not candidates:
        return Rejection("no_decode", "no decode instance is serving")
    forecasts = [forecast_decode(d, request, now_s, reach_s) for d in candidates]
    roomy = [f for f in forecasts if f.kv_fits]
    key = (lambda f: (f.tbt_s, f.batch, f.name))
    if slo is None:
        return min(roomy or forecasts, key=key)
    if not roomy:
        return Rejection("kv_capacity", f"no decode instance would hold {request.prompt_len + request.max_tokens} "
                                        f"tokens of KV when this request reaches decode")
    good = [f for f in roomy if f.tbt_s <= slo.tbt_s]
    if not good:
        best = min(roomy, key=key)
        return Rejection("tbt_slo", f"the least loaded decode instance ({best.name}) is forecast at "
                                    f"{best.tbt_s * 1e3:.0f} ms per token, over the {slo.tbt_s * 1e3:.0f} ms SLO")
    return min(good, key=key)


def check_ttft(predicted_ttft_s: float, unloaded_ttft_s: float, slo: SLO) -> Rejection | None:
    """Reject when the predicted TTFT breaks the SLO *because of load*.

    A request that would miss the SLO even on an idle cluster (a very long prompt) is
    served: refusing it would not make it fit later, and only the load can be shed.
    """
    if predicted_ttft_s > slo.ttft_s and unloaded_ttft_s <= slo.ttft_s:
        return Rejection("ttft_slo", f"predicted time to first token {predicted_ttft_s:.1f} s is over the "
                                     f"{slo.ttft_s:.1f} s SLO under the current load")
    return None
