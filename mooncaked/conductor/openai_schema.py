"""OpenAI request bodies -> the conductor core's ``GenerateSpec`` (the answers' shapes: openai_response.py).

Validation happens here, once, before anything is scheduled: every field is checked for type
and range so a bad request costs no prefill and gets a 400 that names the field. Fields we do
not implement (``logit_bias``, ``tools``, ``best_of`` > 1, ``suffix``, ...) are refused when set to
a value that would change the output (a silently ignored one would return something the client
did not ask for); fields that change nothing (``user``) and unknown extras are ignored, as
OpenAI clients send them. An unknown model is a 404, as OpenAI's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import reprlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mooncaked.conductor.core import GenerateSpec
from mooncaked.conductor.errors import too_long_message
from mooncaked.engine import RequestError, SamplingParams
from mooncaked.conductor.tool_calls import ToolError, Tools, grammar_source, parse_tools, shown_content, system_text
from mooncaked.engine.grammar import (MAX_GRAMMAR_BYTES, grammar_error, json_schema_grammar, lark_grammar,
                                      regex_grammar)
from mooncaked.engine.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS

MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request: each is a request of its own on the cluster
MAX_CHOICES = 64  # choices per request over a batch of prompts (prompts × n): each a request on the cluster
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' ``logprobs``
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound for chat's ``top_logprobs`` (the engine's too)
_U64 = 1 << 64
_FLOAT_MAX = int(sys.float_info.max)
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
class OpenAIRequest:
    """A validated OpenAI request: what the conductor's core serves (``spec``) plus how to answer it."""

    model: str  # the served model's canonical id, whatever alias the client sent
    spec: GenerateSpec  # the (first) prompt's request
    chat: bool
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt: n requests, choice i seeded with seed + i
    logprobs: int | None = None  # None: no log-probs; else how many top tokens to list per position
    echo: bool = False  # completions: the answer's text starts with the prompt's
    tools: Tools | None = None  # chat: the functions offered (an answer that calls one gets tool_calls)
    # completions with echo and max_tokens 0: the prompt scored, nothing generated (one token is, and dropped)
    score_only: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    more: list[GenerateSpec] = field(default_factory=list)  # completions: the batch's other prompts, in order

    @property
    def prompts(self) -> list[GenerateSpec]:
        return [self.spec, *self.more]

    def choice_specs(self) -> list[GenerateSpec]:
        """One request per choice, prompt by prompt (choice ``k * n + i`` is prompt k's i-th, as OpenAI
        numbers them); with a seed, choice i of a prompt samples with ``seed + i`` so choices differ."""
        out = []
        for spec in self.prompts:
            for i in range(self.n):
                sampling = spec.sampling
                if i and sampling.seed is not None:
                    sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % _U64)
                out.append(dataclasses.replace(spec, sampling=sampling))
        return out


# -- field checks ----------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if _is_int(v):
        return abs(v) <= _FLOAT_MAX  # a bigger int has no float (math.isfinite would raise)
    return isinstance(v, float) and math.isfinite(v)


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
        if _is_int(v):
            raise bad(f"{name} must be {what}, got an integer of {len(str(abs(v)))} digits", name)
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


def _token_ids(v: Any, served: ServedModel, param: str) -> list[int]:
    if not v:
        raise bad(f"{param} is empty", param)
    if len(v) >= served.max_context:  # first: a long list costs nothing more to refuse
        raise bad(too_long_message(param, len(v), served.max_context), param, "context_length_exceeded")
    vocab = served.vocab_size
    if not all(_is_int(t) for t in v):
        raise bad(f"{param} must be a string or a list of integer token ids", param)
    if any(not 0 <= t < vocab for t in v):
        raise bad(f"token ids in {param} must be in [0, {vocab})", param)
    return v


def _short(v: Any, limit: int = 80) -> str:
    """A value for an error message: the client may have sent megabytes of it."""
    text = reprlib.repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _unsupported(body: dict, allowed: dict[str, tuple]) -> None:
    """Refuse fields we do not implement unless they hold a value that changes nothing."""
    for name, harmless in allowed.items():
        if name in body and body[name] not in harmless:
            raise bad(f"{name}={_short(body[name])} is not supported by this server", name, "unsupported_parameter")


def _model(body: dict, served: ServedModel) -> str:
    """The canonical id of the model the request names (answers carry it, not the alias)."""
    model = body.get("model")
    if model is None:
        raise bad("model is required", "model")
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {type(model).__name__}", "model")
    if model not in served.names:
        raise ApiError(404, f"the model {_short(model)} does not exist; this server serves {served.names[0]!r}",
                       "invalid_request_error", "model", "model_not_found")
    return served.names[0]


