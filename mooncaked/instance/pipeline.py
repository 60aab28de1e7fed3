"""Chunked pipeline parallel prefill (CPP): this instance as one stage of a prefill group.

The group's first stage (the head) gets the conductor's Prefill with the other stages' addresses.
It opens the next stage (``StageOpen``), which opens the one after it, and so on; each answers how
many leading blocks it and those after it hold, and the head starts the whole group at the
shortest run (a stage can only start where its previous stage does). Then every stage computes
its layers chunk by chunk (the engine's step budget is the chunk): after each step it writes
the chunk's boundary hidden states into the next stage's inbox over the transfer engine and tells
it how far they reach (``stage_input``), so stage K+1 computes chunk i while stage K computes
chunk i+1. Each stage pushes its own layers' KV into the decode's reserved blocks layer by
layer (``kv_push.py``, with its layer offset), under its own write fence. The last stage samples
the first token; ``stage_finish`` brings it back up the chain once every stage's pushes landed.

Failures end the request on every stage: a stage whose next one fails (a refused write, a dead
process) fails its request at once; one whose input stops coming for ``INPUT_IDLE_S`` gives up;
the head's answer is UNAVAILABLE, so the conductor retries elsewhere.

Elastic groups (a whole-model prefill instance): the conductor's plan lends idle instances to one
prompt (``PrefillPlan.helpers``). The instance it is routed to leads: it is stage 0 of that request's
even layer split, each helper the next stage (``StageOpen.elastic``), and the engine runs only the
request's layers (``Engine.add_request(layers=)``). The lead first carries out its plan (own run, pool
or peer pulls); each helper reads its layers of the run the lead then holds straight out of the lead's
KV region (by block id: the lead holds them until the request ends), so the group starts where the
lead's run ends. A helper that fails leaves the lead to compute the prompt alone (``Worker.prefill``).
The lead holds
all the prompt's blocks from its first chunk and names them with its first input; every helper
writes its layers of the new tokens into them as it computes (``copy``, beside its push to the
decode), so once the chain finished, the lead publishes the prompt's blocks whole to its prefix
cache and the pool. A helper's own blocks hold a share of the layers: it publishes none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mooncaked.conductor.engine_link import (CANCELLED, DEADLINE, EXHAUSTED, INVALID, NOT_FOUND, PRECONDITION,
                                             UNAVAILABLE, EngineError, EngineLink, PrefillPlan, PrefillResult,
                                             Reservation, StageOpen, StageOpened, TransferEndpoint)
from mooncaked.engine import Output, RequestError, SamplingParams
from mooncaked.engine.llm_engine import EngineStoppedError
from mooncaked.engine.stage import PipelineStage
from mooncaked.instance import metrics
from mooncaked.instance.kv_push import KVPush
from mooncaked.instance.peer_pull import read_ops
from mooncaked.instance.prefill import first_token_result
from mooncaked.instance.prefix_fetch import Prepared
from mooncaked.instance.write_fence import WriteFence
from mooncaked.tasks import spawn
from mooncaked.transfer import TransferError, TransferOp

if TYPE_CHECKING:
    from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

INBOX_REGION = "cpp-inbox"  # hidden states written here by the previous stage
OUTBOX_REGION = "cpp-outbox"  # hidden states staged here for the next stage
DEFAULT_SLOTS = 2  # prompts a stage pipelines at once (each slot holds one prompt's hidden states)
MAX_SLOT_BYTES = 256 << 20  # one slot's hidden states at most (a longer prompt is refused, naming the limit)
CALL_TIMEOUT_S = 10.0  # one control call to the next stage
# a stage whose previous stage sent nothing for this long gives the request up: well above one chunk's compute on
# the previous stage (a 512-token chunk of half the default model's layers on one CPU thread took ~10 s, and a
# 10 s bound made an elastic helper give up mid-prompt); a stage that dies is noticed from its failed writes
INPUT_IDLE_S = 60.0
FINISH_WAIT_S = 120.0  # a computed request nobody asks the result of is given up after this long
STAGE_TIMEOUT_S = 600.0  # the whole of one prompt on a stage
PUSH_TIMEOUT_S = 60.0
END_WAIT_S = PUSH_TIMEOUT_S + CALL_TIMEOUT_S  # a second caller of _end waits this long for the first


@dataclass
class StageJob:
    """One prompt's part on this stage."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    target: Reservation
    push: KVPush
    fence: WriteFence
    slot: int
    stage: PipelineStage  # this stage's place for this request (a static group's, or an elastic split's)
    local: list[int]  # own cached run (or the pool's longer one), held until the group's start is agreed
    from_pool: int = 0  # of ``local``, blocks read from the pool (not written back again)
    prepared: Prepared | None = None  # an elastic lead: how its plan's reuse and pulls went
    kept: int = 0  # leading blocks the group started after
    next_link: EngineLink | None = None
    next_opened: StageOpened | None = None
    start_tokens: int | None = None  # where the group computes from (agreed)
    ready: int = 0  # input tokens that have arrived (stages after the first)
    added: bool = False
    first: asyncio.Future | None = None  # the engine's Output once this stage computed the prompt
    broken: asyncio.Future | None = None  # set with the first failure of anything this stage sends
    sends: asyncio.Future | None = None  # the last of the ordered sends to the next stage
    last_input: float = field(default_factory=time.monotonic)
    opened_at: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    keeper: asyncio.Task | None = None
    completed: bool = False  # this stage and every later one answered
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set as ``_end`` starts
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set once ``_end`` gave everything back
    # elastic CPP: this request's layers on a whole-model engine (None: a static group's stage)
    layers: tuple[int, int] | None = None
    lead_cached: list[int] = field(default_factory=list)  # the lead's cached run (block ids there)
    lead_endpoint: TransferEndpoint | None = None  # a helper: the lead's KV region, where ``copy`` writes
    lead_blocks: list[int] = field(default_factory=list)  # the lead's blocks of the prompt (named with input)
    lead_named: bool = False  # the next stage was told ``lead_blocks``
    copy: KVPush | None = None  # a helper: its layers of the new tokens into the lead's blocks

    @property
    def elastic(self) -> bool:
        return self.layers is not None


