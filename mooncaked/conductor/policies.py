"""Scheduling policies: given a request and a snapshot of the cluster, pick P and D, or reject.

One object per policy, chosen by name; the live conductor and the simulator call the same
``decide``. The baselines are the paper's comparison points:

- ``random`` / ``round_robin``: ignore load and cache (the engine still reuses what it
  happens to hold);
- ``load_balance``: the prefill instance with the least predicted queue;
- ``cache_aware_local``: the least predicted queue + prefill time counting only the
  instance's own cache;
- ``mooncake``: Algorithm 1 of the paper: also counts prefixes held elsewhere in the pool,
  pulled when the best remote match beats the local one by ``kvcache_balancing_threshold``
  (a ratio of lengths), copying them to the chosen instance (hot-spot replication), with
  SLO-aware decode choice and prediction-based early rejection;
- ``mooncaked_static``: as ``mooncake``, but it also counts prefixes still being computed
  (queueing behind one can beat recomputing it), each instance pulls exactly when
  pulling is predicted faster than recomputing (no length-ratio heuristic to tune), a pulled
  prefix is replicated only when it is hot (other requests held it lately), and a chunked
  pipeline group (several machines as one unit) is used only when it earns its machines
  (``pick_fewest_machines``);
- ``mooncaked`` (ours): ``mooncaked_static``, and a long prompt may pipeline over idle single
  instances lent to it for that prompt (elastic CPP, ``ElasticMooncakedPolicy``). Where no single
  instance is idle (or there is only one) it decides as ``mooncaked_static``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from mooncaked.conductor.early_rejection import SLO, DecodeForecast, check_ttft, pick_decode
from mooncaked.conductor.pipeline_cost import PipelineShape, pipeline_prefill_s
from mooncaked.conductor.views import ClusterView, Decision, ElasticDecision, InstanceView, Rejection, RequestView

log = logging.getLogger(__name__)

DEFAULT_BALANCING_THRESHOLD = 1.25
# mooncaked(_static) takes a unit of more machines (a CPP group) only when it cuts the predicted TTFT by
# this factor over the best unit of fewer (chosen on the first half of the bundled trace; 0.2-0.4
# alike; docs/performance.md, "Beyond Algorithm 1")
GROUP_MIN_GAIN = 0.3
# mooncaked(_static) replicates a pulled prefix only when at least this many requests routed within
# prefix_demand's window held the whole pulled run (the prefix is hot; docs/performance.md, "Beyond
# Algorithm 1")
HOT_MIN_DEMAND = 1
ELASTIC_POLICY = "mooncaked"
DEFAULT_MAX_STAGES = 8
# the live conductor's elastic pipeline chunk until a single prefill instance registers with its step budget
# (RegisterRequest.step_tokens): the GPU default (engine/config.py DEFAULT_STEP_TOKENS; not imported: it pulls
# in torch). It shapes the predicted fill and drain; measured group times calibrate the lead's model either way.
LIVE_ELASTIC_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class PrefillEstimate:
    """Algorithm 1's terms for one prefill instance and one choice of how much prefix to reuse."""

    instance: InstanceView
    reuse_blocks: int
    local_blocks: int
    transfer_s: float
    prefill_s: float

    @property
    def service_s(self) -> float:
        return self.transfer_s + self.prefill_s

    @property
    def ttft_s(self) -> float:
        return self.instance.queued_s + self.transfer_s + self.prefill_s


def estimate(p: InstanceView, request: RequestView, reuse_blocks: int,
             local_blocks: int | None = None) -> PrefillEstimate:
    """``T_transfer`` and ``T_prefill`` on ``p`` when the first ``reuse_blocks`` blocks are reused.

    Blocks in ``p``'s own cache (``local_blocks`` of them, by default ``own_blocks``) come
    over its local link (its disk tier for the slow ones); the rest are pulled from the
    pool, from disk where the pool holds them only there. At least one prompt token is
    always computed (it yields the first token).
    """
    local = min(p.own_blocks if local_blocks is None else local_blocks, reuse_blocks)
    pulled = reuse_blocks - local
    slow_local = min(p.own_slow_blocks, local)
    slow_pulled = min(p.pool_slow_blocks, pulled)
    transfer = p.model.transfer.seconds(remote_blocks=pulled - slow_pulled, slow_blocks=slow_local + slow_pulled,
                                        local_blocks=local - slow_local)
    cached = max(0, min(reuse_blocks * request.block_size, request.prompt_len - 1))
    prefill = p.model.prefill.predict(request.prompt_len - cached, cached)
    return PrefillEstimate(p, reuse_blocks, local, transfer, prefill)