def _sampling(body: dict, served: ServedModel, max_tokens_default: int | None, least: int = 1) -> SamplingParams:
    """``least``: the smallest max_tokens taken (0 only for a completion that echoes its prompt)."""
    ctx = served.max_context
    what = f"between {least} and the model's context ({ctx})" + (" (0 only with echo)" if least else "")
    max_tokens = _int(body, "max_completion_tokens", 1, ctx, f"between 1 and the model's context ({ctx})")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", least, ctx, what)
    if max_tokens == 0:  # the prompt alone (scored with logprobs): one token is generated and not shown
        max_tokens = 1
    if max_tokens is None:
        max_tokens = max_tokens_default if max_tokens_default is not None else ctx
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
    presence = _number(body, "presence_penalty", -2.0, 2.0, "between -2 and 2")
    frequency = _number(body, "frequency_penalty", -2.0, 2.0, "between -2 and 2")
    repetition = _number(body, "repetition_penalty", 0.0, math.inf, "greater than 0 (1 is off)", lo_open=True)
    min_tokens = _int(body, "min_tokens", 0, max_tokens, f"between 0 and max_tokens ({max_tokens})")
    p = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
        logit_bias=_logit_bias(body, served),
        top_k=0 if top_k in (None, -1) else top_k, top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0,
        seed=seed, stop=list(stop), stop_token_ids=list(stop_ids), ignore_eos=_bool(body, "ignore_eos"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True), presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0, repetition_penalty=1.0 if repetition is None else repetition,
        min_tokens=min_tokens or 0, grammar=_grammar(body))
    try:
        p.validate()
    except RequestError as e:  # a combination the engine cannot honour
        raise bad(str(e)) from None
    return p


