"""OpenAI request bodies -> our ``GenerateRequest``, and our chunks -> OpenAI response bodies.

Validation happens here, once, before anything is scheduled: every field is checked for type
and range so a bad request costs no prefill and gets a 400 that names the field. Fields we do
not implement are refused when set to a value that would change the output (a silently
ignored ``logprobs`` or penalty would return something the client did not ask for); fields
that change nothing (``user``) and unknown extras are ignored, as OpenAI clients send them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2

MAX_STOP_STRINGS = 16
_U64 = 1 << 64
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ApiError(Exception):
    """An error the HTTP front returns as an OpenAI-style body with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ServedModel:
    """What the request validation needs to know about the model behind this conductor."""

    names: tuple[str, ...]  # accepted in ``model``; the first is the canonical id
    max_context: int
    vocab_size: int


@dataclass
class GenerateSpec:
    """A validated OpenAI request: the wire request plus how to answer it."""

    model: str
    request: conductor_pb2.GenerateRequest
    chat: bool
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


# -- field checks ----------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(body: dict, name: str, lo: int, hi: int, what: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"{name} must be an integer, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise bad(f"{name} must be {what}, got {v}", name)
    return v


def _number(body: dict, name: str, lo: float, hi: float, what: str, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise bad(f"{name} must be a number, got {type(v).__name__}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"{name} must be {what}, got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {type(v).__name__}", name)
    return v


def _token_ids(v: Any, vocab: int, param: str) -> list[int]:
    if not v:
        raise bad(f"{param} is empty", param)
    if not all(_is_int(t) for t in v):
        raise bad(f"{param} must be a string or a list of integer token ids", param)
    if any(not 0 <= t < vocab for t in v):
        raise bad(f"token ids in {param} must be in [0, {vocab})", param)
    return v


def _unsupported(body: dict, allowed: dict[str, tuple]) -> None:
    """Refuse fields we do not implement unless they hold a value that changes nothing."""
    for name, harmless in allowed.items():
        if name in body and body[name] not in harmless:
            raise bad(f"{name}={body[name]!r} is not supported by this server", name, "unsupported_parameter")


def _model(body: dict, served: ServedModel) -> str:
    model = body.get("model")
    if model is None:
        raise bad("model is required", "model")
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {type(model).__name__}", "model")
    if model not in served.names:
        raise bad(f"the model {model!r} does not exist; this server serves {served.names[0]!r}", "model",
                  "model_not_found")
    return model


def _sampling(body: dict, served: ServedModel, max_tokens_default: int | None) -> common_pb2.SamplingParams:
    ctx = served.max_context
    max_tokens = _int(body, "max_completion_tokens", 1, ctx, f"between 1 and the model's context ({ctx})")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, ctx, f"between 1 and the model's context ({ctx})")
    if max_tokens is None:
        max_tokens = max_tokens_default if max_tokens_default is not None else ctx
    _int(body, "n", 1, 1, "1 (one choice per request)")
    temperature = _number(body, "temperature", 0.0, 2.0, "between 0 and 2")
    top_p = _number(body, "top_p", 0.0, 1.0, "in (0, 1]", lo_open=True)
    top_k = _int(body, "top_k", -1, 1 << 31, "-1 or 0 (off) or a positive integer")
    min_p = _number(body, "min_p", 0.0, 1.0, "between 0 and 1")
    seed = _int(body, "seed", 0, _U64 - 1, "a non-negative 64-bit integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t < served.vocab_size for t in stop_ids):
        raise bad(f"stop_token_ids must be a list of token ids in [0, {served.vocab_size})", "stop_token_ids")
    p = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
        top_k=0 if top_k in (None, -1) else top_k, min_p=min_p or 0.0, stop=stop, stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos"), skip_special_tokens=_bool(body, "skip_special_tokens", True))
    if top_p is not None:
        p.top_p = top_p
    if seed is not None:
        p.seed = seed
    return p


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    return stream, _bool(opts, "include_usage")


_COMMON_UNSUPPORTED = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
                       "logit_bias": (None, {}), "best_of": (None, 1), "tools": (None, []),
                       "response_format": (None, {"type": "text"})}


# -- requests -------------------------------------------------------------------------------------
def parse_completion(body: Any, served: ServedModel) -> GenerateSpec:
    """``/v1/completions``: plain text (no chat template) or token ids; default 16 tokens, as OpenAI."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _model(body, served)
    _unsupported(body, {**_COMMON_UNSUPPORTED, "echo": (None, False), "suffix": (None, ""),
                        "logprobs": (None, 0)})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad("batched prompts are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    req = conductor_pb2.GenerateRequest(sampling=_sampling(body, served, 16))
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
        req.prompt = prompt
        req.raw = True
    elif isinstance(prompt, list):
        req.token_ids.ids.extend(_token_ids(prompt, served.vocab_size, "prompt"))
    elif prompt is None:
        raise bad("prompt is required", "prompt")
    else:
        raise bad(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")
    stream, usage = _stream_flags(body)
    return GenerateSpec(model, req, chat=False, stream=stream, include_usage=usage)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: Any, served: ServedModel) -> GenerateSpec:
    """``/v1/chat/completions``: messages rendered through the model's chat template; by default
    the answer may run to the end of the context, as OpenAI's."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _model(body, served)
    _unsupported(body, {**_COMMON_UNSUPPORTED, "logprobs": (None, False), "top_logprobs": (None, 0),
                        "tool_choice": (None, "none")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    req = conductor_pb2.GenerateRequest(sampling=_sampling(body, served, None))
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}", f"messages[{i}].role")
        req.messages.messages.add(role=role, content=_content(m, i))
    stream, usage = _stream_flags(body)
    return GenerateSpec(model, req, chat=True, stream=stream, include_usage=usage)


# -- responses ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finish(reason: str) -> str | None:
    return reason or None


def response_body(spec: GenerateSpec, rid: str, text: str, finish: str, use: dict) -> dict[str, Any]:
    if spec.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": _finish(finish)}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": spec.created, "model": spec.model,
                "choices": [choice], "usage": use}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(finish)}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": spec.created, "model": spec.model,
            "choices": [choice], "usage": use}


def chunk_body(spec: GenerateSpec, rid: str, text: str, finish: str, first: bool) -> dict[str, Any]:
    if spec.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        out = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": spec.created,
               "model": spec.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": _finish(finish)}]}
    else:
        out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": spec.created, "model": spec.model,
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(finish)}]}
    if spec.include_usage:
        out["usage"] = None
    return out


def usage_chunk(spec: GenerateSpec, rid: str, use: dict) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    prefix, obj = ("chatcmpl", "chat.completion.chunk") if spec.chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{rid}", "object": obj, "created": spec.created, "model": spec.model, "choices": [],
            "usage": use}
