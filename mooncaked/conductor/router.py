"""Picks the prefill and decode instance for a live request, through a scheduling policy.

This is the live adapter around ``policies``: it turns the registry (heartbeat loads), the
prefix index and the conductor's own ledgers into the views every policy reads, asks the
policy, and maps its answer to a ``Route`` or a typed error. The simulator builds the same
views from simulated instances and calls the same policy.

Without a ``SchedulerState`` (the default) it keeps the old behaviour: least uncached +
queued tokens on prefill (cache-aware, own cache only), fewest sequences on decode, no
rejection. With one, the state's policy decides and its fitted models and ledgers feed it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from mooncaked.conductor.cost_model import GENERIC, InstanceModel, PrefillBacklog, Profile
from mooncaked.conductor.engine_link import DEAD, POOL, PrefillPlan
from mooncaked.conductor.errors import NoInstance, Rejected
from mooncaked.conductor.policies import CacheAwareLocalPolicy, ElasticMooncakedPolicy, Policy
from mooncaked.conductor.prefix_demand import PrefixDemand
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.conductor.pipeline_cost import (DEFAULT_CHUNK_TOKENS, PipelinePrefillModel, PipelineShape,
                                               pipeline_instance_model)
from mooncaked.conductor.registry import Instance, PipelineMember, Registry
from mooncaked.conductor.views import (ClusterView, Decision, ElasticDecision, InstanceView, Rejection, RequestView,
                                       SeqLoad)

log = logging.getLogger(__name__)

# Remaining tokens assumed for a sequence the heartbeat shows and the ledger does not know
# (routed by someone else, or before a restart): a typical decode length.
UNKNOWN_REMAINING_TOKENS = 256


# the typed errors a pick raises (conductor/errors.py), under the names the scheduler's tests know
NoInstanceError = NoInstance  # no instance of ``role`` can take the request now
RejectedError = Rejected  # early rejection: serving the request now would break an SLO; ``reason`` says which


@dataclass
class Route:
    prefill: Instance
    decode: Instance
    cached_blocks: int
    decision: Decision | None = None

    @property
    def helpers(self) -> tuple[str, ...]:
        """The instances lent to this prompt's prefill (elastic CPP), in stage order after the lead."""
        return self.decision.helpers if isinstance(self.decision, ElasticDecision) else ()

    def plan(self, find: Callable[[str], Instance | None] = lambda name: None) -> PrefillPlan | None:
        """What the policy decided the prefill should reuse and pull; travels with the prefill call.
        ``find`` names a holder's instance: a pull from a live peer goes straight to its KV cache (at
        its address); from the pool's holder, or a peer that is gone, it goes to the pool. The helpers
        of an elastic prefill go by their Engine addresses, all or none: one gone (dead, draining, a
        group's stage now) and the lead runs alone."""
        d = self.decision
        if d is None:
            return None
        helpers = [find(name) for name in self.helpers]
        addresses = [h.address for h in helpers if h is not None and h.available and h.pipeline is None
                     and h is not self.prefill]
        pull_blocks = max(0, d.reuse_blocks - d.local_blocks)
        source, address = "", ""
        if self.prefill.pipeline is not None:
            pull_blocks = 0  # a CPP group uses its stages' own prefix caches only
        if pull_blocks and d.pull_from:
            peer = find(d.pull_from) if d.pull_from not in (POOL, POOL_HOLDER) else None
            if peer is not None and peer.state != DEAD and peer is not self.prefill and peer.pipeline is None:
                source, address = peer.name, peer.address
            else:
                source = POOL
        return PrefillPlan(reuse_blocks=d.local_blocks, pull_from=source, pull_blocks=pull_blocks if source else 0,
                           pull_address=address, replicate=d.replicate,
                           helpers=addresses if len(addresses) == len(self.helpers) else [])


@dataclass
class _Seq:
    decode: str
    context: int
    remaining: int
    joins_at_s: float


# heartbeats of a prefill instance after a prefill there returned until its blocks are surely in the
# prefix index: the first may have been sent before the blocks were cached, the second was not
SETTLE_HEARTBEATS = 2