def _logit_bias(body: dict, served: ServedModel) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON object keys, so strings) to a bias in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    what = (f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids in [0, {served.vocab_size}) to numbers in "
            f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:  # counted before looked at
        raise bad(what, "logit_bias")
    out = {}
    for k, b in v.items():
        t = int(k) if isinstance(k, str) and k.isascii() and k.isdecimal() and len(k) <= 10 else -1
        if not 0 <= t < served.vocab_size or not _is_number(b) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
            raise bad(f"{what}; got {_short(k)}: {_short(b)}", "logit_bias")
        out[t] = float(b)
    return out


def _n(body: dict) -> int:
    n = _int(body, "n", 1, MAX_N, f"between 1 and {MAX_N}")
    return 1 if n is None else n


def _ask_logprobs(spec: GenerateSpec, top: int | None) -> int | None:
    if top is not None:
        spec.sampling = dataclasses.replace(spec.sampling, logprobs=True, top_logprobs=top)
    return top


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


_COMMON_UNSUPPORTED = {"functions": (None, [])}
GUIDES = ("response_format", "guided_json", "guided_regex", "guided_choice")
COMPILED = (*GUIDES, "tools")  # fields that compile a grammar: the HTTP front parses them off its event loop


def _grammar(body: dict) -> str | None:
    """Structured outputs as a grammar (engine/grammar.py): OpenAI's ``response_format`` (``json_object``,
    ``json_schema``) or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``; at most one of them."""
    given = [k for k in GUIDES if body.get(k) is not None and body.get(k) != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise bad(f"give at most one of {', '.join(given)}", given[1])
    name = given[0]
    v = body[name]
    if name == "response_format":
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema" and isinstance(v.get("json_schema"), dict):
            schema = v["json_schema"].get("schema", {"type": "object"})
        else:
            raise bad('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', name)
        return _compiled(name, lambda: json_schema_grammar(schema), schema)
    if name == "guided_json":  # a schema, or a schema as a string
        return _compiled(name, lambda: json_schema_grammar(json.loads(v) if isinstance(v, str) else v), v)
    if name == "guided_regex":
        if not isinstance(v, str) or not v:
            raise bad("guided_regex must be a non-empty string (a regular expression)", name)
        return _compiled(name, lambda: regex_grammar(v), v)
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise bad("guided_choice must be a non-empty list of non-empty strings", name)
    return _compiled(name, lambda: regex_grammar("|".join(f"({re.escape(c)})" for c in v)), v)


def _compiled(name: str, compile_it, source: Any) -> str:
    """A grammar compiled and checked, its source bounded first; any failure is a 400 naming ``name``."""
    if not isinstance(source, (dict, bool, str, list)):
        raise bad(f"{name} must hold a JSON schema (an object), a regex or a list of choices", name)
    if len(source if isinstance(source, str) else json.dumps(source)) > MAX_GRAMMAR_BYTES:
        raise bad(f"{name} is over {MAX_GRAMMAR_BYTES} bytes", name)
    try:
        grammar = compile_it()
    except (ValueError, TypeError, RecursionError) as e:  # RecursionError: a string schema nested too deep
        raise bad(f"{name} could not be compiled: {_short(str(e))}", name) from None
    why = grammar_error(grammar)
    if why:
        raise bad(f"{name}: {why}", name)
    return grammar


# -- requests -------------------------------------------------------------------------------------
def parse_completion(body: Any, served: ServedModel) -> GenerateSpec:
    """``/v1/completions``: plain text (no chat template) or token ids; default 16 tokens, as OpenAI."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _model(body, served)
    _unsupported(body, {**_COMMON_UNSUPPORTED, "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
                        "tool_choice": (None, "none")})
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required", "prompt")
    # a batch: a list of strings or of token-id lists (a list of ints is one prompt of token ids)
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    n = _n(body)
    if len(batch) * n > MAX_CHOICES:  # counted before any is looked at
        raise bad(f"{len(batch)} prompts × n={n} is {len(batch) * n} choices; at most {MAX_CHOICES} per request",
                  "prompt")
    echo = _bool(body, "echo")
    sampling = _sampling(body, served, 16, least=0 if echo else 1)
    score_only = echo and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, f"between 0 and {MAX_COMPLETION_LOGPROBS}")
    if echo and logprobs is not None:  # the prompt's own log-probs too: it is computed whole (no cache)
        sampling = dataclasses.replace(sampling, prompt_logprobs=logprobs)
    reqs = []
    for k, one in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{k}]"
        req = GenerateSpec(sampling=dataclasses.replace(sampling), front="http")
        if isinstance(one, str):
            if not one:
                raise bad(f"{param} is empty", param)
            req.prompt = one
            req.raw = True
        elif isinstance(one, list):
            req.token_ids = _token_ids(one, served, param)
        else:
            raise bad(f"{param} must be a string or a list of token ids, got {type(one).__name__}", param)
        _ask_logprobs(req, logprobs)
        reqs.append(req)
    stream, usage = _stream_flags(body)
    return OpenAIRequest(model, reqs[0], chat=False, stream=stream, include_usage=usage, n=n, logprobs=logprobs,
                         echo=echo, score_only=score_only, more=reqs[1:])


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
    _unsupported(body, _COMMON_UNSUPPORTED)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    req = GenerateSpec(sampling=_sampling(body, served, None), messages=[], front="http")
    try:
        tools = parse_tools(body)
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
            role = m.get("role")
            if role not in _CHAT_ROLES:
                raise bad(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}", f"messages[{i}].role")
            calls = shown_content(m, i) if role == "assistant" else None  # its earlier tool calls, as JSON
            req.messages.append({"role": role, "content": _content(m, i) if calls is None else calls})
    except ToolError as e:
        raise bad(str(e), e.param) from None
    if tools is not None:
        _offer(req, tools)
    top = _int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS, f"between 0 and {MAX_CHAT_TOP_LOGPROBS}")
    if _bool(body, "logprobs"):
        logprobs = _ask_logprobs(req, top or 0)
    elif top:
        raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
    else:
        logprobs = None
    stream, usage = _stream_flags(body)
    return OpenAIRequest(model, req, chat=True, stream=stream, include_usage=usage, n=_n(body), logprobs=logprobs,
                         tools=tools)


def _offer(req: GenerateSpec, tools: Tools) -> None:
    """Tell the model of the tools (after the request's own system message) and hold its answer to a call,
    or with "auto" to a call or text (conductor/tool_calls.py)."""
    if req.sampling.grammar is not None:
        raise bad("tools cannot be combined with response_format or guided_*", "tools")
    text = system_text(tools)
    first = req.messages[0]
    if first["role"] in ("system", "developer"):
        first["content"] = f"{first['content']}\n\n{text}"
    else:
        req.messages.insert(0, {"role": "system", "content": text})
    kind, source = grammar_source(tools)
    grammar = _compiled("tools", lambda: json_schema_grammar(json.loads(source)) if kind == "json"
                        else lark_grammar(source), source)
    req.sampling = dataclasses.replace(req.sampling, grammar=grammar)
