"""One engine instance's request logic, prefill or decode, with no transport.

A ``Worker`` owns what every call shares: the engine, the transfer endpoint, the draining flag,
the aborted ids, and its three parts: ``Decoder`` (reserve, renew, decode), ``Prefiller``
(execute the plan, compute, push KV) and ``Lender`` (lend cached blocks to a peer). Calls take
and return the plain dataclasses of ``conductor/engine_link.py`` and raise ``EngineError``;
``roles/worker.py`` serves them over gRPC (proto <-> dataclass, error kind -> status) and
``local_link.LocalEngineLink`` calls them in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from mooncaked.conductor.engine_link import (DEAD, DRAINING, ELASTIC_ALONE, EXHAUSTED, INTERNAL, PRECONDITION,
                                             SERVING, UNAVAILABLE, AbortResult, EngineError, EngineLink, Loan,
                                             PrefillPlan, PrefillResult, Reservation, StageOpen, StageOpened,
                                             TokenChunk, TransferEndpoint)
from mooncaked.engine import Engine, EngineStats, SamplingParams
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.instance import metrics
from mooncaked.instance.decode import RESERVATION_TTL_S, Decoder
from mooncaked.instance.kv_push import KV_REGION
from mooncaked.instance.lending import Lender
from mooncaked.instance.pipeline import Pipeline
from mooncaked.instance.pool_cache import PoolCache
from mooncaked.instance.prefill import Prefiller
from mooncaked.instance.write_fence import WriteFence
from mooncaked.transfer import TransferEngine

log = logging.getLogger(__name__)

# Abort on a prefill instance answers once the request's KV pushes have stopped, or after this long
ABORT_WAIT_S = 10.0
# an elastic prefill that failed so (a helper busy, draining, unreachable or dead) is computed alone instead
HELPER_FAILED = (UNAVAILABLE, EXHAUSTED, PRECONDITION)
# ids of aborted requests remembered, so a Reserve or Prefill that arrives after its Abort is refused
ABORTED_REMEMBERED = 4096

Peers = Callable[[str], EngineLink | None]
"""An engine's address -> a link to it: how a prefill reaches the peer its plan pulls from."""


