"""The conductor's HTTP front (aiohttp): OpenAI-compatible completions, Mooncake's KV-indexer
API, ``/metrics`` and ``/health``.

It runs in the conductor's process and calls the same core as gRPC ``Generate``
(``Conductor.generate``, conductor/core.py), so both fronts schedule, reject and measure
alike. The core's typed errors become HTTP statuses here, in one table, and every error is an
OpenAI-style JSON body; a bad request never takes the server down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mooncaked.conductor import errors, metrics
from mooncaked.conductor.core import Chunk, Conductor
from mooncaked.conductor.kv_indexer import KVIndexer
from mooncaked.conductor.fanout import first_chunks, merged
from mooncaked.conductor.http_limits import GuardedSite, HttpLimits, closes_connection, read_body
from mooncaked.conductor.json_body import decode_json
from mooncaked.conductor.openai_response import Responder, TokenTexts, batch_usage
from mooncaked.conductor.openai_schema import (COMPILED, ApiError, OpenAIRequest, ServedModel, parse_chat,
                                               parse_completion)
from mooncaked.role_metrics import registry_for
from mooncaked.security import TOKEN_HEADER, Security

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health"}  # probes carry no API key (and /metrics, unless --metrics-require-key)
TOKEN_PATHS = {"/register", "/unregister"}  # KV-indexer writes also need the cluster secret (X-Mooncaked-Token)

# the core's errors -> (HTTP status, OpenAI error type, code)
_INVALID = (400, "invalid_request_error", None)
_UNAVAILABLE = (503, "server_error", "service_unavailable")
_TIMEOUT = (504, "server_error", "timeout")
STATUS_MAP: dict[type[errors.ConductorError], tuple[int, str, str | None]] = {
    errors.BadRequest: _INVALID,
    errors.FailedPrecondition: _INVALID,
    errors.OutOfRange: _INVALID,
    errors.AlreadyExists: (409, "invalid_request_error", None),
    errors.NotFound: (404, "invalid_request_error", None),
    errors.Rejected: (429, "rate_limit_error", "rate_limit_exceeded"),
    errors.NoInstance: _UNAVAILABLE,
    errors.PeerFailed: _UNAVAILABLE,
    errors.DeadlineExceeded: _TIMEOUT,
}
# a failed peer answers as its engine's failure did (by its kind); kinds not here: 503
PEER_STATUS_MAP: dict[str, tuple[int, str, str | None]] = {
    "deadline": _TIMEOUT,
    "exhausted": (429, "rate_limit_error", "rate_limit_exceeded"),
    "cancelled": (499, "server_error", "cancelled"),
    "invalid": _INVALID, "precondition": _INVALID, "out_of_range": _INVALID,
    "not_found": (404, "invalid_request_error", None),
    "aborted": (500, "server_error", "internal_error"),
    "internal": (500, "server_error", "internal_error"),
}


def api_error(e: errors.ConductorError) -> ApiError:
    if isinstance(e, errors.PeerFailed):
        status, type_, code = PEER_STATUS_MAP.get(e.kind, _UNAVAILABLE)
    else:
        status, type_, code = STATUS_MAP.get(type(e), (500, "server_error", "internal_error"))
        if isinstance(e, errors.BadRequest) and e.code:
            code = e.code
    return ApiError(status, str(e) or type(e).__name__, type_, getattr(e, "param", None), code)


async def _naming(stream: AsyncIterator[Chunk], param: str) -> AsyncIterator[Chunk]:
    """One prompt's choice in a batch: an error it fails with names the prompt (``prompt[k]``), in its
    message and as OpenAI's ``param``."""
    try:
        async for c in stream:
            yield c
    except errors.ConductorError as e:
        e.args = (f"{param}: {e}",)
        e.param = param  # type: ignore[attr-defined]
        raise


