"""Which part of the model an engine runs when it is one stage of a chunked-pipeline (CPP) group.

A group of N prefill instances splits the model's layers into N contiguous ranges: the first
stage also embeds the tokens, the last also applies the final norm and the LM head and samples
the first token. Only the hidden states at a stage boundary cross to the next stage, once per
chunk of the prompt (Mooncake §5.1). The split is even by layer count; the first and last stages
get the fewer layers when it does not divide, as they also run the embedding and the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.engine.config import ConfigError


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of ``count`` over layers ``[first_layer, end_layer)`` of ``num_layers``."""

    index: int
    count: int
    first_layer: int
    end_layer: int
    num_layers: int

    @classmethod
    def of(cls, index: int, count: int, num_layers: int) -> "PipelineStage":
        if count < 1 or not 0 <= index < count:
            raise ConfigError(f"pipeline stage {index}/{count}: need 0 <= K < N (K/N, counted from 0)")
        if count > num_layers:
            raise ConfigError(f"a {count}-stage pipeline needs at least {count} layers; the model has {num_layers}")
        bounds = split_layers(num_layers, count)
        return cls(index, count, bounds[index], bounds[index + 1], num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def num_stage_layers(self) -> int:
        return self.end_layer - self.first_layer

    def __str__(self) -> str:
        return f"{self.index}/{self.count} (layers {self.first_layer}-{self.end_layer - 1})"


def split_layers(num_layers: int, count: int) -> list[int]:
    """Layer boundaries of ``count`` stages: sizes differ by at most one, the larger ones in the middle."""
    base, extra = divmod(num_layers, count)
    sizes = [base] * count
    # the middle stages take the remainder: the ends also run the embedding and the head
    order = sorted(range(count), key=lambda i: abs(i - (count - 1) / 2))
    for i in order[:extra]:
        sizes[i] += 1
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return bounds


def parse_stage(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N): stage K (from 0) of an N-stage group."""
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ConfigError(f"pipeline stage {text!r}: write K/N, e.g. 0/2 for the first of two stages") from None
    if n < 1 or not 0 <= k < n:
        raise ConfigError(f"pipeline stage {text!r}: need 0 <= K < N (stages count from 0)")
    return k, n