class Policy(ABC):
    """A named scheduling policy. ``decide`` must not mutate its inputs; policies may keep
    their own small state (a counter, a random generator)."""

    name: ClassVar[str]
    early_rejection: ClassVar[bool] = False

    def __init__(self, slo: SLO | None = None, seed: int = 0,
                 kvcache_balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD) -> None:
        if kvcache_balancing_threshold < 1.0:
            raise ValueError("kvcache_balancing_threshold is a ratio of prefix lengths, at least 1")
        self.slo = slo or SLO()
        self.enforce_slo = slo is not None  # no SLO given: never reject for predicted lateness
        self.threshold = kvcache_balancing_threshold
        self.rng = random.Random(seed)
        self._turn = 0

    def decide(self, request: RequestView, cluster: ClusterView) -> Decision | Rejection:
        prefills = [p for p in cluster.prefills if p.available]
        if not prefills:
            return Rejection("no_prefill", "no prefill instance is serving")
        if not any(d.available for d in cluster.decodes):
            return Rejection("no_decode", "no decode instance is serving")
        est = self.choose_prefill(request, cluster, prefills)
        reach_s = cluster.now_s + est.ttft_s
        if self.early_rejection and self.enforce_slo:
            unloaded = min(estimate(p, request, max(p.own_blocks, p.pool_blocks) if p.pulls else p.own_blocks).service_s
                           for p in prefills)
            rejected = check_ttft(cluster.now_s - request.arrival_s + est.ttft_s, unloaded, self.slo)
            if rejected is not None:
                return rejected
        dec = self.choose_decode(request, cluster, reach_s)
        if isinstance(dec, Rejection):
            log.debug("%s: %s", self.name, dec.detail)
            return dec
        pulled = est.reuse_blocks - est.local_blocks
        source = cluster.pool_source if cluster.pool_source not in (None, est.instance.name) else "pool"
        return Decision(
            prefill=est.instance.name, decode=dec.name, reuse_blocks=est.reuse_blocks,
            local_blocks=est.local_blocks, pull_from=source if pulled else None,
            replicate=pulled > 0 and self.hot(est, cluster), predicted_ttft_s=est.ttft_s,
            predicted_tbt_s=dec.tbt_s, predicted_prefill_s=est.service_s)

    @abstractmethod
    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       prefills: list[InstanceView]) -> PrefillEstimate: ...

    def hot(self, est: PrefillEstimate, cluster: ClusterView) -> bool:
        """Whether the prefix ``est`` pulls is hot, to be replicated (kept by the instance and soft-pinned
        in the pool); asked only of a pull. Algorithm 1 pulls only on its ``kvcache_balancing_threshold``
        path, which is its hot-spot replication: every pull of a policy that pulls that way is hot."""
        return True

    def choose_decode(self, request: RequestView, cluster: ClusterView, reach_s: float) -> DecodeForecast | Rejection:
        return pick_decode(cluster.decodes, request, cluster.now_s, reach_s,
                           self.slo if self.early_rejection and self.enforce_slo else None)

    def _own(self, p: InstanceView, request: RequestView) -> PrefillEstimate:
        return estimate(p, request, p.own_blocks)


class RandomPolicy(Policy):
    name = "random"

    def choose_prefill(self, request, cluster, prefills):
        return self._own(self.rng.choice(prefills), request)

    def choose_decode(self, request, cluster, reach_s):
        decodes = [d for d in cluster.decodes if d.available]
        return pick_decode([self.rng.choice(decodes)], request, cluster.now_s, reach_s, None)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def choose_prefill(self, request, cluster, prefills):
        self._turn += 1
        return self._own(prefills[self._turn % len(prefills)], request)

    def choose_decode(self, request, cluster, reach_s):
        decodes = [d for d in cluster.decodes if d.available]
        return pick_decode([decodes[self._turn % len(decodes)]], request, cluster.now_s, reach_s, None)


