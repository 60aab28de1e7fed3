"""The conductor's request path, without gRPC (Mooncake §3, DESIGN §3): tokenize, hash, pick P
and D, reserve on D, prefill on P (which writes the KV into D's blocks), then relay D's tokens.

``Conductor.generate(spec)`` is what both fronts call — gRPC ``Generate`` (roles/conductor.py)
and the HTTP API (http_api.py) — so they route, reject and measure alike. It takes and yields
plain dataclasses, raises the typed errors of ``errors.py`` (each front maps them in its one
table), and reaches engines only through their ``EngineLink`` (engine_link.py). Closing the
iterator early (a client that left) cancels the request: its decode stream ends, which frees
the decode's blocks. Reserving and prefilling, with retries and waits, is ``placement.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from mooncaked.conductor import metrics
from mooncaked.conductor.engine_link import CANCELLED, NOT_FOUND, UNAVAILABLE, EngineError
from mooncaked.conductor.errors import BadRequest, ConductorError, PeerFailed, metric_reason, too_long
from mooncaked.conductor.membership import Membership
from mooncaked.conductor.placement import Placement
from mooncaked.conductor.prompt_tokenizer import PromptTokenizer, TextTooLong
from mooncaked.conductor.registry import Connect
from mooncaked.conductor.router import SchedulerState
from mooncaked.conductor.waiting import Deadline
from mooncaked.engine import SamplingParams
from mooncaked.engine.config import ModelConfig
from mooncaked.engine.outputs import TopLogprobs
from mooncaked.engine.tokenizer import Tokenizer
from mooncaked.hashing import block_hashes

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
DECODE_TIMEOUT_S = 3600.0
# a decode stream that fails with these before its first chunk lost its decode instance (died, restarted,
# or its reservation is gone): the request is prefilled again rather than failed
DECODE_LOST = {UNAVAILABLE, CANCELLED, NOT_FOUND}
DEFAULT_MAX_TOKENS = 256


@dataclass
class GenerateSpec:
    """One client request. Exactly one of ``token_ids``, ``messages`` (chat turns, rendered through
    the model's chat template) or ``prompt`` (text; chat-templated unless ``raw``)."""

    request_id: str = ""  # empty: the conductor picks one
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    raw: bool = False
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))
    timeout_s: float | None = None  # the client's deadline, seconds from arrival (None: it set none)
    front: str = "grpc"  # which front it came through (metrics)


