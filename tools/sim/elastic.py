"""Elastic CPP, simulation only: ``mooncaked`` may pipeline one long prompt over idle single instances.

The live system has static pipeline groups (``--pipeline-stages``), so what this variant
measures is what dynamic groups would be worth, not something a live replay can check. At
a decision, the instance ``mooncaked`` chose may borrow k other prefill instances that are
idle (nothing queued or running by the conductor's own books) as stages 2..k+1 of a
chunked pipeline for this prompt; they are busy until it finishes, and its blocks are
cached on the chosen instance (the borrowed stages send their layers' share back with the
push to decode, after the first token, so it costs no TTFT here). A pipeline whose machines are
not all idle when it is routed (the books were behind) is not formed: the prompt runs alone and
is booked for that (``ElasticDecision.alone_prefill_s``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from mooncaked.conductor.cost_model import Profile
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.pipeline_cost import PipelineShape, pipeline_prefill_s
from mooncaked.conductor.policies import (DEFAULT_BALANCING_THRESHOLD, GROUP_MIN_GAIN, MooncakedPolicy, Policy,
                                          PrefillEstimate, make_policy, pick_fewest_machines)
from mooncaked.conductor.views import ClusterView, Decision, InstanceView, Rejection, RequestView

log = logging.getLogger(__name__)

ELASTIC_POLICY = "mooncaked_elastic"
DEFAULT_MAX_STAGES = 8


@dataclass(frozen=True)
class ElasticDecision(Decision):
    """A ``Decision`` whose prefill also runs on ``helpers``, in stage order after ``prefill``;
    ``alone_prefill_s``: its predicted prefill on ``prefill`` alone (should the helpers be busy)."""

    helpers: tuple[str, ...] = ()
    chunk_tokens: int = 0
    alone_prefill_s: float = 0.0


class ElasticMooncakedPolicy(MooncakedPolicy):
    """``mooncaked``, and a prompt may grow a pipeline over idle single instances.

    After ``mooncaked``'s choice, when that instance is idle, the pipeline doubles (2, 4, 8
    stages, at most ``max_stages`` and the idle single instances there are, predicted fastest
    first) while each doubling cuts the predicted TTFT by the factor ``1 + GROUP_MIN_GAIN``,
    the bar a static group must clear: machines are borrowed only where they earn their keep.
    (Growing one stage at a time stops at 3-4 stages, where one more gains < 1.3x: first half
    of the bundled trace, 16 singles, seeds 0-3: 1.084 s against 0.996 s doubling; 4 stages
    at most 0.988 s, 16 at most 1.021 s.)

    A prompt that misses the TTFT SLO on any one machine (the 100k+ token prompts, ~40 s alone)
    is the one a pipeline rescues, so when the machine chosen for it is busy it leads its pipeline
    from the best idle one instead. (A reserve of idle machines kept for such prompts was tried
    and not chosen: keeping 0, 1, 2, 4 or 8 back, first half, seeds 0-9, the SLO misses were noise
    and 0 the fastest; docs/performance.md, "Beyond Algorithm 1".)
    """

    name = ELASTIC_POLICY

    def __init__(self, slo: SLO | None = None, seed: int = 0,
                 kvcache_balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD, *,
                 shape_for: Callable[[int], PipelineShape], max_stages: int = DEFAULT_MAX_STAGES) -> None:
        super().__init__(slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold)
        if max_stages < 1:
            raise ValueError("max_stages must be at least 1")
        self.shape_for = shape_for
        self.max_stages = max_stages
        self._helpers: tuple[str, tuple[str, ...], int, float] = ("", (), 0, 0.0)

    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       prefills: list[InstanceView]) -> PrefillEstimate:
        self._helpers = ("", (), 0, 0.0)
        choices = self.estimates(request, prefills)
        est = pick_fewest_machines(choices)
        if self.max_stages < 2:
            return est
        # a prompt that misses its TTFT SLO on any one machine may lead its pipeline from an idle
        # machine other than the one chosen
        chosen = est
        critical = self.enforce_slo and est.ttft_s > self.slo.ttft_s
        if est.instance.queued_s > 0 and critical:
            est = min((e for e in choices if e.instance.pipeline_stages == 1 and e.instance.queued_s <= 0),
                      key=lambda e: (e.ttft_s, -e.local_blocks, e.instance.name), default=est)
        lead = est.instance
        if lead.pipeline_stages != 1 or lead.queued_s > 0:
            return est
        probe = min(request.prompt_len, self.shape_for(2).chunk_tokens)
        idle = sorted((p for p in prefills if p is not lead and p.pipeline_stages == 1 and p.queued_s <= 0),
                      key=lambda p: (p.model.prefill.predict(probe, 0), p.name))
        cached = max(0, min(est.reuse_blocks * request.block_size, request.prompt_len - 1))
        lead_probe = lead.model.prefill.predict(probe, 0)
        best, helpers = est, ()
        most = min(self.max_stages, len(idle) + 1)
        for stages in sorted({min(2 ** i, most) for i in range(1, most.bit_length() + 1)} - {1}):
            k = stages - 1
            shape = self.shape_for(stages)
            speeds = (1.0, *(lead_probe / max(p.model.prefill.predict(probe, 0), 1e-12) for p in idle[:k]))
            prefill = pipeline_prefill_s(lead.model.prefill.predict, request.prompt_len - cached, cached, shape, speeds)
            cand = PrefillEstimate(lead, est.reuse_blocks, est.local_blocks,
                                   est.transfer_s * max(shape.stage_fractions), prefill)
            if cand.ttft_s * (1 + GROUP_MIN_GAIN) > best.ttft_s:
                break
            best, helpers = cand, tuple(p.name for p in idle[:k])
        if best.ttft_s >= chosen.ttft_s:
            return chosen
        if helpers:
            self._helpers = (lead.name, helpers, self.shape_for(2).chunk_tokens, est.service_s)
        return best

    def decide(self, request: RequestView, cluster: ClusterView) -> Decision | Rejection:
        decision = super().decide(request, cluster)
        lead, helpers, chunk, alone_s = self._helpers
        if not isinstance(decision, Decision) or not helpers or decision.prefill != lead:
            return decision
        fields = {f.name: getattr(decision, f.name) for f in dataclasses.fields(Decision)}
        return ElasticDecision(**fields, helpers=helpers, chunk_tokens=chunk, alone_prefill_s=alone_s)



def make_sim_policy(name: str, profile: Profile, *, chunk_tokens: int, max_stages: int = DEFAULT_MAX_STAGES,
                    slo: SLO | None = None, seed: int = 0,
                    kvcache_balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD) -> Policy:
    """The conductor's policies by name, and the simulation-only elastic one."""
    if name != ELASTIC_POLICY:
        return make_policy(name, slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold)
    return ElasticMooncakedPolicy(slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold,
                                  shape_for=lambda s: PipelineShape.for_profile(profile, s, chunk_tokens),
                                  max_stages=max_stages)
