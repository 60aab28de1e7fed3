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
from mooncaked.conductor.prompt_tokenizer import PromptTokenizer
from mooncaked.conductor.readiness import ReadyGate
from mooncaked.conductor.status import ConductorFacts, StoreProbe, conductor_info, instance_infos
from mooncaked.conductor.registry import DEAD, Instance, Registry
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.router import NoInstanceError, RejectedError, Route, SchedulerState, pick, predict_kv_wait
from mooncaked.conductor.decode_lease import DecodeLease, end_attempt
from mooncaked.conductor.waiting import Backoff, Deadline
from mooncaked.engine import RequestError
from mooncaked.engine.config import ModelConfig
from mooncaked.engine.tokenizer import Tokenizer
from mooncaked.hashing import block_hashes
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, engine_pb2
from mooncaked.roles.convert import layout_from_proto, sampling_from_proto, sampling_to_proto
from mooncaked.rpc import RPC_TIMEOUT_S
from mooncaked.security import Security
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
PREFILL_TIMEOUT_S = 600.0
DECODE_TIMEOUT_S = 3600.0
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED}
# a Decode stream that fails with these before its first chunk lost its decode instance (died, restarted,
# or its reservation is gone): the request is prefilled again rather than failed
DECODE_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND}
# statuses a Prefill handler itself answers: it has ended, so its KV pushes have stopped (roles/worker.py)
HANDLER_ENDED = {grpc.StatusCode.ABORTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
# after losing its last decode instance, requests wait this long for it (or another) to register
LOST_DECODE_WAIT_S = 30.0
_ROLE_NAMES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode"}


class ConductorService(conductor_pb2_grpc.ConductorServicer):
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, model_id: str, block_size: int,
                 hash_seed: int, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 scheduler: SchedulerState | None = None, ready_timeout_s: float = 0.0,
                 security: Security | None = None, prompts: PromptTokenizer | None = None) -> None:
        self.tokenizer = tokenizer
        # prompts are tokenized off the event loop, long ones refused first (prompt_tokenizer.py)
        self.prompts = prompts or PromptTokenizer(tokenizer, model_config.max_position_embeddings)
        self.model_config = model_config
        self.model_id = model_id
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry = Registry(heartbeat_timeout_s, security)  # dials instances with TLS and the token
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
        holder = self.registry.taken(request.name, request.address)
        if holder is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"{request.name} is registered and alive at {holder.address}; a name cannot be "
                                "taken over (a restarted instance at a new address is accepted once the old one "
                                "is counted dead)")
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
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            stalled = now - last - self.heartbeat_interval_s
            last = now
            if stalled > self.heartbeat_interval_s:
                # this process did not run (SIGSTOP, a starved host): the heartbeats it could not read meanwhile
                # wait in its sockets, no instance's fault; silence is counted without the stall, or every
                # instance would be marked dead at once when it runs again
                for inst in self.registry.instances.values():
                    inst.last_heartbeat = min(now, inst.last_heartbeat + stalled)
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
    async def tokenize(self, request: conductor_pb2.GenerateRequest) -> list[int]:
        """The request's prompt as token ids. Text is rendered and tokenized in a thread pool, after
        a check that its characters can fit the context at all; ids are counted before looked at."""
        kind = request.WhichOneof("input")
        limit = self.model_config.max_position_embeddings
        if kind == "token_ids":
            if len(request.token_ids.ids) >= limit:
                raise RequestError(f"the prompt has {len(request.token_ids.ids)} tokens; the model's context is "
                                   f"{limit} tokens")
            ids = list(request.token_ids.ids)
            vocab = self.model_config.vocab_size
            if any(t >= vocab for t in ids):
                raise RequestError(f"token ids must be below the vocabulary size {vocab}")
        elif kind == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not msgs:
                raise RequestError("messages is empty")
            ids = await self.prompts.encode_chat(msgs)
        elif kind == "prompt":
            if not request.prompt:
                raise RequestError("the prompt is empty")
            ids = await (self.prompts.encode(request.prompt) if request.raw
                         else self.prompts.encode_chat([{"role": "user", "content": request.prompt}]))
        else:
            raise RequestError("give a prompt, token_ids or messages")
        if not ids:
            raise RequestError("the prompt is empty")
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
        rid: str | None = None
        try:
            rid = request.request_id or uuid.uuid4().hex
            try:
                params = sampling_from_proto(request.sampling)
                ids = await self.tokenize(request)
            except (RequestError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if len(ids) + params.max_tokens > self.model_config.max_position_embeddings:
                params.max_tokens = self.model_config.max_position_embeddings - len(ids)
            hashes = block_hashes(ids, self.block_size, self.hash_seed)
            deadline = Deadline.of(context)
            for attempt in range(1, MAX_ATTEMPTS + 1):
                route_p, lease, reply = await self._prefill(context, rid, ids, params, hashes, deadline)
                eid = lease.request_id  # the engine-side id of the attempt that succeeded
                route_d = lease.decode
                call = route_d.stub.Decode(engine_pb2.DecodeRequest(request_id=eid, first_token_id=reply.first_token_id,
                                                                    first_logprob=reply.first_logprob,
                                                                    first_top_logprobs=reply.first_top_logprobs),
                                           timeout=DECODE_TIMEOUT_S)
                lease.stop()  # Decode takes the reservation over
                first = True
                lost: grpc.aio.AioRpcError | None = None
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
                        self.registry.mark_lost(route_d, f"stream broke: {e.details()}")
                    if first and e.code() in DECODE_LOST and attempt < MAX_ATTEMPTS and deadline.left() > 0:
                        lost = e  # nothing reached the client yet: prefill again, on whichever decode serves
                    else:
                        code = e.code() if e.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL
                        when = "before its first token" if first else "mid-stream"
                        await context.abort(code, f"decode instance {route_d.name} failed {when}: {e.details()}")
                finally:
                    route_d.inflight -= 1
                    self.scheduler.finished(rid)
                    call.cancel()  # a client that went away cancels the decode stream, which frees D's blocks
                    self.registry.changes.notify()  # D has room again: requests waiting for it try now
                if lost is None:
                    break
                log.warning("decode instance %s lost %s before its first token (%s: %s); prefilling it again",
                            route_d.name, rid, lost.code().name, lost.details())
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            if rid is not None:
                self.scheduler.finished(rid)  # however the request ended, the ledgers forget it
            timer.done("rejected" if context.aborted and timer.first_at is None else outcome)

    async def _prefill(self, context, rid: str, ids: list[int], params, hashes: list[int],
                       deadline: Deadline) -> tuple[Instance, DecodeLease, engine_pb2.PrefillReply]:
        """Reserve KV on a decode instance, then prefill on a prefill instance (which pushes the KV there).

        No room on the decode instance now: wait for room, within the request's deadline (with an
        SLO, refuse early when the forecast wait breaks it). Its only decode instance just lost:
        wait for one to (re)register. A failed instance: retry elsewhere, ``MAX_ATTEMPTS`` times.
        The returned lease renews the reservation until Decode takes it over."""
        tried: set[str] = set()  # failed prefill instances, and decode instances the prompt can never fit
        full: set[str] = set()  # decode instances without room now: another may have some
        full_route: tuple[Route, str] | None = None  # the last "no room" answer
        failures = 0
        last_error = ""
        last_code: grpc.StatusCode | None = None
        backoff = Backoff()
        sampling = sampling_to_proto(params)
        await self._wait_until_ready(context)
        while True:
            if failures >= MAX_ATTEMPTS:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"gave up after {MAX_ATTEMPTS} attempts: {last_error}")
            if deadline.client_s is not None and deadline.left() <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the request's deadline passed before a prefill and decode instance took it"
                                    + (f" (last failure: {last_error})" if last_error else ""))
            try:
                route = pick(self.registry, self.index, hashes, len(ids), tried | full, state=self.scheduler,
                             max_tokens=params.max_tokens, request_id=rid)
            except RejectedError as e:
                # prediction-based early rejection: refuse before any prefill is spent
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected early ({e.reason}): {e}",
                                    reason=e.reason)
            except NoInstanceError as e:
                if e.role == "decode" and full_route is not None and full:
                    # every decode instance that serves is out of room now: wait for some to free
                    await self._wait_for_room(context, *full_route, len(ids), deadline, backoff)
                    full.clear()
                    continue
                if await self._wait_for_lost(e.role, deadline):
                    continue
                if last_code == grpc.StatusCode.OUT_OF_RANGE:
                    await context.abort(last_code, last_error)
                await context.abort(grpc.StatusCode.UNAVAILABLE, self._no_instance(e, deadline, last_error))
            decode = route.decode
            # one engine-side id per attempt: a late call of an abandoned attempt (its reservation left to
            # expire on a decode, its Abort) touches nothing of the next, even on the same instances
            eid = f"{rid}.{uuid.uuid4().hex[:8]}"
            try:
                reserved = await self._reserve(decode, eid, ids, sampling, deadline)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # "no room now": try the others, then wait
                    full.add(decode.name)
                    full_route = (route, e.details())
                    continue
                last_code, last_error = e.code(), f"{decode.name}: {e.details()}"
                if e.code() == grpc.StatusCode.OUT_OF_RANGE:  # this decode can never hold the prompt
                    tried.add(decode.name)
                    continue
                if e.code() not in RETRYABLE:
                    await context.abort(e.code(), e.details())
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.registry.mark_lost(decode, f"Reserve failed: {e.code().name}")
                failures += 1
                continue
            lease = DecodeLease(decode, eid, reserved)
            lease.start()
            prefill = route.prefill
            prefill.inflight += 1
            self.scheduler.routed(rid, route, len(ids), params.max_tokens)
            done = False
            try:
                reply = await self._prefill_call(
                    prefill,
                    engine_pb2.PrefillRequest(request_id=eid, prompt_token_ids=ids, sampling=sampling,
                                              decode_endpoint=reserved.endpoint,
                                              decode_block_ids=reserved.block_ids, decode_layout=reserved.layout),
                    timeout=deadline.client_left(PREFILL_TIMEOUT_S))
                done = True
                self.scheduler.prefill_done(rid, prefill.name, reply.num_computed_tokens, reply.num_cached_tokens,
                                            reply.compute_s or None)
                if reply.push_bytes and reply.push_s > 0:
                    self.scheduler.observe_transfer(prefill.name, "remote", reply.push_bytes, reply.push_s)
                return prefill, lease, reply
            except asyncio.CancelledError:
                # the client went away: stop the prefill, then (once it acknowledged) free the decode blocks
                spawn(end_attempt(prefill, lease, eid, prefill_ended=False), f"end-{eid}")
                raise
            except grpc.aio.AioRpcError as e:
                # in the background: a hung prefill instance must not hold up the retry
                spawn(end_attempt(prefill, lease, eid, prefill_ended=e.code() in HANDLER_ENDED), f"end-{eid}")
                last_code, last_error = e.code(), f"{prefill.name}: {e.details()}"
                if e.code() == grpc.StatusCode.ABORTED:
                    # the KV push to the decode instance failed: it is likely gone; route again
                    log.warning("KV push of %s to %s failed: %s", rid, decode.name, e.details())
                    self.registry.mark_lost(decode, f"KV push failed: {e.details()}")
                    last_error = f"{decode.name}: {e.details()}"
                    failures += 1
                    continue
                if e.code() not in RETRYABLE:
                    await context.abort(e.code(), e.details())
                log.warning("prefill of %s on %s failed (%s); retrying elsewhere", rid, prefill.name, e.code().name)
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_lost(prefill, e.details() or "unavailable")
                tried.add(prefill.name)
                failures += 1
            finally:
                prefill.inflight -= 1
                if not done:
                    self.scheduler.prefill_done(rid, prefill.name)

    async def _prefill_call(self, prefill: Instance, request: engine_pb2.PrefillRequest,
                            timeout: float) -> engine_pb2.PrefillReply:
        """The Prefill call, given up (UNAVAILABLE) once ``prefill`` is counted dead while another
        prefill instance serves: a stopped or cut-off process sends no heartbeats, but its
        connection may stay open (gRPC keepalive does not always cut it), and the call would wait
        for its deadline (up to PREFILL_TIMEOUT_S) instead of being retried there at once."""
        call = prefill.stub.Prefill(request, timeout=timeout)
        task = asyncio.ensure_future(_awaited(call))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_interval_s)
                if done:
                    return task.result()
                if prefill.state == DEAD and any(p is not prefill for p in self.registry.available("prefill")):
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               f"{prefill.name} stopped sending heartbeats mid-prefill")
        finally:
            if not task.done():
                call.cancel()
                task.cancel()

    async def _reserve(self, decode: Instance, eid: str, ids: list[int], sampling,
                       deadline: Deadline) -> engine_pb2.ReserveReply:
        try:
            return await decode.stub.Reserve(
                engine_pb2.ReserveRequest(request_id=eid, prompt_token_ids=ids, sampling=sampling),
                timeout=deadline.client_left(RPC_TIMEOUT_S))
        except asyncio.CancelledError:
            # the Reserve may still land: the Abort frees it, or refuses it if it comes later
            spawn(_abort_on(decode, eid), f"abort-{eid}")
            raise

    async def _wait_for_room(self, context, route: Route, why: str, prompt_len: int, deadline: Deadline,
                             backoff: Backoff) -> None:
        """The decode instance has no KV room now: sleep until blocks may have freed (a stream ended, a
        heartbeat reports more free), then route again. Ends the request when its deadline passes, or
        (with an SLO) when the forecast wait breaks the TTFT SLO."""
        policy = self.scheduler.policy
        if policy.early_rejection and policy.enforce_slo:
            wait = predict_kv_wait(self.scheduler, route.decode, prompt_len)
            ttft = deadline.waited() + (wait or 0.0) + (route.decision.predicted_ttft_s if route.decision else 0.0)
            if wait is not None and ttft > policy.slo.ttft_s:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"rejected early (kv_wait): {route.decode.name} is forecast to have KV room for "
                                    f"{prompt_len} tokens in {wait:.1f} s; time to first token {ttft:.1f} s would "
                                    f"break the {policy.slo.ttft_s:.1f} s SLO", reason="kv_wait")
        left = deadline.left()
        if left <= 0:
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if deadline.client_s is not None
                    else grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(code, f"waited {deadline.waited():.1f} s for decode KV room, in vain: {why}")
        if not backoff.started:
            log.info("no decode KV room for a %d-token prompt now (%s); waiting", prompt_len, why)
        await self.registry.changes.wait(min(backoff.next(), left))

    async def _wait_for_lost(self, role: str, deadline: Deadline) -> bool:
        """No decode instance serves, but one was lost moments ago: wait (bounded) for it to come back
        or another to register. True: route again. A restarted instance registers in seconds; one
        gone for ``LOST_DECODE_WAIT_S`` is not waited for."""
        if role != "decode" or not self.registry.lost_since("decode", LOST_DECODE_WAIT_S):
            return False
        left = deadline.left()
        if left <= 0:
            return False
        await self.registry.changes.wait(min(1.0, left))
        return True

    def _no_instance(self, e: NoInstanceError, deadline: Deadline, last_error: str) -> str:
        msg = str(e)
        lost = [i for i in self.registry.instances.values() if i.role == e.role and i.state == DEAD]
        if lost:
            now = time.monotonic()
            msg += " (" + ", ".join(f"{i.name} lost {now - i.dead_since:.0f} s ago" if i.dead_since else
                                     f"{i.name} dead" for i in lost) + f"; waited {deadline.waited():.1f} s)"
        return msg + (f" (after failures: {last_error})" if last_error else "")

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