@dataclass
class Chunk:
    """Tokens since the last chunk; the first also says where the request ran and what it cost."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # the first chunk only
    request_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_instance: str = ""
    decode_instance: str = ""
    # with sampling.prompt_logprobs: the prompt's tokens; entry i of prompt_logprobs is token i + 1's
    # log-prob (the first has none), and of prompt_top_logprobs the most likely tokens there
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)

    @classmethod
    def join(cls, chunks: Sequence["Chunk"]) -> "Chunk":
        """A whole stream as one chunk: tokens, text and log-probs joined, the last finish reason, the
        prompt's log-probs (the first chunk's)."""
        joined = cls([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                     chunks[-1].finish_reason if chunks else "", [v for c in chunks for v in c.logprobs],
                     [t for c in chunks for t in c.top_logprobs])
        if chunks:
            first = chunks[0]
            joined.prompt_token_ids, joined.prompt_logprobs = first.prompt_token_ids, first.prompt_logprobs
            joined.prompt_top_logprobs = first.prompt_top_logprobs
        return joined


class Conductor(Membership):
    """Membership (registry, prefix index, scheduler, readiness) plus the request path."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, model_id: str, block_size: int,
                 hash_seed: int, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 connect: Connect | None = None, scheduler: SchedulerState | None = None,
                 ready_timeout_s: float = 0.0, prompts: PromptTokenizer | None = None) -> None:
        super().__init__(model_id, block_size, heartbeat_interval_s, heartbeat_timeout_s, connect, scheduler,
                         ready_timeout_s)
        self.tokenizer = tokenizer
        # prompts are tokenized off the event loop, long ones refused first (prompt_tokenizer.py)
        self.prompts = prompts or PromptTokenizer(tokenizer, model_config.max_position_embeddings)
        self.model_config = model_config
        self.hash_seed = hash_seed
        self.placement = Placement(self.registry, self.index, self.scheduler, self.gate, heartbeat_interval_s,
                                   MAX_ATTEMPTS, sees_pool=lambda: self.watches_pool)

    async def tokenize(self, spec: GenerateSpec) -> list[int]:
        """The request's prompt as token ids. Text is rendered and tokenized in a thread pool, after
        a check that its characters can fit the context at all; ids are counted before looked at."""
        limit = self.model_config.max_position_embeddings
        try:
            if spec.token_ids is not None:
                if len(spec.token_ids) >= limit:
                    raise too_long(len(spec.token_ids), limit)
                ids = list(spec.token_ids)
                vocab = self.model_config.vocab_size
                if any(t >= vocab or t < 0 for t in ids):
                    raise BadRequest(f"token ids must be below the vocabulary size {vocab}")
            elif spec.messages is not None:
                if not spec.messages:
                    raise BadRequest("messages is empty")
                ids = await self.prompts.encode_chat(spec.messages)
            elif spec.prompt is not None:
                if not spec.prompt:
                    raise BadRequest("the prompt is empty")
                ids = await (self.prompts.encode(spec.prompt) if spec.raw
                             else self.prompts.encode_chat([{"role": "user", "content": spec.prompt}]))
            else:
                raise BadRequest("give a prompt, token_ids or messages")
        except ValueError as e:  # the engine's RequestError: a prompt it cannot take
            raise BadRequest(str(e), "context_length_exceeded" if isinstance(e, TextTooLong) else None) from None
        if not ids:
            raise BadRequest("the prompt is empty")
        if len(ids) >= limit:
            raise too_long(len(ids), limit)
        return ids

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        """Serve one request: its chunks, as the decode instance streams them. Raises a
        ``ConductorError`` (before the first chunk, or mid-stream when its decode fails)."""
        timer = metrics.StreamTimer(spec.front)
        outcome, refused = "error", False
        rid = spec.request_id or uuid.uuid4().hex
        try:
            try:
                ids = await self.tokenize(spec)
                params = dataclasses.replace(spec.sampling)  # our own copy: max_tokens is cut to the context
                if len(ids) + params.max_tokens > self.model_config.max_position_embeddings:
                    params.max_tokens = self.model_config.max_position_embeddings - len(ids)
                    params.min_tokens = min(params.min_tokens, params.max_tokens)
                # closed with this generator: a client that leaves ends the decode stream at once
                async with contextlib.aclosing(self._serve(rid, ids, params, Deadline.within(spec.timeout_s),
                                                           timer)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except ConductorError as e:
                if timer.first_at is None:  # refused before any token: counted as a rejection, by reason
                    metrics.rejected(metric_reason(e))
                    refused = True
                raise
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.scheduler.finished(rid)  # however the request ended, the ledgers forget it
            timer.done("rejected" if refused else outcome)

    async def _serve(self, rid: str, ids: list[int], params: SamplingParams, deadline: Deadline,
                     timer: metrics.StreamTimer) -> AsyncIterator[Chunk]:
        hashes = block_hashes(ids, self.block_size, self.hash_seed)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            prefill, lease, result = await self.placement.place(rid, ids, params, hashes, deadline)
            decode = lease.decode
            stream = decode.link.decode(lease.request_id, result, DECODE_TIMEOUT_S)
            lease.stop()  # the decode takes the reservation over
            first = True
            lost: EngineError | None = None
            decode.inflight += 1
            try:
                async for c in stream:
                    out = Chunk(c.token_ids, c.text, c.finish_reason, c.logprobs, c.top_logprobs)
                    if first:
                        out.request_id, out.prompt_tokens, out.cached_tokens = rid, len(ids), result.cached_tokens
                        out.prefill_instance, out.decode_instance = prefill.name, decode.name
                        if params.scored:
                            out.prompt_token_ids = ids
                            out.prompt_logprobs, out.prompt_top_logprobs = (result.prompt_logprobs,
                                                                            result.prompt_top_logprobs)
                        first = False
                    timer.chunk(len(c.token_ids), out.prompt_tokens, out.cached_tokens)
                    self.scheduler.tokens(rid, len(c.token_ids))
                    yield out
            except EngineError as e:
                if e.kind == UNAVAILABLE:
                    self.registry.mark_lost(decode, f"stream broke: {e.detail}")
                if first and e.kind in DECODE_LOST and attempt < MAX_ATTEMPTS and deadline.left() > 0:
                    lost = e  # nothing reached the client yet: prefill again, on whichever decode serves
                else:
                    when = "before its first token" if first else "mid-stream"
                    raise PeerFailed(f"decode instance {decode.name} failed {when}: {e.detail}", decode.name,
                                     e.kind) from None
            finally:
                decode.inflight -= 1
                self.scheduler.finished(rid)
                closing = getattr(stream, "aclose", None)
                if closing is not None:
                    await closing()  # a client that went away ends the decode stream, which frees D's blocks
                self.registry.changes.notify()  # D has room again: requests waiting for it try now
            if lost is None:
                return
            log.warning("decode instance %s lost %s before its first token (%s: %s); prefilling it again",
                        decode.name, rid, lost.kind, lost.detail)
