"""Prefill time of a chunked pipeline parallel (CPP) group: the schedule over chunks and stages.

A group of S prefill machines holds contiguous layer ranges; the uncached part of a prompt
is cut into chunks, and chunk i's boundary hidden states go from stage K to K+1 while stage
K computes chunk i+1. So the group's prefill time is the pipeline's makespan: a fill (the
first chunk crosses every stage), the steady state (the slowest stage's share of each
chunk) and a drain; it is neither one machine's time nor that time / S. A one-chunk
prompt gains nothing, a many-chunk one approaches 1/S plus one chunk's fill and drain.

The same code predicts for the scheduler (a fitted per-machine step model through the
schedule, calibrated by the group's measured times) and is the simulator's ground truth
(the profile's step times through the schedule, per-stage speeds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from mooncaked.conductor.cost_model import DecodeTimeModel, InstanceModel, PrefillTimeModel, Profile, TransferModel

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class PipelineShape:
    """How a group splits the model and the prompt.

    ``stage_fractions``: each stage's share of the layers (sums to 1; the embedding and head are
    neglected); ``chunk_tokens``: tokens per chunk; ``hop_s_per_token``: seconds to send one
    token's hidden state to the next stage (hidden size x bytes / link bandwidth).
    """

    stage_fractions: tuple[float, ...]
    chunk_tokens: int
    hop_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if not self.stage_fractions or min(self.stage_fractions) <= 0:
            raise ValueError("a pipeline needs at least one stage, each with a positive share of the layers")
        if abs(sum(self.stage_fractions) - 1.0) > 1e-6:
            raise ValueError(f"stage shares must sum to 1, not {sum(self.stage_fractions)}")
        if self.chunk_tokens < 1 or self.hop_s_per_token < 0:
            raise ValueError("chunk_tokens must be positive and hop_s_per_token not negative")

    @property
    def stages(self) -> int:
        return len(self.stage_fractions)

    @classmethod
    def even(cls, stages: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, hop_s_per_token: float = 0.0,
             num_layers: int = 0) -> "PipelineShape":
        """Contiguous layer ranges as even as whole layers allow (exact shares when ``num_layers`` is 0)."""
        if stages < 1:
            raise ValueError("stages must be at least 1")
        if num_layers <= 0:
            return cls(tuple(1.0 / stages for _ in range(stages)), chunk_tokens, hop_s_per_token)
        if num_layers < stages:
            raise ValueError(f"{num_layers} layers cannot fill {stages} stages")
        q, r = divmod(num_layers, stages)
        return cls(tuple((q + (k < r)) / num_layers for k in range(stages)), chunk_tokens, hop_s_per_token)

    @classmethod
    def for_profile(cls, profile: Profile, stages: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> "PipelineShape":
        """Hidden states cross the network link (``remote_bps``) between stages."""
        return cls.even(stages, chunk_tokens, profile.hidden_bytes_per_token / profile.remote_bps, profile.num_layers)


def chunk_plan(tokens: int, prefix: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(new tokens, prefix tokens before them) per chunk of a prefill of ``tokens`` after ``prefix``."""
    out = []
    done = 0
    while done < tokens:
        c = min(chunk_tokens, tokens - done)
        out.append((c, prefix + done))
        done += c
    return out


def pipeline_seconds(chunk_s: Sequence[float], chunk_tokens: Sequence[int], shape: PipelineShape,
                     speeds: Sequence[float] | None = None) -> float:
    """Makespan of chunks whose whole-model times are ``chunk_s`` through the stages, in order.

    Stage K runs its share of chunk i once it has finished chunk i-1 and chunk i's hidden
    states have arrived from stage K-1; ``speeds`` (default 1) divide each stage's times.
    """
    fr = shape.stage_fractions
    sp = speeds or (1.0,) * len(fr)
    if len(sp) != len(fr):
        raise ValueError(f"{len(sp)} speeds for {len(fr)} stages")
    last = len(fr) - 1
    free = [0.0] * len(fr)
    for t, n in zip(chunk_s, chunk_tokens):
        ready = 0.0
        hop = n * shape.hop_s_per_token
        for k, (f, s) in enumerate(zip(fr, sp)):
            free[k] = max(free[k], ready) + t * f / s
            ready = free[k] + hop if k < last else free[k]
    return free[-1]


def pipeline_prefill_s(step_s: Callable[[int, int], float], tokens: int, prefix: int, shape: PipelineShape,
                       speeds: Sequence[float] | None = None) -> float:
    """The group's prefill time when one machine computes ``c`` new tokens after ``p`` in ``step_s(c, p)``."""
    plan = chunk_plan(tokens, prefix, shape.chunk_tokens)
    return pipeline_seconds([step_s(c, p) for c, p in plan], [c for c, _ in plan], shape, speeds)


class PipelinePrefillModel:
    """A group's prefill predictor: one machine's fitted step model run through the schedule.

    The group's measured prefill times calibrate that machine model: each is scaled by the
    schedule's ratio (one machine / group) for its shape before it is observed, so the
    coefficients follow what the group really takes, and the prediction keeps the fill and
    drain a plain polynomial fit of group times could not represent (a one-chunk prompt
    gains nothing on a group; a long one nearly 1/S).
    """

    def __init__(self, machine: PrefillTimeModel, shape: PipelineShape) -> None:
        self.machine = machine
        self.shape = shape

    @property
    def coef(self) -> tuple[float, ...]:
        return self.machine.coef

    def __len__(self) -> int:
        return len(self.machine)

    def predict(self, tokens: float, prefix: float) -> float:
        return pipeline_prefill_s(self.machine.predict, int(tokens), int(prefix), self.shape)

    def observe(self, tokens: float, prefix: float, seconds: float) -> None:
        group = self.predict(tokens, prefix)
        if group <= 0 or seconds <= 0:
            return
        self.machine.observe(tokens, prefix, seconds * self.machine.predict(tokens, prefix) / group)


def pipeline_instance_model(profile: Profile, shape: PipelineShape, window: int = 512) -> InstanceModel:
    """The scheduler's model of a whole group, treated as one prefill unit.

    Reused blocks come into every stage at once, each stage only its layers' share, so
    loading a block takes the largest stage's share of its bytes.
    """
    block = max(1, round(profile.block_bytes * max(shape.stage_fractions)))
    return InstanceModel(PipelinePrefillModel(PrefillTimeModel(profile.prefill_coef, window=window), shape),
                         DecodeTimeModel(profile.decode_coef, window=window, refit_every=32),
                         TransferModel(block, profile.local_bps, profile.remote_bps, profile.slow_bps))
