"""Prefill and decode instances: an Engine gRPC service over a local engine and a transfer endpoint.

Prefill: compute the prompt (reusing the local prefix cache), push each layer's KV into
the decode instance's reserved blocks as soon as it is written, answer with the first
token once every byte has landed. Decode: reserve blocks for a prompt's KV, then take
the request into the running batch and stream its tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from mooncaked.engine import Engine, Output, RequestError, SamplingParams
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.engine.llm_engine import EngineStoppedError, StepSeq
from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from mooncaked.roles.convert import (layout_from_proto, layout_to_proto, load_to_proto, sampling_from_proto,
                                     top_from_proto, top_to_proto)
from mooncaked.roles.kv_push import KV_REGION, KVPush
from mooncaked.roles.pool_cache import PoolCache
from mooncaked.transfer import TransferEngine, TransferError

log = logging.getLogger(__name__)

# a reservation lives this long past its last Reserve/Renew: the conductor renews it while the prefill that
# writes it runs, so only a conductor that died (or lost this instance) leaves one to expire
RESERVATION_TTL_S = 30.0
PREFILL_TIMEOUT_S = 600.0
PUSH_TIMEOUT_S = 60.0
# Abort on a prefill instance answers once the request's KV pushes have stopped, or after this long
ABORT_WAIT_S = 10.0
# ids of aborted requests remembered, so a Reserve or Prefill that arrives after its Abort is refused
ABORTED_REMEMBERED = 4096


@dataclass
class Reservation:
    blocks: list[int]
    prompt: list[int]
    params: SamplingParams
    expires: float


class WorkerService(engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str, role: str, engine: Engine, transfer: TransferEngine, model_id: str,
                 kv_push: str = "layerwise", store=None, reservation_ttl_s: float = RESERVATION_TTL_S) -> None:
        self.name = name
        self.role = role
        self.engine = engine
        self.transfer = transfer
        self.model_id = model_id
        self.layerwise = kv_push == "layerwise"
        self.layout: KVLayout = engine.runner.kv.layout()
        self.started = time.monotonic()
        self.draining = False
        self.reserved: dict[str, Reservation] = {}
        self.reservation_ttl_s = reservation_ttl_s
        self.pushes: dict[str, KVPush] = {}
        self.prefill_ended: dict[str, asyncio.Event] = {}  # set once a prefill's pushes have stopped
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.queued_prefill_tokens = 0
        self.inflight = 0
        self.pool = PoolCache(store, engine, model_id) if store is not None else None
        engine.layer_hook = self._on_layer

    # -- helpers --------------------------------------------------------------------------
    def _on_layer(self, layer: int, seqs: list[StepSeq]) -> None:
        for s in seqs:
            push = self.pushes.get(s.request_id)
            if push is not None:
                push.on_layer(layer, s)

    async def _refuse_if(self, context: grpc.aio.ServicerContext, role: str) -> None:
        if self.role != role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.name} is a {self.role} instance; this call needs a {role} instance")
        if self.engine.driver_failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.name}'s engine stopped ({self.engine.driver_failure!r}); it is restarting")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining and takes no new work")

    def _error_status(self) -> grpc.StatusCode:
        """A request that failed alone (its logits were NaN, its step raised) is INTERNAL: the engine
        serves on and a retry would fail alike. One failed by a dead engine is UNAVAILABLE: the
        conductor marks us dead and tries another instance."""
        return grpc.StatusCode.UNAVAILABLE if self.engine.driver_failure is not None else grpc.StatusCode.INTERNAL

    def endpoint(self) -> common_pb2.TransferEndpoint:
        info = self.transfer.info()
        region = info.regions.get(KV_REGION)
        return common_pb2.TransferEndpoint(address=self.transfer.address, backend=self.transfer.backend,
                                           region=KV_REGION, same_host_id=info.host_id,
                                           shm_name=(region.shm_name or "") if region else "")

    def idle(self) -> bool:
        return not self.reserved and not self.pushes and self.inflight == 0 and not self.engine.has_work()

    def _remember_abort(self, request_id: str) -> None:
        self.aborted[request_id] = None
        self.aborted.move_to_end(request_id)
        while len(self.aborted) > ABORTED_REMEMBERED:
            self.aborted.popitem(last=False)

    async def expire_reservations(self) -> None:
        """A reservation whose Decode never comes and that nobody renews (conductor died) is given back."""
        while True:
            await asyncio.sleep(min(5.0, self.reservation_ttl_s / 4))
            now = time.monotonic()
            for rid, res in list(self.reserved.items()):
                if res.expires < now:
                    self.reserved.pop(rid, None)
                    await self.engine.call(self.engine.unreserve, res.blocks)
                    log.warning("reservation %s expired; %d blocks freed", rid, len(res.blocks))

    # -- decode side ----------------------------------------------------------------------
    async def Reserve(self, request, context):
        await self._refuse_if(context, "decode")
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling)
            self.engine.tokenize(prompt)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.request_id in self.reserved or not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be non-empty and unused")
        if request.request_id in self.aborted:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id!r} was aborted")
        if len(prompt) >= self.engine.max_model_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt of {len(prompt)} tokens exceeds the context of {self.engine.max_model_len}")
        bm = self.engine.block_manager
        if bm.blocks_needed(len(prompt)) > bm.num_blocks:
            # OUT_OF_RANGE, not RESOURCE_EXHAUSTED: waiting for room would never end
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"{self.name} can never hold {len(prompt)} tokens of KV: it has "
                                f"{bm.num_blocks * self.layout.block_size} in all (--kv-cache-bytes)")
        blocks = await self.engine.call(self.engine.reserve, len(prompt))
        if blocks is None:
            # "no room now": the conductor waits for blocks to free and asks again
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.name} has no free KV blocks for {len(prompt)} tokens now")
        self.reserved[request.request_id] = Reservation(blocks, prompt, params,
                                                        time.monotonic() + self.reservation_ttl_s)
        return engine_pb2.ReserveReply(block_ids=blocks, endpoint=self.endpoint(), layout=layout_to_proto(self.layout),
                                       ttl_s=self.reservation_ttl_s)

    async def Renew(self, request, context):
        """The prefill writing this reservation still runs: keep its blocks another TTL."""
        res = self.reserved.get(request.request_id)
        if res is None:
            return engine_pb2.RenewReply(found=False)
        res.expires = time.monotonic() + self.reservation_ttl_s
        return engine_pb2.RenewReply(found=True, ttl_s=self.reservation_ttl_s)

    async def Decode(self, request, context):
        res = self.reserved.pop(request.request_id, None)
        if res is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for request {request.request_id!r}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self.inflight += 1
        finished = False
        try:
            try:
                first_top = (top_from_proto(request.first_top_logprobs)
                             if res.params.top_logprobs and request.HasField("first_top_logprobs") else None)
                self.engine.add_prefilled(request.request_id, res.prompt, request.first_token_id, res.blocks,
                                          res.params, lambda o: loop.call_soon_threadsafe(queue.put_nowait, o),
                                          request.first_logprob if res.params.logprobs else None, first_top)
            except RequestError as e:
                await self.engine.call(self.engine.unreserve, res.blocks)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineStoppedError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {e}")
            while not finished:
                out = await queue.get()
                finished = out.finished
                if out.finish_reason == "error":
                    await context.abort(self._error_status(),
                                        f"{self.name} could not decode request {request.request_id}: {out.error}")
                n = len(out.new_token_ids)
                lps = out.logprobs[-n:] if out.logprobs and n else []
                tops = [top_to_proto(t) for t in out.top_logprobs[-n:]] if out.top_logprobs and n else []
                yield engine_pb2.TokenChunk(token_ids=out.new_token_ids, text=out.new_text, logprobs=lps,
                                            top_logprobs=tops, finish_reason=out.finish_reason or "")
        finally:
            self.inflight -= 1
            if not finished:  # the caller went away: stop and free the blocks
                self.engine.abort(request.request_id)

    # -- prefill side ---------------------------------------------------------------------
    async def Prefill(self, request, context):
        await self._refuse_if(context, "prefill")
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        remote = layout_from_proto(request.decode_layout)
        why = self.layout.compatible(remote)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"decode KV layout does not match: {why}")
        if len(request.decode_block_ids) != -(-len(prompt) // self.layout.block_size):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.decode_block_ids)} decode blocks for {len(prompt)} prompt tokens")
        if rid in self.pushes or not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be non-empty and unused")
        try:
            params = sampling_from_proto(request.sampling)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop = asyncio.get_running_loop()
        push = KVPush(self.transfer, loop, self.layout, remote, request.decode_endpoint.address,
                      list(request.decode_block_ids), len(prompt), self.layerwise)
        first: asyncio.Future[Output] = loop.create_future()

        def sink(out: Output) -> None:
            if out.finished:
                loop.call_soon_threadsafe(lambda: first.done() or first.set_result(out))

        # the prefill samples only the first token; min_tokens still keeps it from being EOS
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        imported = await self.pool.fetch_prefix(prompt) if self.pool is not None else []
        if rid in self.aborted:  # its Abort overtook it: no byte may go to the decode blocks it names
            if imported:
                await self.engine.call(self.engine.unreserve, imported)
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
        self.pushes[rid] = push
        ended = self.prefill_ended[rid] = asyncio.Event()
        self.queued_prefill_tokens += len(prompt)
        self.inflight += 1
        added = False
        try:
            try:
                self.engine.add_request(prompt, one, rid, sink, imported_blocks=imported, hold_blocks=True)
                added = True
            except RequestError as e:
                if imported:
                    await self.engine.call(self.engine.unreserve, imported)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineStoppedError as e:  # UNAVAILABLE: the conductor retries on another prefill
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {e}")
            try:
                out = await asyncio.wait_for(first, PREFILL_TIMEOUT_S)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{self.name} did not finish prefilling {rid} in {PREFILL_TIMEOUT_S:.0f}s")
            if out.finish_reason == "abort":
                await context.abort(grpc.StatusCode.CANCELLED, "prefill was aborted")
            if out.finish_reason == "error":
                await context.abort(self._error_status(), f"{self.name} could not prefill {rid}: {out.error}")
            try:
                await push.wait(PUSH_TIMEOUT_S)
            except (TransferError, asyncio.TimeoutError) as e:
                # ABORTED: the decode side is at fault; the conductor picks another decode instance
                await context.abort(grpc.StatusCode.ABORTED, f"pushing KV to {push.peer} failed: {e}")
            assert push.complete, "prefill finished without pushing every layer"
            if self.pool is not None:
                self.pool.write_back(prompt, push.block_table, len(imported))
            token = out.token_ids[0]
            top = top_to_proto(out.top_logprobs[0]) if out.top_logprobs else None
            # the request ends here only if the first token ends it for the *real* limits
            finished = out.finish_reason == "stop" or params.max_tokens == 1
            return engine_pb2.PrefillReply(
                first_token_id=token, first_logprob=(out.logprobs or [0.0])[0],
                num_cached_tokens=out.num_cached_tokens,
                num_computed_tokens=len(prompt) - out.num_cached_tokens,
                finished=finished, finish_reason=(out.finish_reason or "") if finished else "",
                compute_s=out.compute_s, push_bytes=push.bytes_sent, push_s=push.seconds, first_top_logprobs=top,
            )
        finally:
            self.inflight -= 1
            self.queued_prefill_tokens -= len(prompt)
            try:
                if added and not first.done():
                    self.engine.abort(rid)  # the caller went away mid-prefill
                # no write to the decode's blocks starts or stays in flight once this handler ends
                if not await push.stop(PUSH_TIMEOUT_S):
                    log.warning("KV pushes of %s to %s did not end within %.0fs; cancelled", rid, push.peer,
                                PUSH_TIMEOUT_S)
                self.pushes.pop(rid, None)
                if added:
                    await self.engine.call(self.engine.release, rid)
            finally:
                self.prefill_ended.pop(rid, None)
                ended.set()

    # -- common ---------------------------------------------------------------------------
    async def Abort(self, request, context):
        """Stop a request wherever it is. The id is remembered, so a Reserve or Prefill that arrives
        after its Abort (a cancelled call still in flight) is refused. On a prefill instance the answer
        waits until the request's KV pushes have stopped (``ended``): only then may the conductor free
        the decode blocks they write."""
        rid = request.request_id
        self._remember_abort(rid)
        res = self.reserved.pop(rid, None)
        if res is not None:
            await self.engine.call(self.engine.unreserve, res.blocks)
            return engine_pb2.AbortReply(found=True, ended=True)
        self.engine.abort(rid)
        ended = self.prefill_ended.get(rid)
        if ended is None:
            return engine_pb2.AbortReply(found=False, ended=True)
        try:
            await asyncio.wait_for(ended.wait(), ABORT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("prefill %s still pushing %.0fs after its abort", rid, ABORT_WAIT_S)
        return engine_pb2.AbortReply(found=True, ended=ended.is_set())

    def load(self) -> common_pb2.InstanceLoad:
        return load_to_proto(self.engine.stats(), self.queued_prefill_tokens)

    async def Stats(self, request, context):
        role = common_pb2.ROLE_PREFILL if self.role == "prefill" else common_pb2.ROLE_DECODE
        return engine_pb2.StatsReply(name=self.name, role=role, load=self.load(), layout=layout_to_proto(self.layout),
                                     uptime_s=time.monotonic() - self.started, model_id=self.model_id)

    def state(self) -> int:
        """What heartbeats report: DEAD once the engine's driver died (the conductor stops routing here)."""
        if self.engine.driver_failure is not None:
            return common_pb2.INSTANCE_STATE_DEAD
        return common_pb2.INSTANCE_STATE_DRAINING if self.draining else common_pb2.INSTANCE_STATE_SERVING

    async def Drain(self, request, context):
        self.draining = request.drain
        log.info("%s %s", self.name, "draining" if self.draining else "serving again")
        return engine_pb2.DrainReply(state=self.state())

    async def CachedPrefix(self, request, context):
        hashes = list(request.block_hashes)
        n = self.engine.block_manager.cached_prefix_len(hashes)
        return engine_pb2.CachedPrefixReply(num_blocks=n)
