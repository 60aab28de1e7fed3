"""Elastic CPP in the simulator: ``mooncaked`` (ours) may pipeline one long prompt over idle single instances.

The policy is the live conductor's (``mooncaked.conductor.policies.ElasticMooncakedPolicy``,
``--policy mooncaked``); here it gets the profile's pipeline shape. At a decision, the
instance ``mooncaked_static`` would choose may borrow k other prefill instances that are idle (nothing
queued or running by the conductor's own books) as stages 2..k+1 of a chunked pipeline for
this prompt; they are busy until it finishes, and its blocks are cached on the chosen instance
(the borrowed stages send their layers' share back with the push to decode, after the first
token, so it costs no TTFT here). A pipeline whose machines are not all idle when it is routed
(the books were behind) is not formed: the prompt runs alone and is booked for that
(``ElasticDecision.alone``). Live, the instances build the pipeline per request (docs/architecture.md
§3a), and ``tools/replay_vs_sim.py --policy mooncake mooncaked`` checks these figures.
"""

from __future__ import annotations

import logging

from mooncaked.conductor.cost_model import Profile
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.pipeline_cost import PipelineShape
from mooncaked.conductor.policies import (DEFAULT_BALANCING_THRESHOLD, DEFAULT_MAX_STAGES, ELASTIC_POLICY,
                                          ElasticMooncakedPolicy, Policy, make_policy)
from mooncaked.conductor.views import ElasticDecision

__all__ = ["DEFAULT_MAX_STAGES", "ELASTIC_POLICY", "ElasticDecision", "ElasticMooncakedPolicy", "make_sim_policy"]

log = logging.getLogger(__name__)


def make_sim_policy(name: str, profile: Profile, *, chunk_tokens: int, max_stages: int = DEFAULT_MAX_STAGES,
                    slo: SLO | None = None, seed: int = 0,
                    kvcache_balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD) -> Policy:
    """The conductor's policies by name; the elastic one pipelines over the profile's shape."""
    return make_policy(name, slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold,
                       shape_for=lambda s: PipelineShape.for_profile(profile, s, chunk_tokens), max_stages=max_stages)
