"""What an engine reports of its steps, and what its per-step hooks are handed.

The daemon's instance code reads these (KV pushes layer by layer, pipeline stages' hidden states,
the conductor's time models), never the engine's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class EngineStats:
    """The engine's state and counters since it started (``Engine.stats()``: heartbeats, metrics, status)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_cached_blocks: int
    prefix_hit_blocks: int
    prefix_query_blocks: int
    prefill_tokens_computed: int
    prompt_tokens_cached: int
    decode_tokens: int
    num_preemptions: int
    steps: int


@dataclass(frozen=True)
class StepRecord:
    """One engine step's measured time and shape (what a scheduler fits its time models on)."""

    prefill_tokens: int  # new tokens of prefilling sequences
    decodes: int  # sequences decoding one token
    decode_context: int  # tokens in the cache across the decoding sequences
    seconds: float


@dataclass
class StepSeq:
    """What a layer hook needs to know about one sequence in the running step."""

    request_id: str
    block_table: list[int]
    start: int  # first token position computed in this step
    num_tokens: int  # tokens computed in this step
    finishes_prompt: bool
    last_layer: int = -1  # the last of this engine's layers the step runs for it (its hook's last call)


StepHook = Callable[[int, list[StepSeq]], None]
HiddenSource = Callable[[str, int, int], torch.Tensor]
"""``(request_id, start, n) -> rows``: a pipeline stage's input hidden states of tokens [start, start+n)."""
HiddenSink = Callable[[str, int, torch.Tensor], None]
"""``(request_id, start, rows)``: a pipeline stage's output hidden states, for the next stage."""