@dataclass
class PendingBlocks:
    """Block hashes of the prefills this conductor routed to one instance and has not yet seen cached.

    A prompt's blocks count from routing until the instance's KV events have surely reported them
    (``SETTLE_HEARTBEATS`` heartbeats after its prefill returned), so a request sharing the prefix
    never sees it as held nowhere: the policy's ``pending_blocks`` (as ``tools/sim`` counts them).
    """

    counts: Counter[int] = field(default_factory=Counter)
    requests: dict[str, tuple[int, ...]] = field(default_factory=dict)
    settling: dict[str, int] = field(default_factory=dict)  # request id -> heartbeats still to hear

    def add(self, request_id: str, hashes: tuple[int, ...]) -> None:
        self.drop(request_id)
        self.requests[request_id] = hashes
        self.counts.update(hashes)

    def settle(self, request_id: str) -> None:
        if request_id in self.requests:
            self.settling.setdefault(request_id, SETTLE_HEARTBEATS)

    def drop(self, request_id: str) -> None:
        hashes = self.requests.pop(request_id, None)
        self.settling.pop(request_id, None)
        if hashes:
            self.counts.subtract(hashes)
            for h in hashes:
                if self.counts[h] <= 0:
                    del self.counts[h]

    def heard(self) -> None:
        for rid, left in list(self.settling.items()):
            if left <= 1:
                self.drop(rid)
            else:
                self.settling[rid] = left - 1

    def run(self, hashes: list[int] | tuple[int, ...]) -> int:
        """Leading blocks of ``hashes`` that are pending here."""
        n = 0
        if self.counts:
            for h in hashes:
                if h not in self.counts:
                    break
                n += 1
        return n


