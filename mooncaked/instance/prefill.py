"""A prefill instance's request: compute the prompt, push its KV into the decode's blocks.

Before computing, the plan is executed (``prefix_fetch.py``: own cache, pool, a peer's KV
cache). The engine then computes the rest; after each layer wrote its K/V the new token range
goes to the decode instance's reserved blocks (``kv_push.py``), so the bytes move while the
next layer computes. The answer (the first token, what was reused, pulled and computed) comes
once every byte has landed; then the new full blocks go to the pool in the background, a
replicated hot prefix with a soft pin. Failures are ``EngineError``s whose kind says who is at
fault (ABORTED: the decode side; UNAVAILABLE: this engine stopped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from mooncaked.conductor.engine_link import (ABORTED, CANCELLED, DEADLINE, INVALID, POOL, PRECONDITION, UNAVAILABLE,
                                             EngineError, PrefillPlan, PrefillResult, Reservation)
from mooncaked.engine import Output, RequestError, SamplingParams
from mooncaked.engine.llm_engine import EngineStoppedError
from mooncaked.engine.step_records import StepSeq
from mooncaked.instance import metrics
from mooncaked.instance.kv_push import KVPush
from mooncaked.instance.prefix_fetch import Prepared, PrefixFetch
from mooncaked.tasks import spawn
from mooncaked.transfer import TransferError

if TYPE_CHECKING:
    from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 600.0
PUSH_TIMEOUT_S = 60.0


class Prefiller:
    def __init__(self, worker: Worker, layerwise: bool = True) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.layerwise = layerwise  # False: push everything once the prompt is done (the baseline)
        self.fetch = PrefixFetch(worker)
        self.pushes: dict[str, KVPush] = {}
        self.copies: dict[str, KVPush] = {}  # elastic CPP helpers: their layers of the prompt, into the lead's blocks
        self.ended: dict[str, asyncio.Event] = {}  # set once a prefill's pushes have stopped
        self.queued_tokens = 0
        self.inflight = 0

    def on_layer(self, layer: int, seqs: list[StepSeq]) -> None:
        """Engine thread, after a layer wrote its KV for the step."""
        for s in seqs:
            push = self.pushes.get(s.request_id)
            if push is not None:
                push.on_layer(layer, s)
            copy = self.copies.get(s.request_id)
            if copy is not None:
                copy.on_layer(layer, s)

    def _check(self, rid: str, prompt: list[int], params: SamplingParams, target: Reservation) -> None:
        w = self.worker
        why = w.layout.compatible(target.layout)
        if why:
            raise EngineError(PRECONDITION, f"decode KV layout does not match: {why}")
        if len(target.block_ids) != -(-len(prompt) // w.layout.block_size):
            raise EngineError(INVALID, f"{len(target.block_ids)} decode blocks for {len(prompt)} prompt tokens")
        if not rid or rid in self.pushes:
            raise EngineError(INVALID, "request_id must be non-empty and unused")
        try:
            params.validate()
        except RequestError as e:
            raise EngineError(INVALID, str(e)) from None

    async def prefill(self, rid: str, prompt: list[int], params: SamplingParams, target: Reservation,
                      plan: PrefillPlan | None = None) -> PrefillResult:
        w = self.worker
        w.check("prefill")
        self._check(rid, prompt, params, target)
        loop = asyncio.get_running_loop()
        constraint = await self.engine.constraint_for(params)  # a grammar's state, made off the engine thread
        fence = self.worker.fence(rid, target)
        push = KVPush(w.transfer, loop, w.layout, target.layout, target.endpoint.address, list(target.block_ids),
                      len(prompt), self.layerwise, fence=fence)
        first: asyncio.Future[Output] = loop.create_future()

        def sink(out: Output) -> None:
            if out.finished:
                loop.call_soon_threadsafe(lambda: first.done() or first.set_result(out))

        # the prefill samples only the first token; min_tokens still keeps it from being EOS
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        renewed = asyncio.ensure_future(fence.renew()) if fence.active else None
        # renewing from the start: a pull that outlasts one renewal must not close the fence
        keeper = spawn(fence.keep(), f"fence-{rid}") if fence.active else None
        try:
            prepared = await self.fetch.prepare(prompt, plan, whole=params.scored)
            refused = None
            if w.was_aborted(rid):  # its Abort overtook it: no byte may go to the decode blocks it names
                refused = EngineError(CANCELLED, f"request {rid!r} was aborted")
            elif renewed is not None and not await renewed:  # the decode cannot confirm the blocks are ours
                refused = EngineError(CANCELLED if fence.gone else ABORTED, fence.why_closed())
            if refused is not None:
                await self.fetch.give_back(prepared)
                raise refused
        except BaseException:
            for task in (renewed, keeper):
                if task is not None:
                    task.cancel()
            raise
        self.pushes[rid] = push
        ended = self.ended[rid] = asyncio.Event()
        self.queued_tokens += len(prompt)
        self.inflight += 1
        added = False
        try:
            try:
                self.engine.add_request(prompt, one, rid, sink, imported_blocks=prepared.imported, hold_blocks=True,
                                        keep_imported=self._keeps_pulled(prepared, plan), constraint=constraint)
                added = True
            except RequestError as e:
                await self.fetch.give_back(prepared)
                raise EngineError(INVALID, str(e)) from None
            except EngineStoppedError as e:  # UNAVAILABLE: the conductor retries on another prefill
                raise EngineError(UNAVAILABLE, f"{w.name}: {e}") from None
            try:
                out = await asyncio.wait_for(asyncio.shield(first), PREFILL_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise EngineError(DEADLINE, f"{w.name} did not finish prefilling {rid} in "
                                            f"{PREFILL_TIMEOUT_S:.0f}s") from None
            if out.finish_reason == "abort":
                raise EngineError(CANCELLED, "prefill was aborted")
            if out.finish_reason == "error":
                raise EngineError(w.error_kind(), f"{w.name} could not prefill {rid}: {out.error}")
            try:
                await push.wait(PUSH_TIMEOUT_S)
            except (TransferError, asyncio.TimeoutError) as e:
                if push.fenced_late:  # no renewal failed: this prefill was too slow; retried elsewhere, the
                    # decode (which answered every renewal) is not blamed
                    raise EngineError(DEADLINE, f"{w.name} renewed the decode's reservation too late: {e}") from None
                # ABORTED: the decode side is at fault; the conductor picks another decode instance
                raise EngineError(ABORTED, f"pushing KV to {push.peer} failed: {e}") from None
            assert push.complete, "prefill finished without pushing every layer"
            replicated = self._write_back(prompt, push.block_table, prepared, plan)
            return self._result(out, prompt, params, push, prepared, replicated)
        finally:
            self.inflight -= 1
            self.queued_tokens -= len(prompt)
            if keeper is not None:
                keeper.cancel()
            try:
                if added and not first.done():
                    self.engine.abort(rid)  # the caller went away mid-prefill
                # no write to the decode's blocks starts or stays in flight once this call ends
                if not await push.stop(PUSH_TIMEOUT_S):
                    log.warning("KV pushes of %s to %s did not end within %.0fs; cancelled", rid, push.peer,
                                PUSH_TIMEOUT_S)
                self.pushes.pop(rid, None)
                if added:
                    await self.engine.call(self.engine.release, rid)
            finally:
                self.ended.pop(rid, None)
                ended.set()

    @staticmethod
    def _keeps_pulled(prepared: Prepared, plan: PrefillPlan | None) -> bool:
        """Whether pulled blocks join this instance's prefix cache: only when the plan replicates them (a hot
        prefix), as the simulator counts it; otherwise they serve this request and are freed with it."""
        return not prepared.pulled_blocks or plan is None or plan.replicate

    def _write_back(self, prompt: list[int], block_table: list[int], prepared: Prepared,
                    plan: PrefillPlan | None) -> bool:
        """New full blocks to the pool; a replicated (hot) prefix with a soft pin. Blocks that came from
        the pool are there; blocks pulled from a peer for a prefix that is not hot stay the holder's
        (not copied). Whether it was replicated."""
        pool = self.worker.pool
        if pool is None:
            return False
        replicate = plan is not None and plan.replicate and prepared.pulled_blocks > 0
        from_pool = prepared.pulled_from == POOL
        skip = len(prepared.imported) if from_pool or (prepared.pulled_blocks and not replicate) else 0
        pinned = len(prepared.imported) if replicate else 0
        pool.write_back(prompt, block_table, skip, pinned)
        return replicate and pinned > skip

    def _result(self, out: Output, prompt: list[int], params: SamplingParams, push: KVPush, prepared: Prepared,
                replicated: bool) -> PrefillResult:
        cached_blocks = out.num_cached_tokens // self.worker.layout.block_size
        local = cached_blocks - prepared.pulled_blocks
        if local:
            metrics.PLAN_BLOCKS.labels("local").inc(local)
        return first_token_result(out, prompt, params, push, local_blocks=local,
                                  pulled_blocks=prepared.pulled_blocks, pulled_from=prepared.pulled_from,
                                  replicated=replicated, deviations=dict(prepared.deviations))


def first_token_result(out: Output, prompt: list[int], params: SamplingParams, push: KVPush,
                       **plan_figures) -> PrefillResult:
    """The answer of the instance that sampled the first token (a prefill, or a CPP group's last stage)."""
    # the request ends here only if the first token ends it for the *real* limits
    finished = out.finish_reason == "stop" or params.max_tokens == 1
    return PrefillResult(
        first_token_id=out.token_ids[0], first_logprob=(out.logprobs or [0.0])[0],
        first_top_logprobs=out.top_logprobs[0] if out.top_logprobs else None,
        cached_tokens=out.num_cached_tokens, computed_tokens=len(prompt) - out.num_cached_tokens,
        finished=finished, finish_reason=(out.finish_reason or "") if finished else "", compute_s=out.compute_s,
        push_bytes=push.bytes_sent, push_s=push.seconds, prompt_logprobs=out.prompt_logprobs or [],
        prompt_top_logprobs=out.prompt_top_logprobs or [], **plan_figures)
