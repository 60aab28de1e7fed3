"""The Engine gRPC service of a prefill or decode instance: wiring only.

Each method turns the request message into the dataclasses of ``conductor/engine_link.py``,
calls the instance's ``Worker`` (``mooncaked/instance/``: reservations, the prefill's plan, KV
push and pulls, decode streams, lending), and turns the answer back into a message, or its
``EngineError`` into the gRPC status of its kind (``grpc_engine.STATUS_OF``). ``PeerLinks`` is
how a prefill reaches the peer its plan pulls from: one gRPC link per address.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict

import grpc

from mooncaked.conductor.engine_link import EngineError, PrefillResult, Reservation, StageOpen
from mooncaked.conductor.grpc_engine import (STATUS_OF, GrpcEngineLink, endpoint_from_proto, endpoint_to_proto,
                                             plan_from_proto, result_to_proto)
from mooncaked.conductor.wire import STATE_ENUMS, load_to_proto
from mooncaked.convert import layout_from_proto, layout_to_proto, sampling_from_proto, top_from_proto, top_to_proto
from mooncaked.engine import Engine, RequestError
from mooncaked.instance.decode import RESERVATION_TTL_S
from mooncaked.instance.heartbeat import instance_load
from mooncaked.instance.pool_cache import PoolCache
from mooncaked.instance.worker import Worker
from mooncaked.proto.mooncake.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from mooncaked.security import Security
from mooncaked.tasks import spawn
from mooncaked.transfer import TransferEngine

log = logging.getLogger(__name__)

MAX_PEER_LINKS = 64
PEER_LINK_GRACE_S = 1.0
async def _refuse(context: grpc.aio.ServicerContext, e: EngineError) -> None:
    await context.abort(STATUS_OF.get(e.kind, grpc.StatusCode.INTERNAL), e.detail or e.kind)


class PeerLinks:
    """gRPC links to peer engines by address, made on first use and kept (a plan's ``pull_address``);
    the least recently used beyond ``MAX_PEER_LINKS`` are closed (a cluster's prefills are few)."""

    def __init__(self, security: Security | None = None) -> None:
        self.security = security
        self.links: OrderedDict[str, GrpcEngineLink] = OrderedDict()

    def get(self, address: str) -> GrpcEngineLink:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = GrpcEngineLink(address, self.security)
            while len(self.links) > MAX_PEER_LINKS:
                _, old = self.links.popitem(last=False)
                spawn(old.close(PEER_LINK_GRACE_S), "close-peer-link")
        self.links.move_to_end(address)
        return link

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        self.links.clear()


class WorkerService(engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str, role: str, engine: Engine, transfer: TransferEngine, model_id: str,
                 kv_push: str = "layerwise", store=None, reservation_ttl_s: float = RESERVATION_TTL_S,
                 peers: PeerLinks | None = None) -> None:
        self.peers = peers or PeerLinks()
        self.worker = Worker(name, role, engine, transfer, model_id, kv_push=kv_push,
                             pool=PoolCache(store, engine, model_id) if store is not None else None,
                             peers=self.peers.get, reservation_ttl_s=reservation_ttl_s)

    # what the role (and tests) read of the instance
    @property
    def name(self) -> str:
        return self.worker.name

    @name.setter
    def name(self, value: str) -> None:
        self.worker.name = value

    @property
    def layout(self):
        return self.worker.layout

    @property
    def model_id(self) -> str:
        return self.worker.model_id

    @property
    def reserved(self) -> dict:
        return self.worker.decoder.reserved

    def expire_reservations(self):
        return self.worker.expire_forever()

    def endpoint(self) -> common_pb2.TransferEndpoint:
        return endpoint_to_proto(self.worker.endpoint())

    def load(self) -> common_pb2.InstanceLoad:
        return load_to_proto(instance_load(self.worker))

    def state(self) -> int:
        return STATE_ENUMS[self.worker.state()]

    # -- decode side ------------------------------------------------------------------------
    async def Reserve(self, request, context):
        try:
            params = sampling_from_proto(request.sampling)
            res = await self.worker.reserve(request.request_id, list(request.prompt_token_ids), params)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await _refuse(context, e)
        return engine_pb2.ReserveReply(block_ids=res.block_ids, endpoint=endpoint_to_proto(res.endpoint),
                                       layout=layout_to_proto(res.layout), ttl_s=res.ttl_s)

    async def Renew(self, request, context):
        """The prefill writing this reservation still runs: keep its blocks another TTL."""
        ttl = self.worker.renew(request.request_id)
        return engine_pb2.RenewReply(found=ttl is not None, ttl_s=ttl or 0.0)

    async def Decode(self, request, context):
        first = PrefillResult(first_token_id=request.first_token_id, first_logprob=request.first_logprob,
                              first_top_logprobs=top_from_proto(request.first_top_logprobs)
                              if request.HasField("first_top_logprobs") else None)
        try:
            # a caller that goes away closes this handler, which closes the stream: the request stops
            async with contextlib.aclosing(self.worker.decode(request.request_id, first)) as stream:
                async for c in stream:
                    yield engine_pb2.TokenChunk(token_ids=c.token_ids, text=c.text, logprobs=c.logprobs,
                                                top_logprobs=[top_to_proto(t) for t in c.top_logprobs],
                                                finish_reason=c.finish_reason)
        except EngineError as e:
            await _refuse(context, e)

    # -- prefill side -----------------------------------------------------------------------
    async def Prefill(self, request, context):
        try:
            params = sampling_from_proto(request.sampling)
            target = Reservation(list(request.decode_block_ids), endpoint_from_proto(request.decode_endpoint),
                                 layout_from_proto(request.decode_layout), request.decode_ttl_s,
                                 request.decode_address)
            plan = plan_from_proto(request.plan) if request.HasField("plan") else None
            result = await self.worker.prefill(request.request_id, list(request.prompt_token_ids), params, target,
                                               plan, list(request.stage_addresses))
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await _refuse(context, e)
        return result_to_proto(result)

    # -- a later stage of a CPP prefill group --------------------------------------------------
    async def StageOpen(self, request, context):
        try:
            target = Reservation(list(request.decode_block_ids), endpoint_from_proto(request.decode_endpoint),
                                 layout_from_proto(request.decode_layout), request.decode_ttl_s,
                                 request.decode_address)
            opening = StageOpen(request.request_id, list(request.prompt_token_ids),
                                sampling_from_proto(request.sampling), target, list(request.downstream))
            if request.stage_count:  # elastic CPP: this whole-model instance is lent to one prompt
                opening.elastic = (request.stage_index, request.stage_count)
                opening.lead_cached = list(request.lead_cached_block_ids)
                opening.lead_endpoint = (endpoint_from_proto(request.lead_endpoint)
                                         if request.HasField("lead_endpoint") else None)
            opened = await self.worker.stage_open(opening)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await _refuse(context, e)
        return engine_pb2.StageOpenReply(cached_blocks=opened.cached_blocks, inbox=endpoint_to_proto(opened.inbox),
                                         inbox_offset=opened.inbox_offset, row_bytes=opened.row_bytes)

    async def StageInput(self, request, context):
        try:
            await self.worker.stage_input(request.request_id, request.start_tokens, request.ready_tokens,
                                          list(request.lead_block_ids))
        except EngineError as e:
            await _refuse(context, e)
        return engine_pb2.StageInputReply()

    async def StageFinish(self, request, context):
        try:
            result = await self.worker.stage_finish(request.request_id)
        except EngineError as e:
            await _refuse(context, e)
        return result_to_proto(result)

    # -- either -----------------------------------------------------------------------------
    async def Abort(self, request, context):
        r = await self.worker.abort(request.request_id)
        return engine_pb2.AbortReply(found=r.found, ended=r.ended)

    async def Lend(self, request, context):
        try:
            loan = await self.worker.lend(list(request.block_hashes), request.lease_s, request.borrower)
        except EngineError as e:
            await _refuse(context, e)
        return engine_pb2.LendReply(loan_id=loan.loan_id, block_ids=loan.block_ids,
                                    endpoint=endpoint_to_proto(loan.endpoint), layout=layout_to_proto(loan.layout),
                                    lease_s=loan.lease_s)

    async def Release(self, request, context):
        return engine_pb2.ReleaseReply(found=await self.worker.release(request.loan_id))

    async def Stats(self, request, context):
        w = self.worker
        role = common_pb2.ROLE_PREFILL if w.role == "prefill" else common_pb2.ROLE_DECODE
        return engine_pb2.StatsReply(name=w.name, role=role, load=self.load(), layout=layout_to_proto(w.layout),
                                     uptime_s=time.monotonic() - w.started,
                                     model_id=w.model_id)

    async def Drain(self, request, context):
        state, seq = self.worker.drain(request.drain)
        return engine_pb2.DrainReply(state=STATE_ENUMS[state], drain_seq=seq)

    async def CachedPrefix(self, request, context):
        return engine_pb2.CachedPrefixReply(num_blocks=self.worker.cached_prefix(list(request.block_hashes)))