class Pipeline:
    """This worker's stage of a CPP group: its hidden-state slots and the prompts in flight."""

    def __init__(self, worker: Worker, slots: int = DEFAULT_SLOTS) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.stage = worker.engine.stage
        # a whole-model engine joins elastic groups: any stage of a request, per request
        self.elastic = self.stage.count == 1
        cfg = self.engine.model_config
        self.row_bytes = cfg.hidden_size * self.engine.dtype.itemsize
        self.slot_rows = min(self.engine.max_model_len, MAX_SLOT_BYTES // self.row_bytes)
        self.slot_bytes = self.slot_rows * self.row_bytes
        self.free_slots = list(range(slots))
        self.slots_free = asyncio.Semaphore(slots)
        self.jobs: dict[str, StageJob] = {}
        self.inbox = self._region(INBOX_REGION, slots) if self.elastic or not self.stage.is_first else None
        self.outbox = self._region(OUTBOX_REGION, slots) if self.elastic or not self.stage.is_last else None
        self.engine.hidden_source = self._hidden_in
        self.engine.hidden_sink = self._hidden_out
        self._loop: asyncio.AbstractEventLoop | None = None

    def _region(self, name: str, slots: int) -> torch.Tensor:
        raw = self.worker.transfer.alloc_region(name, slots * self.slot_bytes)
        return raw.view(self.engine.dtype).view(slots, self.slot_rows, -1)

    # -- engine thread ------------------------------------------------------------------------
    def _hidden_in(self, rid: str, start: int, n: int) -> torch.Tensor:
        job = self.jobs.get(rid)
        if job is None or self.inbox is None or start + n > job.ready:
            raise RuntimeError(f"stage {self.stage}: no input hidden states for {rid} tokens {start}-{start + n}")
        return self.inbox[job.slot, start:start + n]

    def _hidden_out(self, rid: str, start: int, rows: torch.Tensor) -> None:
        job = self.jobs.get(rid)
        if job is None or self.outbox is None:
            return
        end = start + rows.shape[0]
        self.outbox[job.slot, start:end].copy_(rows)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._send, job, start, end)

    # -- the calls ----------------------------------------------------------------------------
    async def head(self, rid: str, prompt: list[int], params: SamplingParams, target: Reservation,
                   stages: list[str], plan: PrefillPlan | None = None) -> PrefillResult:
        """The first stage's prefill: open the group, compute, and answer with the last stage's token.
        On a whole-model engine, ``stages`` are the helpers the conductor lent to this prompt."""
        if self.elastic:
            if not stages:
                raise EngineError(INVALID, "an elastic prefill names at least one helper")
            if len(stages) + 1 > self.stage.num_layers:
                raise EngineError(INVALID, f"{len(stages) + 1} stages over {self.stage.num_layers} layers: at most "
                                           "one stage a layer")
            if len(set(stages)) != len(stages):  # (one naming the lead itself is refused by its StageOpen)
                raise EngineError(INVALID, "an elastic prefill's helpers must be distinct instances")
        elif not self.stage.is_first or len(stages) != self.stage.count - 1:
            raise EngineError(PRECONDITION, f"{self.worker.name} is stage {self.stage}; a prefill through it needs "
                                            f"the addresses of its {self.stage.count - 1} later stages, got "
                                            f"{len(stages)}")
        try:
            await asyncio.wait_for(self.slots_free.acquire(), STAGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineError(DEADLINE, f"{self.worker.name}: no pipeline slot freed in {STAGE_TIMEOUT_S:.0f}s") from None
        try:
            opening = StageOpen(rid, prompt, params, target, list(stages))
            if self.elastic:
                opening.elastic = (0, len(stages) + 1)
            job = await self._open(opening, plan)
            try:
                cached = job.next_opened.cached_blocks if job.next_opened is not None else len(job.local)
                await self._start(job, min(len(job.local), cached) * self.worker.layout.block_size)
                return await self._finish(job)
            finally:
                await self._end(job)
        finally:
            self.slots_free.release()

    async def open(self, opening: StageOpen) -> StageOpened:
        """A later stage: take the prompt, open the stages after this one, answer the shortest run."""
        stage = self._stage_of(opening)
        if stage.is_first:
            raise EngineError(PRECONDITION, f"{self.worker.name} is the first stage of its group; StageOpen goes "
                                            "to a later stage")
        if len(opening.downstream) != stage.count - 1 - stage.index:
            raise EngineError(INVALID, f"stage {stage} has {stage.count - 1 - stage.index} stages "
                                       f"after it; the call names {len(opening.downstream)}")
        job = await self._open(opening)
        cached = len(job.local)
        if job.next_opened is not None:
            cached = min(cached, job.next_opened.cached_blocks)
        # the job now waits for its first input; a caller that never sends gives it up in INPUT_IDLE_S
        spawn(self._watch(job), f"stage-watch-{opening.request_id}")
        return StageOpened(cached, self._endpoint(), job.slot * self.slot_bytes, self.row_bytes)

    def _stage_of(self, opening: StageOpen) -> PipelineStage:
        """This engine's place for the request: its static stage, or the elastic split the opening names."""
        if opening.elastic is None:
            if self.elastic:
                raise EngineError(PRECONDITION, f"{self.worker.name} holds the whole model; it joins a pipeline "
                                                "only as an elastic helper (StageOpen with its stage)")
            return self.stage
        if not self.elastic:
            raise EngineError(PRECONDITION, f"{self.worker.name} is stage {self.stage} of a static group; it takes "
                                            "no elastic share")
        index, count = opening.elastic
        if not 0 <= index < count <= self.stage.num_layers:
            raise EngineError(INVALID, f"elastic stage {index}/{count} is not a stage of at most "
                                       f"{self.stage.num_layers} (one a layer)")
        if index > 0 and opening.lead_endpoint is None:
            raise EngineError(INVALID, "an elastic helper needs the lead's KV endpoint")
        if len(opening.lead_cached) > (len(opening.prompt_token_ids) - 1) // self.worker.layout.block_size:
            raise EngineError(INVALID, f"{len(opening.lead_cached)} cached lead blocks leave no prompt token to "
                                       "compute")
        return PipelineStage.of(index, count, self.stage.num_layers)

    async def input(self, rid: str, start: int, ready: int, lead_blocks: list[int] | None = None) -> None:
        job = self.jobs.get(rid)
        if job is None:
            raise EngineError(NOT_FOUND, f"stage {self.stage} of {self.worker.name} has no request {rid!r}")
        if job.elastic and not job.lead_blocks:
            self._name_lead_blocks(job, lead_blocks or [], start)
        bs = self.worker.layout.block_size
        if job.start_tokens is None:
            if start % bs or start // bs > len(job.local) or start >= len(job.prompt):
                raise EngineError(INVALID, f"start {start} is not a block boundary within the {len(job.local)} "
                                           f"cached blocks this stage reported")
        elif start != job.start_tokens:
            raise EngineError(INVALID, f"start {start} differs from the request's start {job.start_tokens}")
        if not start < ready <= len(job.prompt) or ready < job.ready:
            raise EngineError(INVALID, f"input up to token {ready} is outside ({start}, {len(job.prompt)}] or goes "
                                       f"back from {job.ready}")
        job.last_input = time.monotonic()
        job.ready = ready
        if job.start_tokens is None:
            await self._start(job, start)
        elif not self.engine.set_stage_input(rid, ready) and not job.first.done():
            raise EngineError(NOT_FOUND, f"request {rid!r} is no longer running on stage {self.stage}")

    async def finish(self, rid: str) -> PrefillResult:
        job = self.jobs.get(rid)
        if job is None:
            raise EngineError(NOT_FOUND, f"stage {self.stage} of {self.worker.name} has no request {rid!r}")
        try:
            return await self._finish(job)
        finally:
            await self._end(job)

    async def abort(self, rid: str) -> bool:
        """Stop the request on this stage and every later one; True when it was here."""
        job = self.jobs.get(rid)
        if job is None:
            return False
        self._fail(job, EngineError(CANCELLED, f"request {rid!r} was aborted"))
        await self._end(job)
        return True

    # -- the parts ------------------------------------------------------------------------------
    async def _open(self, opening: StageOpen, plan: PrefillPlan | None = None) -> StageJob:
        w = self.worker
        w.check("prefill")
        self._loop = asyncio.get_running_loop()
        rid, prompt, target = opening.request_id, list(opening.prompt_token_ids), opening.target
        stage = self._stage_of(opening)
        why = w.layout.compatible(target.layout, num_layers=self.stage.num_layers)
        if why:
            raise EngineError(PRECONDITION, f"decode KV layout does not match: {why}")
        if len(target.block_ids) != -(-len(prompt) // w.layout.block_size):
            raise EngineError(INVALID, f"{len(target.block_ids)} decode blocks for {len(prompt)} prompt tokens")
        if not rid or rid in self.jobs or w.was_aborted(rid):
            raise EngineError(INVALID, "request_id must be non-empty, unused and not aborted")
        if not 0 < len(prompt) < self.slot_rows:
            raise EngineError(INVALID, f"the prompt has {len(prompt)} tokens; this stage takes 1 to "
                                       f"{self.slot_rows - 1}")
        try:
            opening.sampling.validate()
        except RequestError as e:
            raise EngineError(INVALID, str(e)) from None
        if not self.free_slots:
            raise EngineError(EXHAUSTED, f"stage {self.stage} of {w.name}: every hidden-state slot is in use")
        loop = self._loop
        fence = w.fence(rid, target)
        layers = (stage.first_layer, stage.end_layer) if self.elastic else None
        push = KVPush(w.transfer, loop, w.layout, target.layout, target.endpoint.address, list(target.block_ids),
                      len(prompt), fence=fence, layer_offset=0 if self.elastic else self.stage.first_layer,
                      layers=layers)
        job = StageJob(rid, prompt, opening.sampling, target, push, fence, self.free_slots.pop(), stage, [],
                       first=loop.create_future(), broken=loop.create_future(), layers=layers,
                       lead_cached=list(opening.lead_cached), lead_endpoint=opening.lead_endpoint)
        self.jobs[rid] = job
        w.prefiller.pushes[rid] = push  # the engine's layer hook pushes this stage's layers
        try:
            if fence.active and not await fence.renew():
                raise EngineError(CANCELLED if fence.gone else UNAVAILABLE, fence.why_closed())
            if fence.active:
                job.keeper = spawn(fence.keep(), f"fence-{rid}")
            lead = job.elastic and not stage.index
            if lead:  # its run before the helpers open: the plan's reuse and pulls, which they read from here
                job.prepared = await w.prefiller.fetch.prepare(prompt, plan)
                job.local = job.prepared.imported or await self.engine.call(self._take_run, prompt)
                job.prepared.imported = []  # held as ``job.local`` now
                job.lead_cached = list(job.local)
            if opening.downstream:
                link = w.peers(opening.downstream[0]) if w.peers is not None else None
                if link is None:
                    raise EngineError(UNAVAILABLE, f"no link to the next stage at {opening.downstream[0]}")
                job.next_link = link
                onward = StageOpen(rid, prompt, opening.sampling, target, list(opening.downstream[1:]))
                if job.elastic:
                    onward.elastic = (stage.index + 1, stage.count)
                    onward.lead_cached = job.lead_cached
                    onward.lead_endpoint = w.endpoint() if lead else opening.lead_endpoint
                job.next_opened = await self._call_next(job, link.stage_open(onward, CALL_TIMEOUT_S))
                if job.next_opened.row_bytes != self.row_bytes:
                    raise EngineError(PRECONDITION, f"the next stage's hidden states are {job.next_opened.row_bytes} "
                                                    f"bytes a token, here {self.row_bytes}")
            scored = opening.sampling.scored  # computed whole: a reused block has no logits to score it with
            if not lead and not scored:
                job.local = await self.engine.call(self._take_run, prompt)
            if job.elastic and not lead:  # a helper: the lead's run, read out of its KV cache
                job.local += await self._pull_lead_run(job)
            elif w.pool is not None and not job.elastic and not scored:  # the pool's run of these layers, if longer
                pooled = await w.pool.fetch_prefix(prompt)
                if pooled:
                    await self.engine.call(self.engine.unreserve, job.local)
                    job.local, job.from_pool = pooled, len(pooled)
        except BaseException:
            await self._end(job)
            raise
        return job

    async def _pull_lead_run(self, job: StageJob) -> list[int]:
        """An elastic helper: read its layers of the lead's cached blocks beyond its own run into fresh
        blocks (held; the engine takes them as imported). The lead holds those blocks until the request
        ends. What cannot be read is computed (the group starts after the shortest run)."""
        want = job.lead_cached[len(job.local):]
        if not want or job.lead_endpoint is None:
            return []
        fresh = await self.engine.call(self.engine.block_manager.allocate, len(want))
        if fresh is None:
            metrics.deviated({"no_room": len(want)})
            return []
        w = self.worker
        ops = read_ops(w.layout, w.layout, job.lead_endpoint.address, want, fresh, job.layers)
        try:
            await w.transfer.submit(ops, timeout_s=CALL_TIMEOUT_S)
        except (TransferError, asyncio.TimeoutError) as e:
            log.warning("elastic %s: reading the lead's %d cached blocks failed (%s); computing them", job.rid,
                        len(want), e)
            await self.engine.call(self.engine.unreserve, fresh)
            metrics.deviated({"peer_read_failed": len(want)})
            return []
        metrics.PLAN_BLOCKS.labels("peer").inc(len(want))
        return fresh

    def _name_lead_blocks(self, job: StageJob, blocks: list[int], start: int) -> None:
        """An elastic stage's first input names the lead's blocks of the prompt; a helper writes its layers
        of the new tokens into them (``copy``) as it computes, so the lead can cache the prompt whole."""
        w = self.worker
        if len(blocks) != -(-len(job.prompt) // w.layout.block_size):
            raise EngineError(INVALID, f"the first input of elastic request {job.rid!r} names {len(blocks)} lead "
                                       f"blocks for a {len(job.prompt)}-token prompt")
        job.lead_blocks = list(blocks)
        if job.stage.index and job.lead_endpoint is not None:
            assert self._loop is not None
            job.copy = KVPush(w.transfer, self._loop, w.layout, w.layout, job.lead_endpoint.address, job.lead_blocks,
                              len(job.prompt), layers=job.layers, start_tokens=start)  # the lead holds [0, start)
            w.prefiller.copies[job.rid] = job.copy

    def _take_run(self, prompt: list[int]) -> list[int]:
        """Engine thread: the own cache's run of the prompt, referenced (at least one token is computed)."""
        bm = self.engine.block_manager
        local, _ = bm.match_prefix(prompt, (len(prompt) - 1) // bm.block_size)
        return local

    async def _start(self, job: StageJob, start: int) -> None:
        """The group starts at token ``start``: keep that much of the own run and add the request."""
        bs = self.worker.layout.block_size
        keep = start // bs
        job.kept = keep
        job.start_tokens = start
        extra, job.local = job.local[keep:], job.local[:keep]
        if extra:
            await self.engine.call(self.engine.unreserve, extra)
        loop = asyncio.get_running_loop()
        first = job.first

        def sink(out: Output) -> None:
            if out.finished:
                loop.call_soon_threadsafe(lambda: first.done() or first.set_result(out))

        one = dataclasses.replace(job.params, max_tokens=1, min_tokens=min(job.params.min_tokens, 1))
        # the stage that samples makes a grammar's state, off the engine thread
        constraint = await self.engine.constraint_for(job.params) if job.stage.is_last else None
        try:
            self.engine.add_request(job.prompt, one, job.rid, sink, imported_blocks=list(job.local), hold_blocks=True,
                                    stage_input=None if job.stage.is_first else job.ready, layers=job.layers,
                                    constraint=constraint)
        except RequestError as e:
            raise EngineError(INVALID, str(e)) from None
        except EngineStoppedError as e:
            raise EngineError(UNAVAILABLE, f"{self.worker.name}: {e}") from None
        job.local = []  # the engine owns them now
        job.added = True
        self.worker.prefiller.inflight += 1
        self.worker.prefiller.queued_tokens += len(job.prompt)

    async def _finish(self, job: StageJob) -> PrefillResult:
        """Until this stage computed and pushed its layers and the later stages answered."""
        assert job.first is not None and job.broken is not None
        done, _ = await asyncio.wait({job.first, job.broken}, timeout=STAGE_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if job.broken in done:
            raise job.broken.result()
        if not done:
            raise EngineError(DEADLINE, f"stage {job.stage} did not finish {job.rid} in {STAGE_TIMEOUT_S:.0f}s")
        out: Output = job.first.result()
        job.busy_s = out.compute_s
        if out.finish_reason == "abort":
            raise EngineError(CANCELLED, "prefill was aborted")
        if out.finish_reason == "error":
            raise EngineError(self.worker.error_kind(), f"{self.worker.name} could not prefill {job.rid}: {out.error}")
        for push in (job.push, job.copy):
            if push is None:
                continue
            try:
                await push.wait(PUSH_TIMEOUT_S)
            except (TransferError, asyncio.TimeoutError) as e:
                raise EngineError(UNAVAILABLE, f"stage {job.stage} pushing KV to {push.peer} failed: {e}") from None
        if job.sends is not None:
            await self._call_next(job, asyncio.shield(job.sends))
        self._account(job)
        if self.worker.pool is not None and not job.elastic:  # this stage's layers of the new full blocks
            self.worker.pool.write_back(job.prompt, job.push.block_table, min(job.from_pool, job.kept))
        if job.stage.is_last:
            job.completed = True
            return first_token_result(out, job.prompt, job.params, job.push)
        assert job.next_link is not None
        later = await self._call_next(job, job.next_link.stage_finish(job.rid, STAGE_TIMEOUT_S))
        job.completed = True
        bs = self.worker.layout.block_size
        later.push_bytes += job.push.bytes_sent
        later.push_s = max(later.push_s, job.push.seconds)
        if job.elastic and job.stage.is_first:  # every stage wrote its layers into the lead's blocks: whole here
            await self.engine.call(self.engine.publish_held, job.rid)
            if self.worker.pool is not None:
                self.worker.pool.write_back(job.prompt, job.push.block_table, 0)
        if job.stage.is_first:  # the group's answer: its whole time, as the conductor's cost model fits
            later.compute_s = time.monotonic() - job.opened_at
            later.cached_tokens = job.start_tokens or 0
            later.computed_tokens = len(job.prompt) - later.cached_tokens
            later.local_blocks = later.cached_tokens // bs
            if job.prepared is not None:  # what the plan's pulls brought (the group may start before them)
                later.pulled_blocks = min(job.prepared.pulled_blocks, max(0, job.kept - job.prepared.local_blocks))
                later.pulled_from = job.prepared.pulled_from if later.pulled_blocks else ""
                later.local_blocks -= later.pulled_blocks
                later.deviations = dict(job.prepared.deviations)
        return later

    def _account(self, job: StageJob) -> None:
        wall = time.monotonic() - job.opened_at
        labels = (f"{job.stage.index}/{job.stage.count}",)
        metrics.STAGE_BUSY.labels(*labels).inc(job.busy_s)
        metrics.STAGE_BUBBLE.labels(*labels).inc(max(0.0, wall - job.busy_s))

    async def _call_next(self, job: StageJob, call):
        """A call to the next stage; its failure fails this stage's request (UNAVAILABLE: retry elsewhere)."""
        try:
            return await call
        except EngineError as e:
            if e.kind in (INVALID, PRECONDITION, CANCELLED, EXHAUSTED):
                raise
            raise EngineError(UNAVAILABLE, f"the next stage failed: {e.detail or e.kind}") from None
        except TransferError as e:
            raise EngineError(UNAVAILABLE, f"sending hidden states to the next stage failed: {e}") from None

    def _send(self, job: StageJob, start: int, end: int) -> None:
        """Loop thread: write the chunk's hidden states into the next stage's inbox, then tell it; in order."""
        if job.ended.is_set() or job.next_opened is None or job.next_link is None:
            return
        prev = job.sends
        job.sends = asyncio.ensure_future(self._send_after(prev, job, start, end))
        job.sends.add_done_callback(lambda f: f.cancelled() or f.exception())  # _fail reported it

    async def _send_after(self, prev: asyncio.Future | None, job: StageJob, start: int, end: int) -> None:
        if prev is not None:
            await prev
        opened, link = job.next_opened, job.next_link
        assert opened is not None and link is not None and job.start_tokens is not None
        rb = self.row_bytes
        op = TransferOp("write", OUTBOX_REGION, job.slot * self.slot_bytes + start * rb, opened.inbox.address,
                        opened.inbox.region, opened.inbox_offset + start * rb, (end - start) * rb)
        try:
            await self.worker.transfer.submit([op])
            metrics.HIDDEN_BYTES.labels(f"{job.stage.index}/{job.stage.count}").inc(op.length)
            named = None
            if job.elastic and not job.lead_named:  # the first input names the lead's blocks of the prompt
                named = job.lead_blocks if job.stage.index else list(job.push.block_table)
                job.lead_named = True
            await link.stage_input(job.rid, job.start_tokens, end, CALL_TIMEOUT_S, lead_block_ids=named)
        except (EngineError, TransferError) as e:
            err = e if isinstance(e, EngineError) and e.kind in (INVALID, CANCELLED) else \
                EngineError(UNAVAILABLE, f"stage {job.stage} could not hand tokens {start}-{end} to the next stage: {e}")
            self._fail(job, err)
            raise err from None

    def _fail(self, job: StageJob, err: EngineError) -> None:
        if job.broken is not None and not job.broken.done():
            job.broken.set_result(err)
        if job.added:
            self.engine.abort(job.rid)

    async def _watch(self, job: StageJob) -> None:
        """Give the request up when its input stops coming (the previous stage died or forgot it)."""
        while not job.ended.is_set():
            await asyncio.sleep(min(1.0, INPUT_IDLE_S / 4))
            waiting = job.first is None or not job.first.done()
            if waiting and job.ready < len(job.prompt) and time.monotonic() - job.last_input > INPUT_IDLE_S:
                log.warning("stage %s: no input for %s in %.0fs; giving it up", self.stage, job.rid, INPUT_IDLE_S)
                self._fail(job, EngineError(UNAVAILABLE, f"the previous stage sent nothing for {INPUT_IDLE_S:.0f}s"))
                await self._end(job)
                return
            if not waiting and time.monotonic() - job.last_input > FINISH_WAIT_S:
                await self._end(job)  # nobody asked for the result
                return

    async def _end(self, job: StageJob) -> None:
        """Once: stop the pushes, abort the later stages if unfinished, give back blocks and the slot.

        A second caller (an abort while the cancelled head is ending the job) returns only once the
        first has finished: its answer tells the conductor the decode's blocks are safe to free."""
        if job.ended.is_set():
            try:
                await asyncio.wait_for(job.closed.wait(), END_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("stage %s: %s still ending after %.0fs", self.stage, job.rid, END_WAIT_S)
            return
        if self.jobs.get(job.rid) is not job:
            return
        job.ended.set()
        w = self.worker
        if job.keeper is not None:
            job.keeper.cancel()
        try:
            if job.added and job.first is not None and not job.first.done():
                self.engine.abort(job.rid)
            for push in (job.push, job.copy):
                if push is not None and not await push.stop(PUSH_TIMEOUT_S):
                    log.warning("KV pushes of %s to %s did not end within %.0fs", job.rid, push.peer, PUSH_TIMEOUT_S)
            if job.sends is not None and not job.sends.done():
                job.sends.cancel()
            if job.next_link is not None and not job.completed:
                # the later stages write the decode's blocks too: this request ends once they stopped
                await self._abort_next(job)
            if job.local:
                await self.engine.call(self.engine.unreserve, job.local)
                job.local = []
            if job.added:
                await self.engine.call(self.engine.release, job.rid)
                w.prefiller.inflight -= 1
                w.prefiller.queued_tokens -= len(job.prompt)
        finally:
            w.prefiller.pushes.pop(job.rid, None)
            w.prefiller.copies.pop(job.rid, None)
            self.jobs.pop(job.rid, None)
            self.free_slots.append(job.slot)
            job.closed.set()

    async def _abort_next(self, job: StageJob) -> None:
        assert job.next_link is not None
        try:
            result = await job.next_link.abort(job.rid, CALL_TIMEOUT_S)
            if not result.ended:
                log.warning("the next stage's pushes of %s had not stopped when its abort answered", job.rid)
        except EngineError as e:
            log.info("could not abort %s on the next stage (%s); it gives the request up itself", job.rid, e)

    def _endpoint(self) -> TransferEndpoint:
        ep = self.worker.endpoint()
        info = self.worker.transfer.info().regions.get(INBOX_REGION)
        return dataclasses.replace(ep, region=INBOX_REGION, shm_name=(info.shm_name or "") if info else "")
