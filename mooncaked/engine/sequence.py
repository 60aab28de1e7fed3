"""A request's state inside the engine: a record the scheduler and runner read, nothing more."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from mooncaked.engine.grammar import Constraint
from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on first admission
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks so far
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: entry i is prompt token i + 1's log-prob (and the most likely there)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    constraint: Constraint | None = None  # with params.grammar, from the first token it samples or receives
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    admitted_once: bool = False
    # blocks handed in already holding the KV of the first `imported_tokens` tokens
    # (incremental prefill, or a decode instance receiving a prefill's KV); adopted on admission
    imported_blocks: list[int] = field(default_factory=list)
    imported_tokens: int = 0
    # leading blocks this sequence uses but does not publish to the prefix cache: KV pulled for it alone
    # (a prefix that is not hot stays its holder's; the conductor's plan said not to replicate it)
    unkept_blocks: int = 0
    # keep the blocks after finishing until the owner releases them (a prefill still pushing KV)
    hold_blocks: bool = False
    compute_s: float = 0.0  # engine step time of the steps it took part in
    stop_ids: frozenset[int] = frozenset()  # token ids that end it (EOS unless ignored, stop_token_ids)
    # a pipeline stage's part of a prompt: it starts exactly after the imported blocks (every stage of
    # the group starts at the same token), and a stage that is not the first computes only tokens whose
    # input hidden states have arrived (``input_ready``; None: its input is the token ids)
    exact_prefix: bool = False
    input_ready: int | None = None
    # elastic CPP on a whole-model engine: only layers [first, end) of this prompt run here (None: all the
    # engine holds). Its blocks hold those layers only, so none is published by the step that computes it
    # (``unkept_blocks`` covers them); a lead publishes them once the other layers landed (``publish_held``)
    layers: tuple[int, int] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def input_left(self) -> int:
        """Tokens it could compute now as far as its input goes."""
        if self.input_ready is None:
            return self.num_uncomputed
        return max(0, min(self.input_ready, self.num_tokens) - self.num_computed_tokens)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