@dataclass
class SchedulerState:
    """What the conductor learns at run time: per-instance fitted models and its own ledgers.

    The prefill backlog is what this conductor routed to each prefill instance and has not
    seen finish (``T_queue``, current between heartbeats); ``pending`` the prompt blocks of those
    prefills, until the instance's KV events report them cached; the decode ledger is each decode
    instance's sequences with their estimated remaining tokens (``max_tokens`` minus what
    was streamed); ``demand`` the routed requests per prefix lately (what makes a prefix hot). Call
    ``routed`` after a successful ``pick``, ``prefill_done`` when the
    Prefill RPC returns (or fails), ``heard`` on each heartbeat, ``tokens`` as tokens are
    relayed, ``finished`` at the end. An elastic prefill's helpers are booked for its predicted
    pipeline time, as its lead is, until the lead's prefill returns (``pipelines``: its shape, which
    turns the group's measured time into the lead's own).
    """

    policy: Policy
    profile: Profile = GENERIC
    clock: Callable[[], float] = time.monotonic
    models: dict[str, InstanceModel] = field(default_factory=dict)
    backlogs: dict[str, PrefillBacklog] = field(default_factory=dict)
    seqs: dict[str, _Seq] = field(default_factory=dict)
    pending: dict[str, PendingBlocks] = field(default_factory=dict)
    demand: PrefixDemand = field(default_factory=PrefixDemand)
    pipelines: dict[str, PipelineShape] = field(default_factory=dict)  # request id -> its elastic pipeline
    # instance -> heartbeats still to hear before its reported load counts again: its last report may predate
    # a prefill (or a decode sequence) of ours that ended since, and would show that work as still queued
    stale_reports: dict[str, int] = field(default_factory=dict)

    def model(self, name: str, pipeline: PipelineMember | None = None, block_bytes: int = 0) -> InstanceModel:
        """An instance's fitted time model; a CPP group's head gets one of the whole pipeline (fill and
        drain included), calibrated by the group's measured prefill times. ``block_bytes``: the size of the
        instance's KV block (its registered layout): transfers are predicted in its bytes, not the
        profile's (the generic prior's 1 MiB block made a pull of 180 KiB blocks look 6x as long)."""
        m = self.models.get(name)
        if m is None:
            if pipeline is not None and pipeline.stages > 1:
                shape = PipelineShape.for_profile(self.profile, pipeline.stages,
                                                  pipeline.chunk_tokens or DEFAULT_CHUNK_TOKENS)
                m = self.models[name] = pipeline_instance_model(self.profile, shape)
            else:
                m = self.models[name] = self.profile.instance_model()
                if block_bytes > 0:
                    m.transfer.block_bytes = block_bytes
        return m

    def backlog(self, name: str) -> PrefillBacklog:
        return self.backlogs.setdefault(name, PrefillBacklog())

    def forget(self, name: str) -> None:
        """An instance left (or restarted): its model, backlog and pending blocks start afresh."""
        self.models.pop(name, None)
        self.backlogs.pop(name, None)
        self.pending.pop(name, None)
        self.stale_reports.pop(name, None)

    def reports_current(self, name: str) -> bool:
        """Whether ``name``'s last heartbeat came after the end of every job of ours that ended there (else
        its load figures still count that job: a prefill that returned as queued tokens, a finished decode
        as a running sequence, and the conductor's own ledgers are what is current)."""
        return name not in self.stale_reports

    def _ended_on(self, name: str) -> None:
        self.stale_reports[name] = SETTLE_HEARTBEATS  # the first heartbeat may have left before the end

    def pending_run(self, name: str, hashes: list[int] | tuple[int, ...]) -> int:
        """Leading blocks of ``hashes`` that prefills routed to ``name`` are computing (or just cached)."""
        p = self.pending.get(name)
        return p.run(hashes) if p is not None else 0

    def heard(self, name: str) -> None:
        """A heartbeat of ``name`` arrived (its KV events are in the prefix index now)."""
        p = self.pending.get(name)
        if p is not None:
            p.heard()
        left = self.stale_reports.pop(name, 0)
        if left > 1:
            self.stale_reports[name] = left - 1

    # -- the request's path ---------------------------------------------------------------
    def routed(self, request_id: str, route: Route, prompt_len: int, max_tokens: int,
               hashes: list[int] | tuple[int, ...] = ()) -> None:
        d = route.decision
        predicted = d.predicted_prefill_s if d else 0.0
        self.backlog(route.prefill.name).add(request_id, predicted, prompt_len)
        if route.helpers and isinstance(self.policy, ElasticMooncakedPolicy):
            self.pipelines[request_id] = self.policy.shape_for(1 + len(route.helpers))
            for h in route.helpers:  # lent: busy for the pipeline's time, with no prompt of their own
                self.backlog(h).add(request_id, predicted, 0)
        if hashes:
            self.pending.setdefault(route.prefill.name, PendingBlocks()).add(request_id, tuple(hashes))
            self.demand.routed(request_id, hashes, self.clock())
        joins = self.clock() + (d.predicted_ttft_s if d else 0.0)
        self.seqs[request_id] = _Seq(route.decode.name, prompt_len + 1, max(max_tokens - 1, 0), joins)

    def prefill_done(self, request_id: str, prefill: str, uncached: int = 0, prefix: int = 0,
                     compute_s: float | None = None, cached: bool = True) -> None:
        """The Prefill RPC returned; ``compute_s`` is the engine-measured compute time, if known.
        Its blocks stay pending until the instance's heartbeats have surely reported them;
        ``cached=False`` (it failed): they are dropped at once. An elastic prefill's helpers are free
        again, and its measured time, the whole pipeline's, is scaled to one machine's by the schedule
        (``PipelinePrefillModel.observe``, as for a static group) before the lead's model sees it."""
        for name, b in self.backlogs.items():  # the lead's, and its helpers' for an elastic prefill
            if b.finish(request_id):
                self._ended_on(name)
        shape = self.pipelines.pop(request_id, None)
        p = self.pending.get(prefill)
        if p is not None:
            if cached:
                p.settle(request_id)
            else:
                p.drop(request_id)
        if compute_s is not None:
            machine = self.model(prefill).prefill
            # a pipeline's time is scaled back to the lead's own before its model learns from it
            (machine if shape is None else PipelinePrefillModel(machine, shape)).observe(uncached, prefix, compute_s)

    def tokens(self, request_id: str, n: int = 1) -> None:
        s = self.seqs.get(request_id)
        if s is not None:
            s.context += n
            s.remaining = max(0, s.remaining - n)

    def finished(self, request_id: str) -> None:
        """The request ended: its decode sequence and queued prefill go; blocks of a prefill that
        returned settle as usual (they are cached), those of one that never ran are dropped."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._ended_on(seq.decode)
        self.pipelines.pop(request_id, None)
        for name, b in self.backlogs.items():
            if b.finish(request_id):
                self._ended_on(name)
        for p in self.pending.values():
            if request_id not in p.settling:
                p.drop(request_id)

    # -- measurements (from heartbeats) ---------------------------------------------------
    def observe_prefill(self, name: str, uncached: int, prefix: int, seconds: float) -> None:
        self.model(name).prefill.observe(uncached, prefix, seconds)

    def observe_decode(self, name: str, batch: int, context_tokens: int, seconds: float) -> None:
        self.model(name).decode.observe(batch, context_tokens, seconds)

    def observe_transfer(self, name: str, path: str, nbytes: int, seconds: float) -> None:
        self.model(name).transfer.observe(path, nbytes, seconds)


def _decode_batch(d: Instance, known: list[_Seq], now: float, reported: bool = True) -> tuple[SeqLoad, ...]:
    """The ledger's sequences on ``d``, plus placeholders for load the heartbeat shows and the ledger does not
    (``reported``: its last heartbeat is current, not older than a sequence of ours that finished there)."""
    out = [SeqLoad(s.context, s.remaining, s.joins_at_s) for s in known]
    seen = d.load.running_requests + d.load.waiting_requests if reported else 0
    extra = max(0, max(seen, d.inflight) - len(known))
    if extra:
        used = (d.load.total_kv_blocks - d.load.free_kv_blocks) * d.layout.block_size
        each = max(0, used - sum(s.context for s in known)) // extra
        out.extend(SeqLoad(each, UNKNOWN_REMAINING_TOKENS, now) for _ in range(extra))
    return tuple(out)


def cluster_view(registry: Registry, index: PrefixIndex, hashes: list[int], state: SchedulerState,
                 exclude: set[str] | frozenset[str] = frozenset(), now: float | None = None,
                 stateless: bool = False) -> ClusterView:
    """The views a policy reads, from heartbeats, the prefix index and the state's ledgers."""
    now = state.clock() if now is None else now
    look = index.lookup(hashes)
    prefills = []
    for p in registry.available("prefill"):
        if p.name in exclude:
            continue
        model = state.model(p.name, p.pipeline, p.layout.whole_block_bytes)
        backlog = state.backlog(p.name)
        # a heartbeat older than a prefill of ours that ended there still counts it: the backlog is current
        reported = p.load.queued_prefill_tokens if state.reports_current(p.name) else 0
        reported += p.inflight * p.layout.block_size if stateless else 0
        from_heartbeat = model.prefill.predict(reported, 0) if reported else 0.0
        prefills.append(InstanceView(
            p.name, "prefill", model, own_blocks=look.holders.get(p.name, 0),
            own_slow_blocks=look.holder_slow.get(p.name, 0), pool_blocks=look.pool_blocks,
            pool_slow_blocks=look.pool_slow, queued_tokens=max(reported, backlog.waiting_tokens),
            queued_s=max(from_heartbeat, backlog.seconds(now)),
            pending_blocks=state.pending_run(p.name, hashes),
            pipeline_stages=p.pipeline.stages if p.pipeline is not None else 1, pulls=p.pipeline is None))
    by_decode: dict[str, list[_Seq]] = {}
    for s in state.seqs.values():
        by_decode.setdefault(s.decode, []).append(s)
    decodes = [InstanceView(d.name, "decode", state.model(d.name, block_bytes=d.layout.whole_block_bytes),
                            batch=_decode_batch(d, by_decode.get(d.name, []), now,
                                                state.reports_current(d.name)),
                            free_kv_blocks=d.load.free_kv_blocks, total_kv_blocks=d.load.total_kv_blocks)
               for d in registry.available("decode") if d.name not in exclude]
    return ClusterView(now, tuple(prefills), tuple(decodes), look.pool_source,
                       state.demand.count(hashes, look.pool_blocks, now))