class Worker:
    def __init__(self, name: str, role: str, engine: Engine, transfer: TransferEngine, model_id: str, *,
                 kv_push: str = "layerwise", pool: PoolCache | None = None, peers: Peers | None = None,
                 reservation_ttl_s: float = RESERVATION_TTL_S) -> None:
        self.name = name
        self.role = role  # "prefill" | "decode"
        self.engine = engine
        self.transfer = transfer
        self.model_id = model_id
        self.layout: KVLayout = engine.runner.kv.layout()
        self.pool = pool  # set once the instance joined the KV pool (None: no pool)
        self.peers = peers
        self.started = time.monotonic()
        self.draining = False
        self.drain_seq = 0  # Drain calls taken: heartbeats carry it, so a stale one cannot undo a later drain
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.decoder = Decoder(self, reservation_ttl_s)
        self.prefiller = Prefiller(self, layerwise=kv_push == "layerwise")
        self.lender = Lender(self)
        engine.layer_hook = self.prefiller.on_layer
        # one stage of a static chunked-pipeline prefill group, or a whole-model prefill instance that leads
        # or helps elastic groups per request (instance/pipeline.py); None on a decode instance
        self.pipeline = Pipeline(self) if engine.stage.count > 1 or role == "prefill" else None

    # -- shared state -----------------------------------------------------------------------
    def check(self, role: str) -> None:
        """Refuse new work of ``role`` unless this instance plays it, serves and has a live engine."""
        if self.role != role:
            raise EngineError(PRECONDITION, f"{self.name} is a {self.role} instance; this call needs a {role} "
                                            "instance")
        if self.engine.driver_failure is not None:
            raise EngineError(UNAVAILABLE, f"{self.name}'s engine stopped ({self.engine.driver_failure!r}); it is "
                                           "restarting")
        if self.draining:
            raise EngineError(UNAVAILABLE, f"{self.name} is draining and takes no new work")

    def error_kind(self) -> str:
        """A request that failed alone (its logits were NaN, its step raised) is INTERNAL: the engine
        serves on and a retry would fail alike. One failed by a dead engine is UNAVAILABLE: the
        conductor marks us dead and tries another instance."""
        return UNAVAILABLE if self.engine.driver_failure is not None else INTERNAL

    def endpoint(self) -> TransferEndpoint:
        """Where peers reach our KV region on the data plane."""
        info = self.transfer.info()
        region = info.regions.get(KV_REGION)
        return TransferEndpoint(address=self.transfer.address or "", backend=self.transfer.backend,
                                region=KV_REGION, same_host_id=info.host_id,
                                shm_name=(region.shm_name or "") if region else "")

    def fence(self, request_id: str, target: Reservation) -> WriteFence:
        """The write fence on ``target``, renewed through the decode's Engine (none without its address)."""
        link = self.peers(target.engine_address) if self.peers is not None and target.engine_address else None
        return WriteFence(link, request_id, target.ttl_s)

    def was_aborted(self, request_id: str) -> bool:
        return request_id in self.aborted

    def _remember_abort(self, request_id: str) -> None:
        self.aborted[request_id] = None
        self.aborted.move_to_end(request_id)
        while len(self.aborted) > ABORTED_REMEMBERED:
            self.aborted.popitem(last=False)

    def idle(self) -> bool:
        p = self.prefiller
        return (not self.decoder.reserved and not p.pushes and not self.lender.loans
                and p.inflight == 0 and self.decoder.inflight == 0 and not self.engine.has_work())

    def state(self) -> str:
        """What heartbeats report: DEAD once the engine's driver died (the conductor stops routing here)."""
        if self.engine.driver_failure is not None:
            return DEAD
        return DRAINING if self.draining else SERVING

    def load(self) -> tuple[EngineStats, int]:
        """The engine's counters and the prompt tokens waiting to be prefilled here."""
        return self.engine.stats(), self.prefiller.queued_tokens

    async def expire_forever(self) -> None:
        """Give back reservations nobody renews and loans nobody released."""
        while True:
            await asyncio.sleep(min(5.0, self.decoder.ttl_s / 4))
            now = time.monotonic()
            await self.decoder.expire(now)
            await self.lender.expire(now)

    # -- calls --------------------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> Reservation:
        return await self.decoder.reserve(request_id, prompt, params)

    def renew(self, request_id: str) -> float | None:
        return self.decoder.renew(request_id)

    def decode(self, request_id: str, first: PrefillResult) -> AsyncIterator[TokenChunk]:
        return self.decoder.decode(request_id, first)

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, target: Reservation,
                      plan: PrefillPlan | None = None, stages: list[str] | None = None) -> PrefillResult:
        """``stages``: on the first stage of a CPP group, the later stages' Engine addresses in order."""
        helpers = list(plan.helpers) if plan is not None else []
        if self.pipeline is not None and not self.pipeline.elastic:
            self.check("prefill")
            return await self.pipeline.head(request_id, prompt, params, target, list(stages or []))
        if stages:
            raise EngineError(PRECONDITION, f"{self.name} is not a pipeline stage; it prefills alone")
        if helpers:  # an elastic group: the conductor lent these idle instances to this prompt
            if self.pipeline is None:
                raise EngineError(PRECONDITION, f"{self.name} is a {self.role} instance; it leads no prefill")
            self.check("prefill")
            try:
                return await self.pipeline.head(request_id, prompt, params, target, helpers, plan)
            except EngineError as e:
                if e.kind not in HELPER_FAILED or self.was_aborted(request_id):
                    raise
                # a helper was busy, draining or failed: the pipeline has ended on every stage (no push in
                # flight), so this instance computes the prompt alone, as the plan would have without helpers
                log.warning("%s: the elastic prefill of %s failed (%s); computing it alone", self.name,
                            request_id, e)
                result = await self.prefiller.prefill(request_id, prompt, params, target, plan)
                result.deviations[ELASTIC_ALONE] = -(-len(prompt) // self.layout.block_size)
                metrics.deviated({ELASTIC_ALONE: result.deviations[ELASTIC_ALONE]})
                return result
        return await self.prefiller.prefill(request_id, prompt, params, target, plan)

    def _stage(self) -> Pipeline:
        if self.pipeline is None or (not self.pipeline.elastic and self.pipeline.stage.is_first):
            raise EngineError(PRECONDITION, f"{self.name} is not a later stage of a pipeline group")
        return self.pipeline

    async def stage_open(self, opening: StageOpen) -> StageOpened:
        return await self._stage().open(opening)

    async def stage_input(self, request_id: str, start_tokens: int, ready_tokens: int,
                          lead_block_ids: list[int] | None = None) -> None:
        await self._stage().input(request_id, start_tokens, ready_tokens, lead_block_ids)

    async def stage_finish(self, request_id: str) -> PrefillResult:
        return await self._stage().finish(request_id)

    async def lend(self, block_hashes: list[int], lease_s: float, borrower: str = "") -> Loan:
        return await self.lender.lend(block_hashes, lease_s, borrower)

    async def release(self, loan_id: str) -> bool:
        return await self.lender.release(loan_id)

    async def abort(self, request_id: str) -> AbortResult:
        """Stop a request wherever it is. The id is remembered, so a reserve or prefill that arrives
        after its abort (a cancelled call still in flight) is refused. On a prefill instance the answer
        waits until the request's KV pushes have stopped (``ended``): only then may the conductor free
        the decode blocks they write."""
        self._remember_abort(request_id)
        if await self.decoder.unreserve(request_id):
            return AbortResult(found=True, ended=True)
        if self.pipeline is not None and await self.pipeline.abort(request_id):
            return AbortResult(found=True, ended=True)
        self.engine.abort(request_id)
        ended = self.prefiller.ended.get(request_id)
        if ended is None:
            return AbortResult(found=False, ended=True)
        try:
            await asyncio.wait_for(ended.wait(), ABORT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("prefill %s still pushing %.0fs after its abort", request_id, ABORT_WAIT_S)
        return AbortResult(found=True, ended=ended.is_set())

    def drain(self, drain: bool) -> tuple[str, int]:
        """Stop (or resume) taking new work: the state after it, and this call's number (``drain_seq``)."""
        self.draining = drain
        self.drain_seq += 1
        log.info("%s %s", self.name, "draining" if drain else "serving again")
        return self.state(), self.drain_seq

    def cached_prefix(self, block_hashes: list[int]) -> int:
        return self.engine.block_manager.cached_prefix_len(block_hashes)
