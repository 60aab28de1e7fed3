"""The event loop: arrivals and prefill completions in time order, routed by a conductor policy.

At each arrival the simulation builds the same views the live conductor builds (prefix
hits from the shared ``PrefixIndex``, predicted queues from each instance's
``PrefillBacklog``, decode batches, each instance's fitted model) and calls
``policy.decide``; it then does what the conductor would: enqueue on P, announce the
sequence to D, or count the rejection.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from dataclasses import dataclass

from mooncaked.conductor.cost_model import Profile
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.pipeline_cost import DEFAULT_CHUNK_TOKENS, PipelineShape, pipeline_instance_model
from mooncaked.conductor.policies import Policy
from mooncaked.conductor.prefix_demand import PrefixDemand
from mooncaked.conductor.prefix_index import PrefixIndex
from mooncaked.conductor.views import ClusterView, Decision, InstanceView, RequestView, SeqLoad

from .cores import SharedCores
from .elastic import ElasticDecision
from .instances import Job, Seq, SimDecode, SimPrefill
from .metrics import Outcome, PolicyResult, summarize
from .pipeline import SimPipelineGroup
from .trace import TRACE_BLOCK_TOKENS, TraceRequest, scale_trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 16
    decode: int = 16
    profile: Profile | None = None
    slo: SLO = SLO()
    seed: int = 0
    noise: float = 0.05        # log-normal jitter of prefill times (sigma)
    heterogeneity: float = 0.1  # instance speeds drawn from [1 - h, 1 + h]
    cache_blocks: int | None = None        # per prefill instance; None: the profile's
    kv_capacity_tokens: int | None = None  # per decode instance; None: the profile's
    length_scale: float = 1.0  # lengths x this, as tools/replay.py sends them
    pipeline_groups: int = 0   # of the ``prefill`` machines, this many CPP groups of ``pipeline_stages`` each
    pipeline_stages: int = 2
    cpp_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    cpp_group_pulls: bool = False  # live, a group reuses only its stages' own prefix caches
    shared_cores: float | None = None  # every instance on one host with this many cores (cores.py); None: a machine each
    instance_threads: int = 1  # torch threads per instance, as the profile was measured with


class Simulation:
    def __init__(self, trace: list[TraceRequest], cfg: SimConfig, policy: Policy) -> None:
        if cfg.prefill < 1 or cfg.decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if cfg.profile is None:
            raise ValueError("SimConfig.profile is required")
        if cfg.pipeline_groups and (cfg.pipeline_stages < 2 or cfg.pipeline_groups * cfg.pipeline_stages > cfg.prefill):
            raise ValueError(f"{cfg.pipeline_groups} groups of {cfg.pipeline_stages} stages need at least 2 stages "
                             f"each and at most {cfg.prefill} prefill machines in all")
        if cfg.shared_cores is not None and cfg.pipeline_groups:
            raise ValueError("shared cores model single instances (and elastic pipelines over them), not CPP groups")
        if cfg.profile.block_size != TRACE_BLOCK_TOKENS or cfg.length_scale != 1.0 or cfg.profile.max_model_len:
            # what a live cluster with the profile's block size sees when tools/replay.py sends the trace
            ctx = cfg.profile.max_model_len
            trace = scale_trace(trace, cfg.length_scale, cfg.profile.block_size, ctx - 1 if ctx else None)
        self.trace = trace
        self.cfg = cfg
        self.policy = policy
        self.profile = prof = cfg.profile
        rng = random.Random(cfg.seed)  # the same cluster (speeds, jitter) for every policy
        h = cfg.heterogeneity
        self.index = PrefixIndex(max_entries=4_000_000)
        self.demand = PrefixDemand()  # as the live conductor's SchedulerState counts routed requests
        machines = [(rng.uniform(1 - h, 1 + h), random.Random(rng.random())) for _ in range(cfg.prefill)]
        self.prefills = self._prefill_units(machines)
        self.decodes = [SimDecode(f"decode-{i}", prof, prof.instance_model(), rng.uniform(1 - h, 1 + h),
                                  cfg.kv_capacity_tokens or prof.kv_capacity_tokens, cfg.slo.tbt_s, self._finished)
                        for i in range(cfg.decode)]
        self._p = {p.name: p for p in self.prefills}
        self._d = {d.name: d for d in self.decodes}
        self.outcomes = [Outcome(r.arrival_s, r.input_length, r.output_length) for r in trace]
        self._by_index = {r.index: i for i, r in enumerate(trace)}
        self.cores = (None if cfg.shared_cores is None
                      else SharedCores(cfg.shared_cores, cfg.instance_threads))
        self._due: dict[str, int] = {}  # with shared cores: each running prefill's live event (older ones are stale)

    def _prefill_units(self, machines: list[tuple[float, random.Random]]) -> list[SimPrefill]:
        """The first ``pipeline_groups x pipeline_stages`` machines form the groups, the rest stay single
        (so the same seed gives the same machines in every shape)."""
        cfg, prof = self.cfg, self.profile
        cache = cfg.cache_blocks or prof.cache_blocks
        s = cfg.pipeline_stages
        units: list[SimPrefill] = []
        if cfg.pipeline_groups:
            shape = PipelineShape.for_profile(prof, s, cfg.cpp_chunk_tokens)
            for g in range(cfg.pipeline_groups):
                group = machines[g * s:(g + 1) * s]
                units.append(SimPipelineGroup(f"group-{g}", prof, pipeline_instance_model(prof, shape), self.index,
                                              [speed for speed, _ in group], shape, cache, cfg.noise, group[0][1]))
        for i in range(cfg.pipeline_groups * s, cfg.prefill):
            speed, rng = machines[i]
            units.append(SimPrefill(f"prefill-{i}", prof, prof.instance_model(), self.index, speed, cache, cfg.noise,
                                    rng))
        return units

    # -- views --------------------------------------------------------------------------------
    def _cluster(self, now: float, req: TraceRequest) -> ClusterView:
        look = self.index.lookup(list(req.hash_ids))
        prefills = tuple(
            InstanceView(p.name, "prefill", p.model, own_blocks=look.holders.get(p.name, 0),
                         own_slow_blocks=look.holder_slow.get(p.name, 0), pool_blocks=look.pool_blocks,
                         pool_slow_blocks=look.pool_slow, queued_tokens=p.backlog.waiting_tokens,
                         queued_s=p.backlog.seconds(now), pending_blocks=p.pending_run(req.hash_ids),
                         pipeline_stages=p.stages, pulls=p.stages == 1 or self.cfg.cpp_group_pulls)
            for p in self.prefills)
        bs = self.profile.block_size
        decodes = []
        for d in self.decodes:
            d.advance(now)
            cap = d.capacity_tokens // bs
            decodes.append(InstanceView(d.name, "decode", d.model, batch=d.loads(),
                                        free_kv_blocks=max(0, cap - d.reserved // bs), total_kv_blocks=cap))
        return ClusterView(now, prefills, tuple(decodes), look.pool_source,
                           self.demand.count(req.hash_ids, look.pool_blocks, now))

    # -- events -------------------------------------------------------------------------------
    def run(self) -> PolicyResult:
        t0 = time.perf_counter()
        events: list[tuple[float, int, str]] = []  # (time, tiebreak, prefill name)
        seq = 0
        i = 0
        trace = self.trace
        cores = self.cores
        while i < len(trace) or events:
            if events and (i >= len(trace) or events[0][0] <= trace[i].arrival_s):
                now, due, name = heapq.heappop(events)
                if cores is not None:
                    if self._due.get(name) != due:
                        continue  # rescheduled when the cores' sharing changed
                    cores.stopped(name)
                nxt = self._prefill_done(self._p[name], now)
                started = [(name, nxt)]
            else:
                req = trace[i]
                i += 1
                now = req.arrival_s
                started = self._arrive(req, now)
            if cores is not None:
                for name, nxt in started:
                    if nxt is not None:
                        cores.started(name, now, nxt)
                started = list(self._share_cores(now).items())
            for name, nxt in started:
                if nxt is not None:
                    seq += 1
                    self._due[name] = seq
                    heapq.heappush(events, (nxt, seq, name))
        for d in self.decodes:
            d.advance(float("inf"))
        return summarize(self.policy.name, self.outcomes, self.cfg.slo, time.perf_counter() - t0)

    def _share_cores(self, now: float) -> dict[str, float]:
        """The busy instances from ``now`` on share the cores: decode steps so far run at the old share,
        then every running prefill's finish moves to the new one."""
        assert self.cores is not None
        for d in self.decodes:
            d.advance(now)
        busy = sum(p.running is not None for p in self.prefills) + sum(bool(d.batch) for d in self.decodes)
        finish = self.cores.update(now, busy)
        for d in self.decodes:
            d.slowdown = self.cores.slowdown
        return finish

    def _arrive(self, req: TraceRequest, now: float) -> list[tuple[str, float | None]]:
        """Route one arrival; returns (prefill unit, finish time of the job it started or None) per unit."""
        view = RequestView(req.input_length, req.hash_ids, self.profile.block_size,
                           max(req.output_length, 1), req.arrival_s, str(req.index))
        decision = self.policy.decide(view, self._cluster(now, req))
        out = self.outcomes[self._by_index[req.index]]
        if not isinstance(decision, Decision):
            out.rejected = decision.reason
            return []
        out.prefill, out.decode = decision.prefill, decision.decode
        self.demand.routed(str(req.index), req.hash_ids, now)
        if req.output_length > 1:
            self._d[decision.decode].incoming[req.index] = SeqLoad(req.input_length + 1, req.output_length - 1,
                                                                   now + decision.predicted_ttft_s)
        p = self._p[decision.prefill]
        helpers = [self._p[h] for h in decision.helpers] if isinstance(decision, ElasticDecision) else []
        if helpers and not (p.idle and all(h.idle for h in helpers)):
            # the books were behind (a prefill overran its prediction): no pipeline, and the prompt is
            # booked for what it will take alone, so the next decisions see the queue it makes
            decision = decision.alone()
            helpers = []
        job = Job(req, decision, now)
        if helpers:
            job.pipeline = PipelineShape.for_profile(self.profile, 1 + len(helpers), decision.chunk_tokens)
            job.stage_speeds = tuple(h.speed for h in helpers)
        done = p.enqueue(job, now)
        started = [(p.name, done)]
        for h in helpers:  # lent until the pipeline finishes
            started.append((h.name, h.enqueue(Job(req, decision, now, hold_s=done - now), now)))
        return started

    def _prefill_done(self, p: SimPrefill, now: float) -> float | None:
        job = p.complete(now)
        if job.lent:
            return p.start_next(now)
        req = job.req
        out = self.outcomes[self._by_index[req.index]]
        out.computed_tokens = job.computed_tokens
        out.reused_tokens = req.input_length - job.computed_tokens
        out.pulled_blocks = job.pulled_blocks
        out.wait_s = job.started_s - job.routed_s
        if req.output_length <= 1:
            out.ttft_s = now - req.arrival_s
            out.finished_s = now
        else:
            d = self._d[job.decision.decode]
            s = Seq(req.index, req.input_length + 1, req.output_length - 1, req.input_length + req.output_length, now)
            if d.admit(s, now):
                out.ttft_s = now - req.arrival_s
            else:
                out.dropped = True
        return p.start_next(now)

    def _finished(self, s: Seq, now: float) -> None:
        out = self.outcomes[self._by_index[s.rid]]
        out.finished_s = now
        out.decode_tokens = s.tokens
        out.slow_gaps = s.slow_gaps
