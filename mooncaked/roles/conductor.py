"""`mooncaked --role conductor`: the Conductor gRPC service — membership, routing, and the
disaggregated request path (DESIGN §3): tokenize, hash, pick P and D, reserve on D,
prefill on P (which pushes KV to D), then relay D's token stream to the client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from mooncaked.conductor import metrics
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.conductor.readiness import ReadyGate
from mooncaked.conductor.status import ConductorFacts, StoreProbe, conductor_info, instance_infos
from mooncaked.conductor.registry import DEAD, Instance, Registry
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.router import NoInstanceError, RejectedError, SchedulerState, pick
from mooncaked.engine import RequestError
from mooncaked.engine.config import ModelConfig
from mooncaked.engine.tokenizer import Tokenizer
from mooncaked.hashing import block_hashes
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2
from mooncaked.roles.convert import layout_from_proto, sampling_from_proto, sampling_to_proto
from mooncaked.rpc import RPC_TIMEOUT_S

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
PREFILL_TIMEOUT_S = 600.0
DECODE_TIMEOUT_S = 3600.0
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED}
_ROLE_NAMES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode"}


class ConductorService(conductor_pb2_grpc.ConductorServicer):
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, model_id: str, block_size: int,
                 hash_seed: int, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 scheduler: SchedulerState | None = None, ready_timeout_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_id = model_id
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry = Registry(heartbeat_timeout_s)
        self.index = PrefixIndex()
        self.watches_pool = False  # the index's POOL_HOLDER follows the store master (conductor/pool_watch.py)
        # the routing policy and its online time models (fed by heartbeats and Prefill replies)
        self.scheduler = scheduler or SchedulerState(make_policy("mooncake"))
        self.started = time.monotonic()
        # requests wait for a serving prefill and decode while the cluster starts (readiness.py)
        self.gate = ReadyGate(ready_timeout_s)
        self.facts = ConductorFacts(ready_timeout_s=ready_timeout_s)  # filled in once the servers listen
        self.store: StoreProbe | None = None  # the store master whose figures Status shows

    # -- membership -----------------------------------------------------------------------
    async def Register(self, request, context):
        role = _ROLE_NAMES.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "only prefill and decode instances register")
        if not request.name or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and address are required")
        if request.name == POOL_HOLDER:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the name {POOL_HOLDER!r} is reserved for the KV pool in the prefix index; "
                                "give the instance another --name")
        layout = layout_from_proto(request.layout)
        if layout.block_size != self.block_size:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.name} uses block_size {layout.block_size}; this cluster uses "
                                f"{self.block_size} (one block size per cluster)")
        if request.model_id != self.model_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.name} serves model {request.model_id!r}; this conductor serves "
                                f"{self.model_id!r}")
        self.index.drop_instance(request.name)  # a (re)started instance reports its cache afresh
        self.scheduler.forget(request.name)
        self.registry.register(Instance(request.name, role, request.address, request.model_id, layout,
                                        request.transfer))
        self.gate.note(self.registry)
        return conductor_pb2.RegisterReply(heartbeat_interval_s=self.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        inst = self.registry.heartbeat(request.name, request.load, request.state)
        if inst is None:
            return conductor_pb2.HeartbeatReply(known=False)
        self.gate.note(self.registry)
        for sample in request.decode_samples:
            self.scheduler.observe_decode(request.name, sample.batch, sample.context_tokens, sample.seconds)
        for e in request.events:
            holder = e.instance or request.name
            if holder == POOL_HOLDER:
                continue  # the store master alone reports what the pool holds (pool_watch.py)
            if e.kind == common_pb2.KVEvent.KIND_STORED:
                self.index.stored(holder, list(e.block_hashes), e.medium or "dram")
            elif e.kind == common_pb2.KVEvent.KIND_REMOVED:
                self.index.removed(holder, list(e.block_hashes))
        return conductor_pb2.HeartbeatReply(known=True)

    async def Deregister(self, request, context):
        inst = self.registry.remove(request.name)
        self.index.drop_instance(request.name)
        self.scheduler.forget(request.name)
        return conductor_pb2.DeregisterReply(known=inst is not None)

    async def SetDrain(self, request, context):
        inst = self.registry.resolve(request.name)
        if inst is None:
            known = ", ".join(f"{i.name} at {i.address}" for i in self.registry.instances.values()) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no instance named or at {request.name!r} (known: {known})")
        inst.drained_by_operator = request.drain
        try:
            reply = await inst.stub.Drain(engine_pb2.DrainRequest(drain=request.drain), timeout=RPC_TIMEOUT_S)
            inst.state = reply.state
        except grpc.aio.AioRpcError as e:
            log.warning("could not tell %s to drain: %s", inst.name, e.code().name)
        self.gate.note(self.registry)
        state = common_pb2.INSTANCE_STATE_DRAINING if request.drain else inst.state
        return conductor_pb2.SetDrainReply(state=state, name=inst.name)

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            before = {n for n, i in self.registry.instances.items() if i.state == DEAD}
            self.registry.sweep()
            for name, inst in self.registry.instances.items():
                if inst.state == DEAD and name not in before:
                    self.index.drop_instance(name)

    async def Status(self, request, context):
        """The cluster's one screen (conductor/status.py); the store master's figures are asked for
        with a short deadline and show as unreachable when they do not come."""
        reply = conductor_pb2.StatusReply(
            instances=instance_infos(self.registry), model_id=self.model_id,
            uptime_s=time.monotonic() - self.started,
            conductor=conductor_info(self.facts, self.gate.state(self.registry)))
        if self.store is not None:
            reply.store.CopyFrom(await self.store.info(with_stats=not request.without_pool_stats))
        return reply

    # -- the request path -----------------------------------------------------------------
    def tokenize(self, request: conductor_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = self.model_config.vocab_size
            if any(t >= vocab for t in ids):
                raise RequestError(f"token ids must be below the vocabulary size {vocab}")
        elif kind == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not msgs:
                raise RequestError("messages is empty")
            ids = self.tokenizer.encode_chat(msgs)
        elif kind == "prompt":
            if not request.prompt:
                raise RequestError("the prompt is empty")
            ids = (self.tokenizer.encode(request.prompt) if request.raw
                   else self.tokenizer.encode_chat([{"role": "user", "content": request.prompt}]))
        else:
            raise RequestError("give a prompt, token_ids or messages")
        if not ids:
            raise RequestError("the prompt is empty")
        limit = self.model_config.max_position_embeddings
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {limit} tokens")
        return ids

    async def Generate(self, request, context):
        async with contextlib.aclosing(self.generate_stream(request, context)) as stream:
            async for chunk in stream:
                yield chunk

    async def generate_stream(self, request: conductor_pb2.GenerateRequest, context,
                              front: str = "grpc") -> AsyncIterator[conductor_pb2.GenerateChunk]:
        """The request path both fronts share (gRPC ``Generate``, the HTTP API), so they route,
        reject and measure alike. ``context`` needs only ``async abort(code, details)``, which
        must raise: gRPC's context ends the call with that status; the HTTP front raises an
        error it maps to an HTTP status. Closing the iterator early cancels the request."""
        timer = metrics.StreamTimer(front)
        context = metrics.CountingContext(context, timer)
        outcome = "error"
        try:
            rid = request.request_id or uuid.uuid4().hex
            try:
                params = sampling_from_proto(request.sampling)
                ids = self.tokenize(request)
            except (RequestError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if len(ids) + params.max_tokens > self.model_config.max_position_embeddings:
                params.max_tokens = self.model_config.max_position_embeddings - len(ids)
            hashes = block_hashes(ids, self.block_size, self.hash_seed)
            route_p, route_d, reply = await self._prefill(context, rid, ids, params, hashes)
            call = route_d.stub.Decode(engine_pb2.DecodeRequest(request_id=rid, first_token_id=reply.first_token_id,
                                                                first_logprob=reply.first_logprob,
                                                                first_top_logprobs=reply.first_top_logprobs),
                                       timeout=DECODE_TIMEOUT_S)
            first = True
            route_d.inflight += 1
            try:
                async for chunk in call:
                    out = conductor_pb2.GenerateChunk(token_ids=chunk.token_ids, text=chunk.text,
                                                      finish_reason=chunk.finish_reason, logprobs=chunk.logprobs,
                                                      top_logprobs=chunk.top_logprobs)
                    if first:
                        out.request_id = rid
                        out.prompt_tokens = len(ids)
                        out.num_cached_tokens = reply.num_cached_tokens
                        out.prefill_instance = route_p.name
                        out.decode_instance = route_d.name
                        first = False
                    timer.chunk(len(chunk.token_ids), out.prompt_tokens, out.num_cached_tokens)
                    self.scheduler.tokens(rid, len(chunk.token_ids))
                    yield out
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_dead(route_d.name, f"stream broke: {e.details()}")
                await context.abort(e.code() if e.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL,
                                    f"decode instance {route_d.name} failed mid-stream: {e.details()}")
            finally:
                route_d.inflight -= 1
                self.scheduler.finished(rid)
                call.cancel()  # a client that went away cancels the decode stream, which frees D's blocks
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            timer.done("rejected" if context.aborted and timer.first_at is None else outcome)

    async def _prefill(self, context, rid: str, ids: list[int], params, hashes: list[int]):
        """Reserve on a decode instance and prefill on a prefill instance, retrying elsewhere on failure."""
        tried: set[str] = set()
        decode: Instance | None = None
        reserved = None
        last_error = ""
        sampling = sampling_to_proto(params)
        await self._wait_until_ready(context)
        for _ in range(MAX_ATTEMPTS):
            try:
                route = pick(self.registry, self.index, hashes, len(ids), tried, state=self.scheduler,
                             max_tokens=params.max_tokens, request_id=rid)
            except RejectedError as e:
                # prediction-based early rejection: refuse before any prefill is spent
                await self._release(decode, rid, reserved)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected early ({e.reason}): {e}",
                                    reason=e.reason)
            except NoInstanceError as e:
                break_msg = f"{e}" + (f" (after failures: {last_error})" if last_error else "")
                await self._release(decode, rid, reserved)
                await context.abort(grpc.StatusCode.UNAVAILABLE, break_msg)
            if reserved is None:
                decode = route.decode
                try:
                    reserved = await decode.stub.Reserve(
                        engine_pb2.ReserveRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling),
                        timeout=RPC_TIMEOUT_S)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in RETRYABLE:
                        await context.abort(e.code(), e.details())
                    last_error = f"{decode.name}: {e.details()}"
                    tried.add(decode.name)
                    reserved = None
                    continue
            prefill = route.prefill
            prefill.inflight += 1
            self.scheduler.routed(rid, route, len(ids), params.max_tokens)
            done = False
            try:
                reply = await prefill.stub.Prefill(
                    engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                              decode_endpoint=reserved.endpoint,
                                              decode_block_ids=reserved.block_ids, decode_layout=reserved.layout),
                    timeout=PREFILL_TIMEOUT_S)
                done = True
                self.scheduler.prefill_done(rid, prefill.name, reply.num_computed_tokens, reply.num_cached_tokens,
                                            reply.compute_s or None)
                if reply.push_bytes and reply.push_s > 0:
                    self.scheduler.observe_transfer(prefill.name, "remote", reply.push_bytes, reply.push_s)
                return prefill, decode, reply
            except asyncio.CancelledError:
                await self._release(decode, rid, reserved)
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ABORTED:
                    # the KV push to the decode instance failed: give up that reservation, pick another
                    log.warning("KV push of %s to %s failed: %s", rid, decode.name, e.details())
                    await self._release(decode, rid, reserved)
                    tried.add(decode.name)
                    last_error = f"{decode.name}: {e.details()}"
                    reserved = None
                    continue
                if e.code() not in RETRYABLE:
                    await self._release(decode, rid, reserved)
                    await context.abort(e.code(), e.details())
                log.warning("prefill of %s on %s failed (%s); retrying elsewhere", rid, prefill.name, e.code().name)
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_dead(prefill.name, e.details() or "unavailable")
                last_error = f"{prefill.name}: {e.details()}"
                tried.add(prefill.name)
            finally:
                prefill.inflight -= 1
                if not done:
                    self.scheduler.prefill_done(rid, prefill.name)
        self.scheduler.finished(rid)
        await self._release(decode, rid, reserved)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"gave up after {MAX_ATTEMPTS} attempts: {last_error}")

    async def _wait_until_ready(self, context) -> None:
        """While the cluster starts (no prefill and decode have served yet, and the conductor is
        younger than ready_timeout_s), wait for them instead of refusing: bounded by the window and
        by the request's own deadline (gRPC's; the HTTP front has none). After the window routing
        answers UNAVAILABLE at once, as it does when a ready cluster loses its instances."""
        if not self.gate.starting():
            return
        time_left = getattr(context, "time_remaining", None)
        limit = time_left() if callable(time_left) else None
        if not await self.gate.wait(limit) and self.gate.starting():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the cluster is still starting: no prefill and decode instance served "
                                "before the request's deadline")

    async def _release(self, decode: Instance | None, rid: str, reserved) -> None:
        if decode is None or reserved is None:
            return
        try:
            await decode.stub.Abort(engine_pb2.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("could not release the reservation of %s on %s: %s", rid, decode.name, e.code().name)


async def run_conductor_role(cfg) -> int:
    """Serve the Conductor service (gRPC) and the HTTP front until SIGTERM."""
    from pathlib import Path

    from mooncaked.conductor.http_api import start_http
    from mooncaked.config import HostPort
    from mooncaked.conductor.openai_schema import ServedModel
    from mooncaked.engine.loader import read_model_config, resolve_model_dir
    from mooncaked.rpc import RoleServer, sd_notify
    from mooncaked.tasks import spawn

    loop = asyncio.get_running_loop()
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    model_dir = await loop.run_in_executor(None, resolve_model_dir, cfg.model, cache_dir)
    model_config, _ = read_model_config(model_dir)
    # early rejection is opt-in: without an SLO a request is never refused for predicted lateness
    slo = None
    if cfg.ttft_slo_s is not None or cfg.tbt_slo_s is not None:
        slo = SLO(cfg.ttft_slo_s or float("inf"), cfg.tbt_slo_s or float("inf"))
    policy = make_policy(cfg.policy, slo=slo, kvcache_balancing_threshold=cfg.kvcache_balancing_threshold)
    service = ConductorService(Tokenizer(model_dir), model_config, model_dir.name, cfg.block_size, cfg.hash_seed,
                               cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, SchedulerState(policy),
                               ready_timeout_s=cfg.ready_timeout_s)
    server = RoleServer(str(cfg.listen), ["mooncake.v1.Conductor"])
    conductor_pb2_grpc.add_ConductorServicer_to_server(service, server.server)
    port = await server.start()
    # clients may name the model as configured (a path, "default") or by the id engines report
    names = tuple(dict.fromkeys([model_dir.name, str(cfg.model or "default")]))
    served = ServedModel(names, model_config.max_position_embeddings, model_config.vocab_size)
    try:
        http, http_port = await start_http(service, served, cfg.http.host, cfg.http.port, cfg.api_key,
                                           cfg.drain_timeout_s)
    except OSError as e:
        await server.stop(0)
        from mooncaked.startup import bind_error

        raise bind_error("--http", cfg.http, e) from e
    sweeper = spawn(service.sweep_forever(), "sweep")
    pool_watch = watcher = None
    if cfg.store is not None:
        from mooncaked.conductor.pool_watch import PoolWatch

        pool_watch = PoolWatch(str(cfg.store), service.model_id, service.index)
        service.watches_pool = True
        watcher = spawn(pool_watch.run(), "pool-watch")
        service.store = StoreProbe(str(cfg.store))  # its figures for Status
    server.install_signal_handlers()
    http_at = str(HostPort(cfg.http.host, http_port))
    grpc_at = str(HostPort(cfg.listen.host, port))
    service.facts = ConductorFacts(address=str(HostPort(cfg.advertise_address.host, port)),
                                   http_address=str(HostPort(cfg.advertise_address.host, http_port)),
                                   policy=cfg.policy, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                                   ready_timeout_s=cfg.ready_timeout_s)
    print(f"mooncaked conductor {cfg.instance_name(port)}: gRPC on {grpc_at}, HTTP on {http_at}, "
          f"model {model_dir.name}, KV pool {cfg.store or 'none'}", flush=True)
    # both fronts accept now (requests wait for engines while the cluster starts); STATUS tells
    # `--role all` (and systemctl status) where
    sd_notify(f"READY=1\nSTATUS=gRPC on {grpc_at}, HTTP on {http_at}")
    await server.stopping.wait()
    sd_notify("STOPPING=1")
    sweeper.cancel()
    if watcher is not None:
        watcher.cancel()
    # both fronts stop accepting and drain their streams together, within one drain timeout
    await asyncio.gather(http.cleanup(), server.stop(cfg.drain_timeout_s))
    for inst in service.registry.instances.values():
        if inst.channel is not None:
            await inst.channel.close()
    if pool_watch is not None:
        await pool_watch.close()
    if service.store is not None:
        await service.store.close()
    return 0
