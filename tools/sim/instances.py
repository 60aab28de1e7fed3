"""Simulated instances: what a prefill and a decode engine do to time, and nothing more.

A prefill instance runs one request at a time, FIFO; before computing it brings in the
reused blocks (its own cache over the local link, pulled ones over the network) and after
it caches the request's blocks in its LRU prefix cache, reporting stored/removed blocks to
the prefix index as the real engine's KV events do. A decode instance runs continuous
batching: every step emits one token per sequence and lasts the profile's step time for
the batch; a sequence joins at the next step boundary after its KV arrives, if its
full-length KV fits.

Measured step times feed each instance's own fitted model, as heartbeats will live. An
instance may be lent to another's pipeline for one prompt (elastic CPP, ``elastic.py``).
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from mooncaked.conductor.cost_model import InstanceModel, PrefillBacklog, Profile
from mooncaked.conductor.pipeline_cost import PipelinePrefillModel, PipelineShape, pipeline_prefill_s
from mooncaked.conductor.prefix_index import PrefixIndex
from mooncaked.conductor.views import Decision, SeqLoad

from .trace import TraceRequest


@dataclass
class Job:
    """A request routed to a prefill instance, and what happened to it there."""

    req: TraceRequest
    decision: Decision
    routed_s: float
    started_s: float = 0.0
    reused_blocks: int = 0
    pulled_blocks: int = 0
    computed_tokens: int = 0
    compute_s: float = 0.0
    loading_s: float = 0.0  # bringing reused blocks in, before the compute
    # elastic CPP (tools/sim/elastic.py): pipelined over this instance and borrowed idle machines
    pipeline: PipelineShape | None = None
    stage_speeds: tuple[float, ...] = ()  # the borrowed machines' speeds, in stage order after this one
    hold_s: float | None = None  # a machine lent to another instance's pipeline: busy this long, no prompt of its own

    @property
    def lent(self) -> bool:
        return self.hold_s is not None


class SimPrefill:
    stages = 1  # machines in this prefill unit (a CPP group has more)

    def __init__(self, name: str, profile: Profile, model: InstanceModel, index: PrefixIndex, speed: float,
                 cache_blocks: int, noise: float, rng: random.Random) -> None:
        self.name = name
        self.profile = profile
        self.model = model
        self.index = index
        self.speed = speed
        self.cache_blocks = cache_blocks
        self.noise = noise
        self.rng = rng
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.backlog = PrefillBacklog()
        self.pending: Counter[int] = Counter()  # blocks the queued and running jobs will have cached

    @property
    def idle(self) -> bool:
        return self.running is None and not self.queue

    def pending_run(self, hashes: tuple[int, ...]) -> int:
        """Leading blocks of ``hashes`` that jobs already queued or running here are computing."""
        if not self.pending:
            return 0
        n = 0
        for h in hashes:
            if h not in self.pending:
                break
            n += 1
        return n

    def own_run(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def enqueue(self, job: Job, now: float) -> float | None:
        """Queue a job; returns its finish time when the instance was idle and started it."""
        if job.lent:
            self.backlog.add(str(job.req.index), job.hold_s, 0)
        else:
            self.backlog.add(str(job.req.index), job.decision.predicted_prefill_s, job.req.input_length)
            self.pending.update(job.req.hash_ids)
        self.queue.append(job)
        return self.start_next(now) if self.running is None else None

    def start_next(self, now: float) -> float | None:
        if self.running is not None or not self.queue:
            return None
        job = self.running = self.queue.popleft()
        req, d = job.req, job.decision
        job.started_s = now
        self.backlog.start(str(req.index), now)
        if job.lent:
            return now + job.hold_s
        own = self.own_run(req.hash_ids)
        reuse = own
        if d.reuse_blocks > d.local_blocks:  # the decision pulls: what the pool still holds now
            reuse = max(own, min(d.reuse_blocks, self.index.lookup(list(req.hash_ids[:d.reuse_blocks])).pool_blocks))
        bs = self.profile.block_size
        cached = max(0, min(reuse * bs, req.input_length - 1))
        job.reused_blocks, job.pulled_blocks = reuse, reuse - own
        job.computed_tokens = req.input_length - cached
        transfer = self.load_s(own, reuse - own)
        jitter = math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0
        if job.pipeline is None:
            job.compute_s = self.compute_s(job.computed_tokens, cached) * jitter
        else:  # every stage loads its layers' share at once; the chunks go through the pipeline
            transfer *= max(job.pipeline.stage_fractions)
            job.compute_s = jitter * pipeline_prefill_s(self.profile.prefill_s, job.computed_tokens, cached,
                                                        job.pipeline, (self.speed, *job.stage_speeds))
        job.loading_s = transfer
        return now + transfer + job.compute_s

    def load_s(self, local_blocks: int, pulled_blocks: int) -> float:
        """Bringing reused blocks in: its own over the local link, pulled ones over the network."""
        prof = self.profile
        return prof.block_bytes * (local_blocks / prof.local_bps + pulled_blocks / prof.remote_bps)

    def compute_s(self, tokens: int, prefix: int) -> float:
        """The prefill of ``tokens`` after ``prefix`` cached ones, before jitter."""
        return self.profile.prefill_s(tokens, prefix) / self.speed

    def complete(self, now: float) -> Job:
        job = self.running
        assert job is not None, "completion without a running job"
        self.running = None
        self.backlog.finish(str(job.req.index))
        if job.lent:
            return job
        self.pending.subtract(job.req.hash_ids)
        for h in job.req.hash_ids:
            if self.pending[h] <= 0:
                del self.pending[h]
        cached = job.req.input_length - job.computed_tokens
        job.compute_s = now - job.started_s - job.loading_s  # as planned, or stretched by shared cores (cores.py)
        if job.pipeline is None:
            self.model.prefill.observe(job.computed_tokens, cached, job.compute_s)
        else:  # as the live conductor does: the pipeline's time scaled back to this machine's own
            PipelinePrefillModel(self.model.prefill, job.pipeline).observe(job.computed_tokens, cached, job.compute_s)
        hashes = job.req.hash_ids
        if job.pulled_blocks and not job.decision.replicate:  # use the pulled blocks, do not keep them
            self._cache(hashes[:job.reused_blocks - job.pulled_blocks], hashes[job.reused_blocks:])
        else:
            self._cache((), hashes)
        return job

    def _cache(self, touched: tuple[int, ...], added: tuple[int, ...]) -> None:
        """LRU insert; newly held and evicted blocks go to the index like KV events."""
        new: list[int] = []
        for h in (*touched, *added):
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                new.append(h)
        gone: list[int] = []
        while len(self.cache) > self.cache_blocks:
            gone.append(self.cache.popitem(last=False)[0])
        if new:
            self.index.stored(self.name, new, "dram")
        if gone:
            self.index.removed(self.name, gone)


@dataclass(slots=True)
class Seq:
    rid: int
    context: int
    remaining: int
    reserved: int
    last_token_s: float
    tokens: int = 0
    slow_gaps: int = 0


@dataclass
class SimDecode:
    name: str
    profile: Profile
    model: InstanceModel
    speed: float
    capacity_tokens: int
    tbt_slo_s: float
    on_finish: Callable[[Seq, float], None]
    batch: list[Seq] = field(default_factory=list)
    incoming: dict[int, SeqLoad] = field(default_factory=dict)
    clock: float = 0.0  # end of the step in progress (or when the instance went idle)
    reserved: int = 0
    context_sum: int = 0
    steps: int = 0
    slowdown: float = 1.0  # wall seconds per profiled second: other instances on the same cores (cores.py)

    def advance(self, t: float) -> None:
        """Run every step that starts before ``t``."""
        c0, c1, c2 = self.profile.decode_coef
        slo = self.tbt_slo_s
        while self.batch and self.clock < t:
            n = len(self.batch)
            dt = (c0 + c1 * n + c2 * self.context_sum / 1000.0) / self.speed * self.slowdown
            if self.steps % 16 == 0:
                self.model.decode.observe(n, self.context_sum, dt)
            self.steps += 1
            self.clock += dt
            now = self.clock
            self.context_sum += n
            finished = False
            for s in self.batch:
                if now - s.last_token_s > slo:
                    s.slow_gaps += 1
                s.last_token_s = now
                s.context += 1
                s.tokens += 1
                s.remaining -= 1
                finished = finished or s.remaining <= 0
            if finished:
                keep = []
                for s in self.batch:
                    if s.remaining > 0:
                        keep.append(s)
                    else:
                        self.reserved -= s.reserved
                        self.context_sum -= s.context
                        self.on_finish(s, now)
                self.batch = keep

    def admit(self, seq: Seq, t: float) -> bool:
        """KV arrived at ``t``: join the batch if the sequence's full-length KV fits."""
        self.advance(t)
        self.incoming.pop(seq.rid, None)
        if self.capacity_tokens and self.reserved + seq.reserved > self.capacity_tokens:
            return False
        if not self.batch:
            self.clock = max(self.clock, t)
        self.batch.append(seq)
        self.reserved += seq.reserved
        self.context_sum += seq.context
        return True

    def loads(self) -> tuple[SeqLoad, ...]:
        running = tuple(SeqLoad(s.context, s.remaining, 0.0) for s in self.batch)
        return running + tuple(self.incoming.values())
