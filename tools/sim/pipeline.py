"""A simulated chunked pipeline parallel (CPP) group: S prefill machines serving as one prefill unit.

As the live design (issue 15): stage K holds a contiguous range of layers and its own
prefix cache of those layers, the prompt's uncached tokens go through in chunks, and
chunk i's hidden states cross to stage K+1 while stage K computes chunk i+1. Its prefill
time is the pipeline schedule (``mooncaked.conductor.pipeline_cost``) over the profile's
step time of each chunk at its prefix, each stage's share of the layers at that machine's
own speed: modelled, not measured (``tools/bench_cpp.py`` is to measure a live group).

Like a single simulated instance it runs one prompt at a time: the next prompt does not
enter stage 0 while the last one drains (an overlap the live group may or may not have).
Its prefix cache is the group's: a block is cached when every stage holds its layers of
it, and the group has S machines' DRAM for it.
"""

from __future__ import annotations

import logging
import random
from typing import Sequence

from mooncaked.conductor.cost_model import InstanceModel, Profile
from mooncaked.conductor.pipeline_cost import PipelineShape, pipeline_prefill_s
from mooncaked.conductor.prefix_index import PrefixIndex

from .instances import SimPrefill

log = logging.getLogger(__name__)


class SimPipelineGroup(SimPrefill):
    """A prefill unit whose compute is the chunked pipeline over its stages' machines."""

    def __init__(self, name: str, profile: Profile, model: InstanceModel, index: PrefixIndex,
                 speeds: Sequence[float], shape: PipelineShape, cache_blocks: int, noise: float,
                 rng: random.Random) -> None:
        if len(speeds) != shape.stages:
            raise ValueError(f"{name}: {len(speeds)} machine speeds for {shape.stages} stages")
        super().__init__(name, profile, model, index, min(speeds), cache_blocks * shape.stages, noise, rng)
        self.speeds = tuple(speeds)
        self.shape = shape
        self._load_share = max(shape.stage_fractions)

    @property
    def stages(self) -> int:
        return self.shape.stages

    def load_s(self, local_blocks: int, pulled_blocks: int) -> float:
        """Every stage loads its layers' share of each block at once, over its own links."""
        return super().load_s(local_blocks, pulled_blocks) * self._load_share

    def compute_s(self, tokens: int, prefix: int) -> float:
        return pipeline_prefill_s(self.profile.prefill_s, tokens, prefix, self.shape, self.speeds)