class LoadBalancePolicy(Policy):
    """Least predicted queue; the prompt's cache plays no part in the choice."""

    name = "load_balance"

    def choose_prefill(self, request, cluster, prefills):
        p = min(prefills, key=lambda p: (p.queued_s, p.queued_tokens, p.name))
        return self._own(p, request)


class CacheAwareLocalPolicy(Policy):
    """Least ``T_queue + T_prefill`` counting each instance's own cache only (no pulls)."""

    name = "cache_aware_local"

    def choose_prefill(self, request, cluster, prefills):
        return min((self._own(p, request) for p in prefills),
                   key=lambda e: (e.ttft_s, -e.local_blocks, e.instance.name))


class MooncakePolicy(Policy):
    """Algorithm 1 of Mooncake (FAST '25): argmin of ``T_queue + T_transfer + T_prefill`` over prefill instances.

    For each instance, the best match anywhere (``best_len``) is used instead of its own
    (``prefix_len``) when ``best_len > kvcache_balancing_threshold * prefix_len``; the chosen
    instance then pulls the missing blocks and keeps them, so a hot prefix spreads off a
    loaded holder.
    """

    name = "mooncake"
    early_rejection = True

    def choose_prefill(self, request, cluster, prefills):
        best_len = max(p.pool_blocks for p in prefills)
        choices = []
        for p in prefills:
            pull = p.pulls and best_len > p.own_blocks and best_len > self.threshold * p.own_blocks
            choices.append(estimate(p, request, best_len if pull else p.own_blocks))
        return min(choices, key=lambda e: (e.ttft_s, -e.local_blocks, e.instance.name))


class StaticMooncakedPolicy(Policy):
    """Ours without lending: Algorithm 1, plus prefixes still being computed, and pulls decided by time.

    - **Prefixes in flight.** The prefix index knows only blocks that are already cached.
      A request that shares a prefix with one still prefilling (the next turn of a
      conversation, the same document asked again) looks cold everywhere to Algorithm 1,
      which recomputes the prefix on whichever instance is free. But the instance computing
      it will hold it by the time a request queued there now starts (first come, first
      served), so ``pending_blocks`` count as its own: queueing behind the prefix is
      chosen when that wait is shorter than recomputing it elsewhere.
    - **Pull or recompute by predicted time.** Each instance pulls the pool's longer prefix
      exactly when ``T_transfer + T_prefill`` with it beats ``T_prefill`` from what it holds.
      A length ratio cannot see the link: it refuses 20 more blocks on top of 100 held
      (1.2x) even when they save seconds of compute, and over a slow link or from a disk
      tier it pulls where recomputing is faster. There is no threshold to tune. Since a pull
      here is no sign of a hot prefix, it replicates only a prefix other requests routed
      lately also held (``hot``, ``prefix_demand.py``).
    - **Groups for the prompts they speed up.** With CPP groups in the cluster, Algorithm 1
      sends a prompt to a group whenever the group is predicted a little faster, and a
      short or mostly cached prompt then holds S machines that the long prompt arriving
      next needed; ``pick_fewest_machines`` keeps such prompts on single instances.

    Against ``mooncake`` on the bundled trace (16P+16D, seeds 0-3; docs/performance.md,
    "Beyond Algorithm 1"): mean TTFT x0.984 on the whole trace, x0.968 on its held-out second
    half, SLO attainment no worse; the gain is the in-flight prefixes (the pull rule ties on
    fast links). With 2 CPP groups of 4 + 8 single machines (simulated): x0.952 whole, x0.943
    held out. Live, the router fills ``pending_blocks`` from its ledger of routed prefills
    (router.PendingBlocks), and ``pipeline_stages`` and the group's pipeline model per group.
    """

    name = "mooncaked_static"
    early_rejection = True

    def choose_prefill(self, request, cluster, prefills):
        return pick_fewest_machines(self.estimates(request, prefills))

    def hot(self, est: PrefillEstimate, cluster: ClusterView) -> bool:
        """A pull here is decided by time, not by Algorithm 1's balancing ratio, so a pull alone does not
        make a prefix hot: it is hot when other requests routed lately held the whole pulled run."""
        return cluster.pool_demand >= HOT_MIN_DEMAND

    @staticmethod
    def estimates(request: RequestView, prefills: list[InstanceView]) -> list[PrefillEstimate]:
        """Each unit's best plan: its own and in-flight prefix, or the pool's when pulling is predicted faster."""
        best_len = max(p.pool_blocks for p in prefills)
        choices = []
        for p in prefills:
            local = max(p.own_blocks, p.pending_blocks)
            est = estimate(p, request, local, local)
            if p.pulls and best_len > local:
                pulled = estimate(p, request, best_len, local)
                if pulled.service_s < est.service_s:
                    est = pulled
            choices.append(est)
        return choices


