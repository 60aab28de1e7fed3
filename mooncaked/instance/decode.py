"""A decode instance's request: reserve KV blocks for a prompt, then decode it once prefilled.

``reserve`` holds blocks the prefill writes into over the transfer engine; a reservation lives
``ttl_s`` past its last reserve/renew (the conductor renews it while the prefill runs, so only a
conductor that died leaves one to expire). ``decode`` takes the request into the running batch
with the first token the prefill sampled and yields its tokens; closing the stream early stops
the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncaked.conductor.engine_link import (CANCELLED, EXHAUSTED, INVALID, NOT_FOUND, OUT_OF_RANGE, UNAVAILABLE,
                                             EngineError, PrefillResult, Reservation, TokenChunk)
from mooncaked.engine import Output, RequestError, SamplingParams
from mooncaked.engine.llm_engine import EngineStoppedError

if TYPE_CHECKING:
    from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

RESERVATION_TTL_S = 30.0


@dataclass
class Held:
    """Blocks reserved for a prompt, until Decode takes them or they expire."""

    blocks: list[int]
    prompt: list[int]
    params: SamplingParams
    expires: float


class Decoder:
    def __init__(self, worker: Worker, ttl_s: float = RESERVATION_TTL_S) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.ttl_s = ttl_s
        self.reserved: dict[str, Held] = {}
        self.inflight = 0

    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> Reservation:
        w, engine = self.worker, self.engine
        w.check("decode")
        try:
            params.validate()
            engine.tokenize(prompt)
        except RequestError as e:
            raise EngineError(INVALID, str(e)) from None
        if not rid or rid in self.reserved:
            raise EngineError(INVALID, "request_id must be non-empty and unused")
        if w.was_aborted(rid):
            raise EngineError(CANCELLED, f"request {rid!r} was aborted")
        if len(prompt) >= engine.max_model_len:
            raise EngineError(INVALID, f"prompt of {len(prompt)} tokens exceeds the context of {engine.max_model_len}")
        bm = engine.block_manager
        if bm.blocks_needed(len(prompt)) > bm.num_blocks:
            # OUT_OF_RANGE, not EXHAUSTED: waiting for room would never end
            raise EngineError(OUT_OF_RANGE, f"{w.name} can never hold {len(prompt)} tokens of KV: it has "
                                            f"{bm.num_blocks * w.layout.block_size} in all (--kv-cache-bytes)")
        blocks = await engine.call(engine.reserve, len(prompt))
        if blocks is None:
            # "no room now": the conductor waits for blocks to free and asks again
            raise EngineError(EXHAUSTED, f"{w.name} has no free KV blocks for {len(prompt)} tokens now")
        if w.was_aborted(rid) or rid in self.reserved:  # its Abort (or a twin) came while we allocated
            await engine.call(engine.unreserve, blocks)
            raise EngineError(CANCELLED, f"request {rid!r} was aborted")
        self.reserved[rid] = Held(blocks, list(prompt), params, time.monotonic() + self.ttl_s)
        return Reservation(blocks, w.endpoint(), w.layout, self.ttl_s)

    def renew(self, rid: str) -> float | None:
        """The prefill writing this reservation still runs: keep its blocks another TTL."""
        held = self.reserved.get(rid)
        if held is None:
            return None
        held.expires = time.monotonic() + self.ttl_s
        return self.ttl_s

    async def unreserve(self, rid: str) -> bool:
        held = self.reserved.pop(rid, None)
        if held is None:
            return False
        await self.engine.call(self.engine.unreserve, held.blocks)
        return True

    async def expire(self, now: float) -> None:
        """A reservation whose Decode never comes and that nobody renews (conductor died) is given back."""
        for rid, held in list(self.reserved.items()):
            if held.expires < now and self.reserved.pop(rid, None) is not None:
                await self.engine.call(self.engine.unreserve, held.blocks)
                log.warning("reservation %s expired; %d blocks freed", rid, len(held.blocks))

    async def decode(self, rid: str, first: PrefillResult) -> AsyncIterator[TokenChunk]:
        w, engine = self.worker, self.engine
        loop = asyncio.get_running_loop()
        pending = self.reserved.get(rid)
        # a grammar's state, made off the engine thread before the reservation is taken (a client gone meanwhile
        # leaves it reserved, to expire as any unclaimed one)
        constraint = await engine.constraint_for(pending.params) if pending is not None else None
        held = self.reserved.pop(rid, None)
        if held is None:
            raise EngineError(NOT_FOUND, f"no reservation for request {rid!r}")
        queue: asyncio.Queue[Output] = asyncio.Queue()
        params = held.params
        self.inflight += 1
        finished = False
        try:
            try:
                engine.add_prefilled(rid, held.prompt, first.first_token_id, held.blocks, params,
                                     lambda o: loop.call_soon_threadsafe(queue.put_nowait, o),
                                     first.first_logprob if params.logprobs else None,
                                     first.first_top_logprobs if params.top_logprobs else None, constraint)
            except RequestError as e:
                await engine.call(engine.unreserve, held.blocks)
                raise EngineError(INVALID, str(e)) from None
            except EngineStoppedError as e:
                raise EngineError(UNAVAILABLE, f"{w.name}: {e}") from None
            while not finished:
                out = await queue.get()
                finished = out.finished
                if out.finish_reason == "error":
                    raise EngineError(w.error_kind(), f"{w.name} could not decode request {rid}: {out.error}")
                n = len(out.new_token_ids)
                yield TokenChunk(list(out.new_token_ids), out.new_text,
                                 list(out.logprobs[-n:]) if out.logprobs and n else [],
                                 list(out.top_logprobs[-n:]) if out.top_logprobs and n else [],
                                 out.finish_reason or "")
        finally:
            self.inflight -= 1
            if not finished:  # the caller went away: stop and free the blocks
                engine.abort(rid)
