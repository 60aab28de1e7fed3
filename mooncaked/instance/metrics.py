"""Prometheus series of an engine instance: how prefills follow the conductor's plan.

A plan names where a prompt's leading blocks come from (own cache, the pool, a peer's KV
cache); what the prefill could not get that way it computes, and counts here by reason, so an
operator sees when the cluster does less than its scheduler decided. Declared once, in this
module (prometheus-client keeps one process-wide registry).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

log = logging.getLogger(__name__)

PLAN_DEVIATIONS = Counter(
    "mooncaked_plan_deviations",
    "Prompt blocks a prefill's plan said to reuse or pull that it computed instead, by reason: local_evicted "
    "(no longer in its own cache), no_room (no free KV blocks to pull into), no_pool (no KV pool joined), "
    "pool_missing / pool_failed, peer_unknown / peer_unavailable (the lender could not be asked), peer_missing "
    "(the lender no longer held them), peer_layout, peer_read_failed (the read from the lender failed), "
    "prompt_logprobs (a scored prompt is computed whole).",
    ["reason"])
PLAN_BLOCKS = Counter("mooncaked_plan_blocks",
                      "Prompt blocks a prefill took instead of computing, by source (local, pool, peer).",
                      ["source"])
PUSHES_FENCED = Counter(
    "mooncaked_kv_push_fenced",
    "KV pushes a prefill stopped before a write because the decode's reservation might have been freed (the write "
    "fence: its own renewal lapsed, or the decode no longer holds it); the prefill failed instead of writing.")
LENT_BLOCKS = Counter("mooncaked_lent_blocks", "Cached KV blocks this instance lent peers to read.")


def deviated(deviations: dict[str, int]) -> None:
    for reason, blocks in deviations.items():
        if blocks:
            PLAN_DEVIATIONS.labels(reason).inc(blocks)


# chunked pipeline parallel prefill (instance/pipeline.py), per stage "K/N"
STAGE_BUSY = Counter("mooncaked_cpp_stage_busy_seconds",
                     "Engine step time a CPP stage spent computing its layers of prompts.", ["stage"])
STAGE_BUBBLE = Counter("mooncaked_cpp_stage_bubble_seconds",
                       "Time a CPP stage held a prompt without computing it (waiting for its previous stage's "
                       "chunks, its pushes or the later stages): the pipeline's bubbles.", ["stage"])
HIDDEN_BYTES = Counter("mooncaked_cpp_hidden_bytes",
                       "Boundary hidden-state bytes a CPP stage sent to the next stage over the transfer engine.",
                       ["stage"])

SERIES = (PLAN_DEVIATIONS, PLAN_BLOCKS, PUSHES_FENCED, LENT_BLOCKS, STAGE_BUSY, STAGE_BUBBLE,
          HIDDEN_BYTES)  # an engine's page (role_metrics.py)