def pick_fewest_machines(choices: list[PrefillEstimate], min_gain: float = GROUP_MIN_GAIN) -> PrefillEstimate:
    """The least predicted TTFT, except that a unit of more machines (a CPP group) must earn them.

    A group runs one prompt at a time on all its machines, so a prompt it barely speeds up
    (one chunk: nothing; a cached prefix and a short tail: little) holds S machines for
    what one would do, and the long prompt arriving next waits for the group or runs S
    times slower on a single. A unit with more stages is taken only when its TTFT beats the
    best with fewer by the factor ``1 + min_gain``; with all units single this is plain argmin.
    """
    best = min(choices, key=lambda e: (e.ttft_s, -e.local_blocks, e.instance.name))
    for e in sorted(choices, key=lambda e: (e.instance.pipeline_stages, e.ttft_s, -e.local_blocks, e.instance.name)):
        if e.instance.pipeline_stages >= best.instance.pipeline_stages:
            break
        if e.ttft_s <= best.ttft_s * (1 + min_gain):
            return e
    return best


class ElasticMooncakedPolicy(StaticMooncakedPolicy):
    """``mooncaked``, ours: ``mooncaked_static``, and a prompt may grow a pipeline over idle single
    instances (elastic CPP).

    After ``mooncaked_static``'s choice, when that instance is idle, the pipeline doubles (2, 4, 8
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

    ``shape_for(stages)`` is the pipeline's shape: the simulator's from its profile, the live
    conductor's ``live_elastic_shape``. The caller lends the helpers (``ElasticDecision.helpers``)
    until the lead's prefill ends and books them for the predicted pipeline time (live:
    ``placement.py``, ``router.SchedulerState``; simulated: ``tools/sim/engine.py``).
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


@dataclass
class LiveElasticShape:
    """The live conductor's elastic pipeline: the model's layers in whole-layer shares as the engines split
    them (``num_layers``; 0: exact shares), chunks of the engines' step budget (``chunk_tokens``, set from
    their registrations), and no hop cost: the conductor measures no link between prefill instances, and a
    chunk's hidden states (hidden size x dtype per token, a few KiB) are left out rather than guessed; the
    lead's measured group times calibrate its model (``SchedulerState``)."""

    num_layers: int = 0
    chunk_tokens: int = LIVE_ELASTIC_CHUNK_TOKENS

    def __call__(self, stages: int) -> PipelineShape:
        return PipelineShape.even(stages, self.chunk_tokens, num_layers=self.num_layers)


def live_elastic_shape(stages: int) -> PipelineShape:
    """``LiveElasticShape()`` with exact shares and the default chunk (a policy made without a model)."""
    return LiveElasticShape()(stages)


POLICIES: dict[str, type[Policy]] = {c.name: c for c in (RandomPolicy, RoundRobinPolicy, LoadBalancePolicy,
                                                          CacheAwareLocalPolicy, MooncakePolicy, StaticMooncakedPolicy)}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


# every policy: those above, and ours (elastic CPP, which needs its pipeline's shape: ``make_policy``)
ALL_POLICY_NAMES: tuple[str, ...] = (*POLICY_NAMES, ELASTIC_POLICY)


def make_policy(name: str, *, slo: SLO | None = None, seed: int = 0,
                kvcache_balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD,
                shape_for: Callable[[int], PipelineShape] = live_elastic_shape,
                max_stages: int = DEFAULT_MAX_STAGES) -> Policy:
    """A fresh policy object by name; raises ``ValueError`` naming the known ones. ``shape_for`` and
    ``max_stages`` are ``mooncaked``'s (default: the live conductor's shape)."""
    if name == ELASTIC_POLICY:
        return ElasticMooncakedPolicy(slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold,
                                      shape_for=shape_for, max_stages=max_stages)
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(ALL_POLICY_NAMES)}")
    return cls(slo=slo, seed=seed, kvcache_balancing_threshold=kvcache_balancing_threshold)