async def _awaited(call):
    """A gRPC call as a coroutine, so a task can wait for it alongside a timer."""
    return await call


async def _abort_on(inst: Instance, eid: str) -> None:
    try:
        await inst.stub.Abort(engine_pb2.AbortRequest(request_id=eid), timeout=RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.warning("could not abort %s on %s: %s", eid, inst.name, e.code().name)


async def run_conductor_role(cfg) -> int:
    """Serve the Conductor service (gRPC) and the HTTP front until SIGTERM."""
    from pathlib import Path

    from mooncaked.conductor.http_api import start_http
    from mooncaked.conductor.http_limits import HttpLimits
    from mooncaked.config import HostPort
    from mooncaked.conductor.openai_schema import ServedModel
    from mooncaked.engine.loader import read_model_config, resolve_model_dir
    from mooncaked.rpc import RoleServer, sd_notify
    from mooncaked.tasks import spawn

    loop = asyncio.get_running_loop()
    security = Security.from_config(cfg)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    model_dir = await loop.run_in_executor(None, resolve_model_dir, cfg.model, cache_dir)
    model_config, _ = read_model_config(model_dir)
    # early rejection is opt-in: without an SLO a request is never refused for predicted lateness
    slo = None
    if cfg.ttft_slo_s is not None or cfg.tbt_slo_s is not None:
        slo = SLO(cfg.ttft_slo_s or float("inf"), cfg.tbt_slo_s or float("inf"))
    policy = make_policy(cfg.policy, slo=slo, kvcache_balancing_threshold=cfg.kvcache_balancing_threshold)
    tokenizer = Tokenizer(model_dir)
    prompts = PromptTokenizer.for_model(tokenizer, model_dir, model_config.max_position_embeddings)
    service = ConductorService(tokenizer, model_config, model_dir.name, cfg.block_size, cfg.hash_seed,
                               cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, SchedulerState(policy),
                               ready_timeout_s=cfg.ready_timeout_s, security=security, prompts=prompts)
    # mutual TLS, the cluster token on every call but Generate/Status, the API key on Generate
    server = RoleServer(str(cfg.listen), ["mooncake.v1.Conductor"], security=security, api_key=cfg.api_key)
    conductor_pb2_grpc.add_ConductorServicer_to_server(service, server.server)
    port = await server.start()
    # clients may name the model as configured (a path, "default") or by the id engines report
    names = tuple(dict.fromkeys([model_dir.name, str(cfg.model or "default")]))
    served = ServedModel(names, model_config.max_position_embeddings, model_config.vocab_size)
    try:
        http, http_port = await start_http(service, served, cfg.http.host, cfg.http.port, cfg.api_key,
                                           cfg.drain_timeout_s, security=security,
                                           metrics_require_key=cfg.metrics_require_key,
                                           limits=HttpLimits.from_config(cfg))
    except OSError as e:
        await server.stop(0)
        from mooncaked.startup import bind_error

        raise bind_error("--http", cfg.http, e) from e
    sweeper = spawn(service.sweep_forever(), "sweep")
    pool_watch = watcher = None
    if cfg.store is not None:
        from mooncaked.conductor.pool_watch import PoolWatch

        pool_watch = PoolWatch(str(cfg.store), service.model_id, service.index, security=security)
        service.watches_pool = True
        watcher = spawn(pool_watch.run(), "pool-watch")
        service.store = StoreProbe(str(cfg.store), security=security)  # its figures for Status
    server.install_signal_handlers()
    http_at = str(HostPort(cfg.http.host, http_port))
    grpc_at = str(HostPort(cfg.listen.host, port))
    service.facts = ConductorFacts(address=str(HostPort(cfg.advertise_address.host, port)),
                                   http_address=str(HostPort(cfg.advertise_address.host, http_port)),
                                   policy=cfg.policy, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                                   ready_timeout_s=cfg.ready_timeout_s)
    print(f"mooncaked conductor {cfg.instance_name(port)}: gRPC on {grpc_at}, HTTP on {http_at}, "
          f"model {model_dir.name}, KV pool {cfg.store or 'none'}; security: {security.mode}"
          f"{', HTTPS' if security.tls else ''}{', API key' if cfg.api_key else ''}", flush=True)
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
