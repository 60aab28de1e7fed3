"""Our ``GenerateChunk``s -> OpenAI response bodies: completions and chat, whole and streamed,
one or many choices, log-probs in OpenAI's shapes.

Log-probs are the engine's (the raw model distribution: see mooncaked/engine/sampler.py).
A token's text is the token decoded alone with special tokens kept, and ``bytes`` its UTF-8
encoding, as vLLM reports them; ``text_offset`` adds up those texts' lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.conductor.openai_schema import OpenAIRequest
from mooncaked.conductor.tool_calls import calls_in
from mooncaked.proto.mooncake.v1 import conductor_pb2

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM answers this instead


def batch_usage(firsts: Sequence[conductor_pb2.GenerateChunk], n: int, completion_tokens: int) -> dict[str, Any]:
    """A request's usage from its choices' first chunks (``firsts[k * n]``: prompt k's first choice): each
    prompt of a batch counted once, however many choices it has."""
    prompts = firsts[::n]
    return usage(sum(f.prompt_tokens for f in prompts), completion_tokens, sum(f.cached_tokens for f in prompts))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def merge_chunks(chunks: Sequence[conductor_pb2.GenerateChunk]) -> conductor_pb2.GenerateChunk:
    """A whole choice as one chunk (tokens, text, log-probs joined; the last finish reason)."""
    out = conductor_pb2.GenerateChunk()
    for c in chunks:
        out.token_ids.extend(c.token_ids)
        out.logprobs.extend(c.logprobs)
        out.top_logprobs.extend(c.top_logprobs)
    out.text = "".join(c.text for c in chunks)
    out.finish_reason = chunks[-1].finish_reason if chunks else ""
    return out


def _lp(v: float) -> float:
    return v if math.isfinite(v) and v > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Each token id's text as log-probs show it; cached (at most the vocabulary's size)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text


@dataclass
class _Choice:
    """Where one choice's stream stands."""

    started: bool = False
    text_offset: int = 0


class Responder:
    """Builds the bodies of one request's answer (``rid``: the first choice's request id)."""

    def __init__(self, spec: OpenAIRequest, rid: str, texts: TokenTexts, prompt_texts: Sequence[str] = ()) -> None:
        self.spec = spec
        self.rid = rid
        self.texts = texts
        self.prompt_texts = prompt_texts  # completions with echo: each prompt's text, choice k * n + i's is k's
        self.choices = [_Choice() for _ in range(len(spec.prompts) * spec.n)]
        self.prefix, self.obj, self.chunk_obj = (("chatcmpl", "chat.completion", "chat.completion.chunk") if spec.chat
                                                 else ("cmpl", "text_completion", "text_completion"))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": f"{self.prefix}-{self.rid}", "object": obj, "created": self.spec.created,
                "model": self.spec.model}

    # -- whole answers --------------------------------------------------------------------------
    def response(self, choices: Sequence[conductor_pb2.GenerateChunk], use: dict) -> dict[str, Any]:
        """``choices[i]``: choice i's chunks merged (``merge_chunks``)."""
        return {**self._head(self.obj), "choices": [self._choice(i, c, None) for i, c in enumerate(choices)],
                "usage": use}

    # -- streams --------------------------------------------------------------------------------
    def chunk(self, index: int, c: conductor_pb2.GenerateChunk) -> dict[str, Any]:
        out = {**self._head(self.chunk_obj), "choices": [self._choice(index, c, self.choices[index])]}
        if self.spec.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self.chunk_obj), "choices": [], "usage": use}

    # -- one choice -----------------------------------------------------------------------------
    def _choice(self, index: int, c: conductor_pb2.GenerateChunk, state: _Choice | None) -> dict[str, Any]:
        """A whole choice (``state`` None) or the next piece of a streamed one."""
        first = state is None or not state.started
        if state is not None:
            state.started = True
        if self.spec.score_only:  # max_tokens 0: the one token generated is not shown
            c = dataclasses.replace(c, token_ids=[], text="", logprobs=[], top_logprobs=[],
                                    finish_reason="length" if c.finish_reason else "")
        logprobs = None
        if self.spec.logprobs is not None:
            logprobs = (self._chat_logprobs(c) if self.spec.chat
                        else self._completion_logprobs(c, state or _Choice(), first and self.spec.echo))
        finish = c.finish_reason or None
        if self.spec.chat:
            if state is None:
                message, finish = self._message(c, finish)
                return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            delta: dict[str, Any] = {"role": "assistant", "content": c.text} if first else {"content": c.text}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        text = self.prompt_texts[index // self.spec.n] + c.text if self.spec.echo and first else c.text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _message(self, c: conductor_pb2.GenerateChunk, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole chat answer: its text, or with tools offered the call it made (conductor/tool_calls.py)."""
        calls = calls_in(c.text, self.spec.tools) if self.spec.tools is not None else None
        if calls is None:
            return {"role": "assistant", "content": c.text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def whole_chunks(self, index: int, c: conductor_pb2.GenerateChunk) -> list[dict[str, Any]]:
        """A whole chat answer as a stream's chunks: with tools offered an answer is streamed only once it
        is known to be a call or text, as one delta and then its finish reason."""
        message, finish = self._message(c, c.finish_reason or None)
        delta = dict(message)
        if "tool_calls" in delta:
            delta.pop("content")
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta["tool_calls"])]
        logprobs = self._chat_logprobs(c) if self.spec.logprobs is not None else None
        out = []
        for choice in ({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None},
                       {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}):
            chunk = {**self._head(self.chunk_obj), "choices": [choice]}
            if self.spec.include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def _completion_logprobs(self, c: conductor_pb2.GenerateChunk, state: _Choice, echo: bool) -> dict[str, Any]:
        """``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``; each
        position's dict holds the top ``logprobs`` tokens and always the sampled one. ``echo``: the
        prompt's tokens first, the first with null log-probs (nothing comes before it), as OpenAI's."""
        tokens, offsets, tops = [], [], []
        token_logprobs: list[float | None] = []
        if echo:
            for i, token_id in enumerate(c.prompt_token_ids):
                text = self.texts(token_id)
                tokens.append(text)
                offsets.append(state.text_offset)
                state.text_offset += len(text)
                if i == 0 or i > len(c.prompt_logprobs):
                    token_logprobs.append(None)
                    tops.append(None)
                    continue
                lp = _lp(c.prompt_logprobs[i - 1])
                token_logprobs.append(lp)
                alt: dict[str, float] = {}
                if i <= len(c.prompt_top_logprobs):
                    for t, v in zip(c.prompt_top_logprobs[i - 1].token_ids, c.prompt_top_logprobs[i - 1].logprobs):
                        alt.setdefault(self.texts(t), _lp(v))
                alt.setdefault(text, lp)
                tops.append(alt)
        for i, token_id in enumerate(c.token_ids):
            text = self.texts(token_id)
            tokens.append(text)
            offsets.append(state.text_offset)
            state.text_offset += len(text)
            top: dict[str, float] = {}
            if i < len(c.top_logprobs):
                for t, lp in zip(c.top_logprobs[i].token_ids, c.top_logprobs[i].logprobs):
                    top.setdefault(self.texts(t), _lp(lp))
            if i < len(c.logprobs):
                top.setdefault(text, _lp(c.logprobs[i]))
            tops.append(top)
        token_logprobs += [_lp(v) for v in c.logprobs]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, c: conductor_pb2.GenerateChunk) -> dict[str, Any]:
        """``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
        content = []
        for i, token_id in enumerate(c.token_ids):
            entry = self._entry(token_id, c.logprobs[i] if i < len(c.logprobs) else LOGPROB_FLOOR)
            top = c.top_logprobs[i] if i < len(c.top_logprobs) else None
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in zip(top.token_ids, top.logprobs)] if top else []
            content.append(entry)
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.texts(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}