def pick(registry: Registry, index: PrefixIndex, hashes: list[int], prompt_len: int,
         exclude: set[str] | frozenset[str] = frozenset(), *, state: SchedulerState | None = None,
         max_tokens: int = 1, request_id: str = "", arrival_s: float | None = None) -> Route:
    """Route a request; raises ``NoInstance`` (no instance of a role) or ``Rejected`` (SLO).

    ``state`` carries the policy, fitted models and ledgers; call ``state.routed`` with the
    result. Without it a throwaway state with the cache-aware local policy and a
    tokens-as-time prior reproduces the old router.
    """
    stateless = state is None
    if state is None:
        state = SchedulerState(CacheAwareLocalPolicy())
    view = cluster_view(registry, index, hashes, state, exclude, stateless=stateless)
    block_size = next((i.layout.block_size for i in registry.instances.values()), 1)
    request = RequestView(prompt_len, tuple(hashes), block_size, max(max_tokens, 1),
                          view.now_s if arrival_s is None else arrival_s, request_id)
    decision = state.policy.decide(request, view)
    if isinstance(decision, Rejection):
        if decision.reason in ("no_prefill", "no_decode"):
            raise NoInstance(decision.detail, decision.reason.removeprefix("no_"))
        log.info("rejected %s early (%s): %s", request_id or "a request", decision.reason, decision.detail)
        raise Rejected(decision.detail, decision.reason)
    return Route(registry.find(decision.prefill), registry.find(decision.decode), decision.reuse_blocks, decision)


def predict_kv_wait(state: SchedulerState, decode: Instance, prompt_len: int) -> float | None:
    """Seconds until ``decode`` is forecast to have KV room for a ``prompt_len``-token prompt.

    Its free blocks (last heartbeat) plus what the sequences this conductor routed there give
    back as they finish, earliest first; a sequence with ``r`` tokens to go finishes after ``r``
    steps of today's predicted step time. ``None`` when nothing known will free room (the
    blocks are held by requests this conductor did not route): no forecast, no rejection.
    """
    bs = decode.layout.block_size
    need = -(-prompt_len // bs) * bs
    free = decode.load.free_kv_blocks * bs
    if free >= need:
        return 0.0
    seqs = [s for s in state.seqs.values() if s.decode == decode.name]
    if not seqs:
        return None
    step = state.model(decode.name).decode.predict(len(seqs), sum(s.context for s in seqs))
    for remaining, held in sorted((s.remaining, s.context + s.remaining) for s in seqs):
        free += -(-held // bs) * bs
        if free >= need:
            return remaining * step
    return None
