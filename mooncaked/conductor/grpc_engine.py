"""``EngineLink`` over gRPC: one channel to one engine instance's ``Engine`` service.

The only place the request path meets engine protos and gRPC status codes: calls become
messages, replies dataclasses, and every ``AioRpcError`` an ``EngineError`` of the kind its code
means (``KIND_OF``; ``STATUS_OF`` the other way, for the engine's own gRPC front). Prefill
instances use it too, to borrow KV from the peer their plan names (``lend``/``release``).
Each link owns its channel: with gRPC's process-wide subchannel pool a fresh channel to a
restarted instance would share the old one's subchannel, still in reconnect backoff
("connection refused" for seconds after the instance is back).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc

from mooncaked.conductor import engine_link as el
from mooncaked.conductor.engine_link import (AbortResult, EngineError, EngineLink, Loan, PrefillPlan, PrefillResult,
                                             StageOpen, StageOpened,
                                             Reservation, TokenChunk, TransferEndpoint)
from mooncaked.engine import SamplingParams
from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from mooncaked.convert import layout_from_proto, layout_to_proto, sampling_to_proto, top_from_proto, top_to_proto
from mooncaked.rpc import CHANNEL_OPTIONS
from mooncaked.security import Security

log = logging.getLogger(__name__)

# reconnects are tried within a second, not after gRPC's two minutes; the connect timeout stays gRPC's 20 s
# (a stalled instance is waited for, not failed in 100 ms)
INSTANCE_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 100),
                                              ("grpc.max_reconnect_backoff_ms", 1000),
                                              ("grpc.use_local_subchannel_pool", 1)]

KIND_OF: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAVAILABLE: el.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: el.DEADLINE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: el.EXHAUSTED,
    grpc.StatusCode.CANCELLED: el.CANCELLED,
    grpc.StatusCode.OUT_OF_RANGE: el.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED: el.ABORTED,
    grpc.StatusCode.NOT_FOUND: el.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: el.INVALID,
    grpc.StatusCode.ALREADY_EXISTS: el.INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: el.PRECONDITION,
}  # anything else (INTERNAL, UNKNOWN, ...) is INTERNAL
# the other way, for the engine's gRPC front (roles/worker.py): an EngineError's kind -> its status
STATUS_OF: dict[str, grpc.StatusCode] = {kind: code for code, kind in KIND_OF.items()
                                         if code != grpc.StatusCode.ALREADY_EXISTS}
STATUS_OF[el.INTERNAL] = grpc.StatusCode.INTERNAL

STATE_OF: dict[int, str] = {
    common_pb2.INSTANCE_STATE_STARTING: el.STARTING,
    common_pb2.INSTANCE_STATE_SERVING: el.SERVING,
    common_pb2.INSTANCE_STATE_DRAINING: el.DRAINING,
    common_pb2.INSTANCE_STATE_DEAD: el.DEAD,
}


def engine_error(e: grpc.aio.AioRpcError) -> EngineError:
    return EngineError(KIND_OF.get(e.code(), el.INTERNAL), e.details() or e.code().name)


def endpoint_from_proto(p: common_pb2.TransferEndpoint) -> TransferEndpoint:
    return TransferEndpoint(p.address, p.backend, p.region, p.same_host_id, p.shm_name)


def endpoint_to_proto(t: TransferEndpoint) -> common_pb2.TransferEndpoint:
    return common_pb2.TransferEndpoint(address=t.address, backend=t.backend, region=t.region,
                                       same_host_id=t.same_host_id, shm_name=t.shm_name)


def plan_to_proto(p: PrefillPlan) -> engine_pb2.PrefillPlan:
    return engine_pb2.PrefillPlan(reuse_blocks=p.reuse_blocks, pull_from=p.pull_from, pull_blocks=p.pull_blocks,
                                  pull_address=p.pull_address, replicate=p.replicate, pool_fallback=p.pool_fallback,
                                  helpers=p.helpers)


def plan_from_proto(p: engine_pb2.PrefillPlan) -> PrefillPlan:
    return PrefillPlan(p.reuse_blocks, p.pull_from, p.pull_blocks, p.pull_address, p.replicate, p.pool_fallback,
                       list(p.helpers))


def result_to_proto(r: PrefillResult) -> engine_pb2.PrefillReply:
    return engine_pb2.PrefillReply(
        first_token_id=r.first_token_id, first_logprob=r.first_logprob, num_cached_tokens=r.cached_tokens,
        num_computed_tokens=r.computed_tokens, finished=r.finished, finish_reason=r.finish_reason,
        compute_s=r.compute_s, push_bytes=r.push_bytes, push_s=r.push_s,
        first_top_logprobs=top_to_proto(r.first_top_logprobs) if r.first_top_logprobs is not None else None,
        local_blocks=r.local_blocks, pulled_blocks=r.pulled_blocks, pulled_from=r.pulled_from,
        replicated=r.replicated, deviations=r.deviations, prompt_logprobs=r.prompt_logprobs,
        prompt_top_logprobs=[top_to_proto(t) for t in r.prompt_top_logprobs])


def result_from_proto(r: engine_pb2.PrefillReply) -> PrefillResult:
    return PrefillResult(
        first_token_id=r.first_token_id, first_logprob=r.first_logprob,
        first_top_logprobs=top_from_proto(r.first_top_logprobs) if r.HasField("first_top_logprobs") else None,
        cached_tokens=r.num_cached_tokens, computed_tokens=r.num_computed_tokens, finished=r.finished,
        finish_reason=r.finish_reason, compute_s=r.compute_s, push_bytes=r.push_bytes, push_s=r.push_s,
        local_blocks=r.local_blocks, pulled_blocks=r.pulled_blocks, pulled_from=r.pulled_from,
        replicated=r.replicated, deviations=dict(r.deviations), prompt_logprobs=list(r.prompt_logprobs),
        prompt_top_logprobs=[top_from_proto(t) for t in r.prompt_top_logprobs])


class GrpcEngineLink(EngineLink):
    def __init__(self, address: str, security: Security | None = None) -> None:
        self.address = address
        self.channel = (security or Security()).channel(address, options=INSTANCE_CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    @classmethod
    def dialer(cls, security: Security | None = None) -> Callable[[str, str], "GrpcEngineLink"]:
        """What the registry calls to reach a newly registered instance: ``(name, address) -> link``."""
        return lambda name, address: cls(address, security)

    async def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      timeout_s: float) -> Reservation:
        try:
            reply = await self.stub.Reserve(engine_pb2.ReserveRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling_to_proto(sampling)),
                timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return Reservation(list(reply.block_ids), endpoint_from_proto(reply.endpoint), layout_from_proto(reply.layout),
                           reply.ttl_s)

    async def renew(self, request_id: str, timeout_s: float) -> float | None:
        try:
            reply = await self.stub.Renew(engine_pb2.RenewRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return reply.ttl_s if reply.found else None

    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      target: Reservation, timeout_s: float, plan: PrefillPlan | None = None,
                      stages: list[str] | None = None) -> PrefillResult:
        request = engine_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling_to_proto(sampling),
            decode_endpoint=endpoint_to_proto(target.endpoint), decode_block_ids=target.block_ids,
            decode_layout=layout_to_proto(target.layout), plan=plan_to_proto(plan) if plan is not None else None,
            decode_address=target.engine_address, decode_ttl_s=target.ttl_s, stage_addresses=stages or [])
        try:
            r = await self.stub.Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return result_from_proto(r)

    async def stage_open(self, opening: StageOpen, timeout_s: float) -> StageOpened:
        t = opening.target
        request = engine_pb2.StageOpenRequest(
            request_id=opening.request_id, prompt_token_ids=opening.prompt_token_ids,
            sampling=sampling_to_proto(opening.sampling), decode_endpoint=endpoint_to_proto(t.endpoint),
            decode_block_ids=t.block_ids, decode_layout=layout_to_proto(t.layout), decode_address=t.engine_address,
            decode_ttl_s=t.ttl_s, downstream=opening.downstream)
        if opening.elastic is not None:
            request.stage_index, request.stage_count = opening.elastic
            request.lead_cached_block_ids.extend(opening.lead_cached)
            if opening.lead_endpoint is not None:
                request.lead_endpoint.CopyFrom(endpoint_to_proto(opening.lead_endpoint))
        try:
            r = await self.stub.StageOpen(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return StageOpened(r.cached_blocks, endpoint_from_proto(r.inbox), r.inbox_offset, r.row_bytes)

    async def stage_input(self, request_id: str, start_tokens: int, ready_tokens: int, timeout_s: float,
                          lead_block_ids: list[int] | None = None) -> None:
        try:
            await self.stub.StageInput(engine_pb2.StageInputRequest(
                request_id=request_id, start_tokens=start_tokens, ready_tokens=ready_tokens,
                lead_block_ids=lead_block_ids or []), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None

    async def stage_finish(self, request_id: str, timeout_s: float) -> PrefillResult:
        try:
            r = await self.stub.StageFinish(engine_pb2.StageFinishRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return result_from_proto(r)

    async def decode(self, request_id: str, first: PrefillResult, timeout_s: float) -> AsyncIterator[TokenChunk]:
        request = engine_pb2.DecodeRequest(request_id=request_id, first_token_id=first.first_token_id,
                                           first_logprob=first.first_logprob)
        if first.first_top_logprobs is not None:
            request.first_top_logprobs.CopyFrom(top_to_proto(first.first_top_logprobs))
        call = self.stub.Decode(request, timeout=timeout_s)
        try:
            async for c in call:
                yield TokenChunk(list(c.token_ids), c.text, list(c.logprobs),
                                 [top_from_proto(t) for t in c.top_logprobs], c.finish_reason)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        finally:
            call.cancel()  # a caller that went away cancels the stream, which frees the decode's blocks

    async def abort(self, request_id: str, timeout_s: float) -> AbortResult:
        try:
            reply = await self.stub.Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return AbortResult(reply.found, reply.ended)

    async def lend(self, block_hashes: list[int], lease_s: float, timeout_s: float, borrower: str = "") -> Loan:
        try:
            r = await self.stub.Lend(engine_pb2.LendRequest(block_hashes=block_hashes, lease_s=lease_s,
                                                            borrower=borrower), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return Loan(r.loan_id, list(r.block_ids), endpoint_from_proto(r.endpoint), layout_from_proto(r.layout),
                    r.lease_s)

    async def release(self, loan_id: str, timeout_s: float) -> bool:
        try:
            reply = await self.stub.Release(engine_pb2.ReleaseRequest(loan_id=loan_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return reply.found

    async def drain(self, drain: bool, timeout_s: float) -> tuple[str, int]:
        try:
            reply = await self.stub.Drain(engine_pb2.DrainRequest(drain=drain), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise engine_error(e) from None
        return STATE_OF.get(reply.state, el.SERVING), reply.drain_seq

    async def close(self, grace_s: float = 0.0) -> None:
        await self.channel.close(grace_s or None)