@dataclass
class HttpFront:
    """The handlers over a running ``Conductor`` (its request path, registry and readiness)."""

    conductor: Conductor
    served: ServedModel
    api_key: str | None
    indexer: KVIndexer
    created: int = field(default_factory=lambda: int(time.time()))
    security: Security = field(default_factory=Security)  # the cluster secret for TOKEN_PATHS
    metrics_require_key: bool = False
    limits: HttpLimits = field(default_factory=HttpLimits)  # body size and read time (http_limits.py)
    page: CollectorRegistry = field(default_factory=lambda: registry_for("conductor"))  # what /metrics shows

    # -- middleware ---------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            resp = web.json_response(e.body(), status=e.status)
            if closes_connection(request):
                resp.force_close()
            return resp
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
            err = ApiError(e.status, f"{message}: {request.method} {request.path}", kind)
            return web.json_response(err.body(), status=e.status, headers={
                k: v for k, v in e.headers.items() if k.lower() == "allow"})
        except Exception:  # a bug: the client still gets a JSON body, the log gets the traceback
            log.exception("%s %s failed", request.method, request.path)
            err = ApiError(500, "internal error; the conductor's log has the details", "server_error")
            return web.json_response(err.body(), status=500)

    @web.middleware
    async def auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in TOKEN_PATHS and not self.security.token_ok(request.headers.get(TOKEN_HEADER)):
            raise ApiError(401, f"{request.path} needs the cluster secret: send it in the {TOKEN_HEADER} header",
                           "invalid_request_error", None, "invalid_cluster_token")
        open_paths = OPEN_PATHS if self.metrics_require_key else OPEN_PATHS | {"/metrics"}
        if self.api_key is None or request.path in open_paths:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key")
        return await handler(request)

    # -- helpers ------------------------------------------------------------------------------
    async def body(self, request: web.Request) -> Any:
        """The JSON body, bounded in size and time; malformed text is a 400 (json_body.py)."""
        return decode_json(await read_body(request, self.limits))

    # -- OpenAI -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_completion))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_chat))

    async def _parse(self, request: web.Request, parse) -> OpenAIRequest:
        try:
            body = await self.body(request)
            if isinstance(body, dict) and any(body.get(k) is not None for k in COMPILED):
                # compiling a schema into a grammar takes ms (tens near the size bound): off the event loop
                return await asyncio.get_running_loop().run_in_executor(None, parse, body, self.served)
            return parse(body, self.served)
        except ApiError:
            metrics.refused("http", "invalid_argument")  # refused before the request path saw it
            raise

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Token id -> text for log-probs, with the conductor's tokenizer."""
        return TokenTexts(lambda ids: self.conductor.tokenizer.decode(ids, skip_special_tokens=False))

    def _prompt_texts(self, spec: OpenAIRequest) -> list[str]:
        """What ``echo`` puts before each prompt's answers: the prompt as sent, or its token ids decoded."""
        if not spec.echo:
            return [""] * len(spec.prompts)
        return [p.prompt if p.prompt is not None else
                self.conductor.tokenizer.decode(list(p.token_ids or []), skip_special_tokens=False)
                for p in spec.prompts]

    async def _generate(self, request: web.Request, spec: OpenAIRequest) -> web.StreamResponse:
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            batch = len(spec.prompts) > 1
            for i, one in enumerate(spec.choice_specs()):  # n > 1 or a batch of prompts: one request a choice
                stream = self.conductor.generate(one)
                stack.push_async_callback(stream.aclose)
                if batch:  # its errors name the prompt (closed before the stream it reads)
                    stream = _naming(stream, f"prompt[{i // spec.n}]")
                    stack.push_async_callback(stream.aclose)
                streams.append(stream)
            # wait for the first chunks before answering: until then every failure (early
            # rejection, no instance) still gets its own status instead of a broken 200 stream
            try:
                firsts = await first_chunks(streams)
            except errors.ConductorError as e:
                raise api_error(e) from None
            if any(f is None for f in firsts):
                raise ApiError(500, "the request produced no tokens", "server_error")
            rest = merged(streams)
            stack.push_async_callback(rest.aclose)  # closed before the streams it reads
            out = Responder(spec, firsts[0].request_id, self.texts, self._prompt_texts(spec))
            if spec.stream and spec.tools is None:
                return await self._sse(request, out, self._as_they_come(out, firsts, rest))
            chunks = [[f] for f in firsts]
            try:
                async for i, c in rest:
                    chunks[i].append(c)
            except errors.ConductorError as e:
                raise api_error(e) from None
        shown = 0 if spec.score_only else sum(len(c.token_ids) for cs in chunks for c in cs)
        use = batch_usage(firsts, spec.n, shown)
        if spec.stream:  # tools offered: whether the answer is a call is known once it is whole
            return await self._sse(request, out, self._once_whole(out, [Chunk.join(cs) for cs in chunks], use))
        return web.json_response(out.response([Chunk.join(cs) for cs in chunks], use))

    async def _sse(self, request: web.Request, out: Responder, events: AsyncIterator[dict]) -> web.StreamResponse:
        """Server-sent events: each of ``events``, then ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(events):
                async for obj in events:
                    await resp.write(f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client of %s went away mid-stream; cancelling it", out.rid)
        return resp

    @staticmethod
    async def _as_they_come(out: Responder, firsts: list, rest) -> AsyncIterator[dict]:
        """A stream's chunks as the choices produce them; a failure mid-stream is one more event (the
        headers are gone), as OpenAI's."""
        n_tokens = sum(len(f.token_ids) for f in firsts)
        for i, f in enumerate(firsts):
            yield out.chunk(i, f)
        try:
            async for i, c in rest:
                n_tokens += len(c.token_ids)
                yield out.chunk(i, c)
        except errors.ConductorError as e:
            yield api_error(e).body()
            return
        if out.spec.include_usage:
            yield out.usage_chunk(batch_usage(firsts, out.spec.n, 0 if out.spec.score_only else n_tokens))

    @staticmethod
    async def _once_whole(out: Responder, choices: list[Chunk], use: dict) -> AsyncIterator[dict]:
        """A stream of answers already whole (tools offered: a call is known to be one only then)."""
        for i, choice in enumerate(choices):
            for chunk in out.whole_chunks(i, choice):
                yield chunk
        if out.spec.include_usage:
            yield out.usage_chunk(use)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(self.served.names[0])]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.served.names:
            raise ApiError(404, f"the model {name!r} does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict[str, Any]:
        # max_model_len as vLLM reports it; vocab_size lets clients (tools/replay.py) make token ids
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mooncaked",
                "max_model_len": self.served.max_context, "vocab_size": self.served.vocab_size}

    # -- KV indexer ---------------------------------------------------------------------------
    async def query(self, request: web.Request) -> web.Response:
        return web.json_response(self.indexer.query(await self.body(request), by_hash=False))

    async def query_by_hash(self, request: web.Request) -> web.Response:
        return web.json_response(self.indexer.query(await self.body(request), by_hash=True))

    async def register(self, request: web.Request) -> web.Response:
        return web.json_response(self.indexer.register(await self.body(request)))

    async def unregister(self, request: web.Request) -> web.Response:
        return web.json_response(self.indexer.unregister(await self.body(request)))

    async def events(self, request: web.Request) -> web.Response:
        return web.json_response(self.indexer.events(await self.body(request)))

    # -- operations ---------------------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        metrics.refresh(self.conductor.registry, len(self.conductor.index))
        return web.Response(body=generate_latest(self.page), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        """Ready when at least one prefill and one decode instance serve: a balancer should send
        no traffic to a conductor that can only answer 503. While the cluster starts (requests
        wait, conductor/readiness.py) the 503 says "starting"; after that, "unavailable"."""
        reg = self.conductor.registry
        counts = {role: len(reg.available(role)) for role in ("prefill", "decode")}
        state = self.conductor.gate.state(reg)
        if state == "ready":
            return web.json_response({"status": "ok", **counts})
        return web.json_response({"status": state, **counts}, status=503)


def make_app(conductor: Conductor, served: ServedModel, api_key: str | None, security: Security | None = None,
             metrics_require_key: bool = False, limits: HttpLimits | None = None) -> web.Application:
    limits = limits or HttpLimits()
    front = HttpFront(conductor, served, api_key, KVIndexer(conductor), security=security or Security(),
                      metrics_require_key=metrics_require_key, limits=limits)
    app = web.Application(middlewares=[front.errors, front.auth], client_max_size=limits.max_request_bytes)
    app.add_routes([
        web.post("/v1/completions", front.completions),
        web.post("/v1/chat/completions", front.chat_completions),
        web.get("/v1/models", front.models),
        web.get("/v1/models/{model}", front.model),
        web.post("/query", front.query),
        web.post("/query_by_hash", front.query_by_hash),
        web.post("/register", front.register),
        web.post("/unregister", front.unregister),
        web.post("/events", front.events),
        web.get("/metrics", front.metrics),
        web.get("/health", front.health),
    ])
    return app


async def start_http(conductor: Conductor, served: ServedModel, host: str, port: int, api_key: str | None,
                     shutdown_timeout_s: float, *, security: Security | None = None,
                     metrics_require_key: bool = False,
                     limits: HttpLimits | None = None) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: any free port) and return the runner (``cleanup()`` stops it,
    letting open streams finish for up to ``shutdown_timeout_s``) and the bound port.
    With TLS configured (``security``) it serves HTTPS from the same certificate and key.
    ``limits`` bound bodies, read times and open connections (http_limits.py)."""
    security = security or Security()
    limits = limits or HttpLimits()
    # handler_cancellation: a client that disconnects cancels its handler, hence its request
    runner = web.AppRunner(make_app(conductor, served, api_key, security, metrics_require_key, limits),
                           handler_cancellation=True, shutdown_timeout=shutdown_timeout_s, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, host, port, limits, ssl_context=security.http_ssl_context(), access_log=None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            bound = addr[1]
            break
    return runner, bound
