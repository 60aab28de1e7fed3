"""``EngineLink`` to a ``Worker`` in this process: the conductor's core without gRPC.

Every call is the worker's own, under the call's deadline (DEADLINE when it passes, which
cancels the call as a gRPC deadline would). KV still moves over the workers' real transfer
engines, so request-path tests exercise the same pushes, pulls and loans as processes do.
``LocalFabric`` names the links by address, as the registry and a plan's ``pull_address`` do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from mooncaked.conductor.engine_link import (DEADLINE, AbortResult, EngineError, EngineLink, Loan, PrefillPlan,
                                             PrefillResult, Reservation, StageOpen, StageOpened, TokenChunk)
from mooncaked.engine import SamplingParams
from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _within(call: Awaitable[T], timeout_s: float, what: str) -> T:
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise EngineError(DEADLINE, f"{what} took longer than {timeout_s:g}s") from None


class LocalEngineLink(EngineLink):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      timeout_s: float) -> Reservation:
        return await _within(self.worker.reserve(request_id, list(prompt_token_ids), sampling), timeout_s, "reserve")

    async def renew(self, request_id: str, timeout_s: float) -> float | None:
        return self.worker.renew(request_id)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      target: Reservation, timeout_s: float, plan: PrefillPlan | None = None,
                      stages: list[str] | None = None) -> PrefillResult:
        return await _within(self.worker.prefill(request_id, list(prompt_token_ids), sampling, target, plan, stages),
                             timeout_s, "prefill")

    async def stage_open(self, opening: StageOpen, timeout_s: float) -> StageOpened:
        return await _within(self.worker.stage_open(opening), timeout_s, "stage_open")

    async def stage_input(self, request_id: str, start_tokens: int, ready_tokens: int, timeout_s: float,
                          lead_block_ids: list[int] | None = None) -> None:
        await _within(self.worker.stage_input(request_id, start_tokens, ready_tokens, lead_block_ids), timeout_s,
                      "stage_input")

    async def stage_finish(self, request_id: str, timeout_s: float) -> PrefillResult:
        return await _within(self.worker.stage_finish(request_id), timeout_s, "stage_finish")

    async def decode(self, request_id: str, first: PrefillResult, timeout_s: float) -> AsyncIterator[TokenChunk]:
        # closing this iterator closes the worker's stream, which stops the request and frees its blocks
        async with contextlib.aclosing(self.worker.decode(request_id, first)) as stream:
            async for chunk in stream:
                yield chunk

    async def abort(self, request_id: str, timeout_s: float) -> AbortResult:
        return await _within(self.worker.abort(request_id), timeout_s, "abort")

    async def lend(self, block_hashes: list[int], lease_s: float, timeout_s: float, borrower: str = "") -> Loan:
        return await _within(self.worker.lend(list(block_hashes), lease_s, borrower), timeout_s, "lend")

    async def release(self, loan_id: str, timeout_s: float) -> bool:
        return await _within(self.worker.release(loan_id), timeout_s, "release")

    async def drain(self, drain: bool, timeout_s: float) -> tuple[str, int]:
        return self.worker.drain(drain)

    async def close(self, grace_s: float = 0.0) -> None:
        pass


class LocalFabric(dict[str, EngineLink]):
    """Links to the workers of this process by address: a worker's ``peers`` (``fabric.get``) and the
    conductor's ``connect`` (``fabric.connect``) both look here."""

    def connect(self, name: str, address: str) -> EngineLink:
        return self[address]
