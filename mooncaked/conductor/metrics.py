"""Prometheus series of the conductor: latency (TTFT, TBT), prompt-cache hit rate, rejections,
and each instance's queues.

Both fronts (gRPC ``Generate`` and the HTTP API) run the same request path, which records
here, so the numbers cover every client. prometheus-client keeps one process-wide
registry; the series are declared once, in this module.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

# latency buckets span a tiny CPU model (ms) up to long prompts on a loaded cluster (minutes)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60, 120, 300)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)

TTFT = Histogram("mooncaked_conductor_ttft_seconds", "Time from a request's arrival to its first token.",
                 ["front"], buckets=_TTFT_BUCKETS)
TBT = Histogram("mooncaked_conductor_tbt_seconds",
                "Time between tokens of one stream (a chunk's gap spread over the tokens it carries).",
                ["front"], buckets=_TBT_BUCKETS)
REQUESTS = Counter("mooncaked_conductor_requests", "Generate requests by front and outcome.",
                   ["front", "outcome"])
INFLIGHT = Gauge("mooncaked_conductor_inflight_requests", "Generate requests being served now.", ["front"])
REJECTIONS = Counter("mooncaked_conductor_rejections",
                     "Requests refused before any token, by reason (a gRPC status name, or a finer "
                     "reason such as ttft_slo from the scheduler).", ["reason"])
PROMPT_TOKENS = Counter("mooncaked_conductor_prompt_tokens", "Prompt tokens of requests that were prefilled.")
CACHED_TOKENS = Counter("mooncaked_conductor_cached_prompt_tokens",
                        "Prompt tokens served from a KV cache (local or pool) instead of computed.")
GENERATED_TOKENS = Counter("mooncaked_conductor_generated_tokens", "Tokens streamed back to clients.")
HIT_RATE = Gauge("mooncaked_conductor_prefix_hit_rate",
                 "cached_prompt_tokens / prompt_tokens since start (updated at scrape time).")

QUEUED_PREFILL_TOKENS = Gauge("mooncaked_conductor_instance_queued_prefill_tokens",
                              "Prompt tokens waiting to be prefilled on an instance (last heartbeat).",
                              ["instance", "role"])
RUNNING = Gauge("mooncaked_conductor_instance_running_requests", "Requests running on an instance.",
                ["instance", "role"])
WAITING = Gauge("mooncaked_conductor_instance_waiting_requests", "Requests queued on an instance.",
                ["instance", "role"])
ROUTED_INFLIGHT = Gauge("mooncaked_conductor_instance_inflight", "Requests the conductor routed to an "
                        "instance and has not seen finish.", ["instance", "role"])
FREE_KV_BLOCKS = Gauge("mooncaked_conductor_instance_free_kv_blocks", "Free KV blocks on an instance.",
                       ["instance", "role"])
INDEX_ENTRIES = Gauge("mooncaked_conductor_prefix_index_entries", "Block hashes in the global prefix index.")
POOL_EVENTS = Counter("mooncaked_conductor_pool_events",
                      "Block hashes the store master reported stored in (or removed from) the KV pool, by kind "
                      "(the snapshot after each subscription counts as stored).", ["kind"])
POOL_WATCH_UP = Gauge("mooncaked_conductor_pool_watch_up",
                      "1 while the conductor follows the store master's pool events (snapshot applied), else 0.")
POOL_WATCH_LOSSES = Counter("mooncaked_conductor_pool_watch_losses",
                            "Times the pool event stream was lost (its blocks then leave the prefix index).")

_PER_INSTANCE = (QUEUED_PREFILL_TOKENS, RUNNING, WAITING, ROUTED_INFLIGHT, FREE_KV_BLOCKS)
SERIES = (TTFT, TBT, REQUESTS, INFLIGHT, REJECTIONS, PROMPT_TOKENS, CACHED_TOKENS, GENERATED_TOKENS, HIT_RATE,
          INDEX_ENTRIES, POOL_EVENTS, POOL_WATCH_UP, POOL_WATCH_LOSSES, *_PER_INSTANCE)  # the conductor's page


def rejected(reason: str) -> None:
    """Count a request refused before any token (early rejection, no instance, bad input)."""
    REJECTIONS.labels(reason).inc()


def refused(front: str, reason: str) -> None:
    """A request a front refused before handing it to the request path (its input did not parse)."""
    rejected(reason)
    REQUESTS.labels(front, "rejected").inc()


def _total(metric: Any, suffix: str = "") -> float:
    """The sum of a labelled series over its labels (what `mooncakectl status` shows)."""
    return sum(s.value for m in metric.collect() for s in m.samples if s.name == m.name + suffix)


def requests_in_flight() -> int:
    """Generate requests being served now, on both fronts."""
    return int(_total(INFLIGHT))


def rejections_total() -> int:
    """Requests refused before their first token since the process started, every reason."""
    return int(_total(REJECTIONS, "_total"))


def refresh(registry: Any, index_entries: int) -> None:
    """Copy every instance's last reported load into the gauges and work out the hit rate;
    called at scrape time so the series follow the registry (instances that left disappear)."""
    for gauge in _PER_INSTANCE:
        gauge.clear()
    for inst in registry.instances.values():
        labels = (inst.name, inst.role)
        QUEUED_PREFILL_TOKENS.labels(*labels).set(inst.load.queued_prefill_tokens)
        RUNNING.labels(*labels).set(inst.load.running_requests)
        WAITING.labels(*labels).set(inst.load.waiting_requests)
        ROUTED_INFLIGHT.labels(*labels).set(inst.inflight)
        FREE_KV_BLOCKS.labels(*labels).set(inst.load.free_kv_blocks)
    INDEX_ENTRIES.set(index_entries)
    prompt = REGISTRY.get_sample_value("mooncaked_conductor_prompt_tokens_total") or 0.0
    cached = REGISTRY.get_sample_value("mooncaked_conductor_cached_prompt_tokens_total") or 0.0
    HIT_RATE.set(cached / prompt if prompt else 0.0)


@dataclass
class StreamTimer:
    """Times one generate stream: TTFT at the first chunk, then TBT per token."""

    front: str
    start: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    last: float | None = None
    tokens: int = 0

    def __post_init__(self) -> None:
        INFLIGHT.labels(self.front).inc()

    def chunk(self, n_tokens: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            TTFT.labels(self.front).observe(now - self.start)
            PROMPT_TOKENS.inc(prompt_tokens)
            CACHED_TOKENS.inc(cached_tokens)
        elif n_tokens and self.last is not None:
            gap = (now - self.last) / n_tokens
            hist = TBT.labels(self.front)
            for _ in range(n_tokens):
                hist.observe(gap)
        if n_tokens:
            self.last = now
        self.tokens += n_tokens
        GENERATED_TOKENS.inc(n_tokens)

    def done(self, outcome: str) -> None:
        """outcome: ok | rejected | error | cancelled."""
        INFLIGHT.labels(self.front).dec()
        REQUESTS.labels(self.front, outcome).inc()
