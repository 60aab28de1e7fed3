"""Conductor wire messages <-> the core's records (core.py, membership.py, status.py).

The gRPC servicer (roles/conductor.py) and the HTTP front (whose OpenAI parser builds a
``GenerateRequest``) both turn requests into a ``GenerateSpec`` here, so both accept alike.
"""

from __future__ import annotations

from mooncaked.conductor.core import DEFAULT_MAX_TOKENS, Chunk, GenerateSpec
from mooncaked.conductor.engine_link import (DEAD, DRAINING, REMOVED, SERVING, STARTING, STORED, DecodeSample,
                                             Heartbeat, InstanceLoad, KVEvent)
from mooncaked.conductor.errors import BadRequest
from mooncaked.conductor.grpc_engine import STATE_OF, endpoint_from_proto
from mooncaked.conductor.membership import Registration
from mooncaked.conductor.registry import PipelineMember
from mooncaked.conductor.status import ClusterStatus, ConductorInfo, InstanceInfo, StoreInfo
from mooncaked.engine import RequestError
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2
from mooncaked.convert import layout_from_proto, sampling_from_proto, top_to_proto

ROLE_NAMES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode"}
ROLE_ENUMS = {name: enum for enum, name in ROLE_NAMES.items()}
STATE_ENUMS = {STARTING: common_pb2.INSTANCE_STATE_STARTING, SERVING: common_pb2.INSTANCE_STATE_SERVING,
               DRAINING: common_pb2.INSTANCE_STATE_DRAINING, DEAD: common_pb2.INSTANCE_STATE_DEAD}
_EVENT_KINDS = {common_pb2.KVEvent.KIND_STORED: STORED, common_pb2.KVEvent.KIND_REMOVED: REMOVED}
_EVENT_ENUMS = {kind: enum for enum, kind in _EVENT_KINDS.items()}
_LOAD_FIELDS = tuple(InstanceLoad.__dataclass_fields__)


def spec_from_proto(request: conductor_pb2.GenerateRequest, timeout_s: float | None = None,
                    front: str = "grpc") -> GenerateSpec:
    """Raises ``BadRequest`` for sampling the engine cannot honour."""
    try:
        sampling = sampling_from_proto(request.sampling, DEFAULT_MAX_TOKENS)
    except (RequestError, ValueError) as e:
        raise BadRequest(str(e)) from None
    spec = GenerateSpec(request_id=request.request_id, raw=request.raw, sampling=sampling, timeout_s=timeout_s,
                        front=front)
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        spec.token_ids = list(request.token_ids.ids)
    elif kind == "messages":
        spec.messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    elif kind == "prompt":
        spec.prompt = request.prompt
    return spec


def chunk_to_proto(c: Chunk) -> conductor_pb2.GenerateChunk:
    return conductor_pb2.GenerateChunk(
        token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs,
        top_logprobs=[top_to_proto(t) for t in c.top_logprobs], request_id=c.request_id,
        prompt_tokens=c.prompt_tokens, num_cached_tokens=c.cached_tokens, prefill_instance=c.prefill_instance,
        decode_instance=c.decode_instance, prompt_token_ids=c.prompt_token_ids, prompt_logprobs=c.prompt_logprobs,
        prompt_top_logprobs=[top_to_proto(t) for t in c.prompt_top_logprobs])


def load_from_proto(p: common_pb2.InstanceLoad) -> InstanceLoad:
    return InstanceLoad(*(getattr(p, f) for f in _LOAD_FIELDS))


def load_to_proto(load: InstanceLoad) -> common_pb2.InstanceLoad:
    return common_pb2.InstanceLoad(**{f: getattr(load, f) for f in _LOAD_FIELDS})


def registration_from_proto(r: conductor_pb2.RegisterRequest) -> Registration:
    member = pipeline_from_proto(r.pipeline) if r.HasField("pipeline") else None
    return Registration(r.name, ROLE_NAMES.get(r.role, ""), r.address, r.model_id, layout_from_proto(r.layout),
                        endpoint_from_proto(r.transfer), member, r.step_tokens)


def pipeline_from_proto(p: conductor_pb2.PipelineMember) -> PipelineMember:
    return PipelineMember(p.group, p.stage, p.stages, p.chunk_tokens)


def pipeline_to_proto(m: PipelineMember) -> conductor_pb2.PipelineMember:
    return conductor_pb2.PipelineMember(group=m.group, stage=m.stage, stages=m.stages, chunk_tokens=m.chunk_tokens)


def heartbeat_from_proto(r: conductor_pb2.HeartbeatRequest) -> Heartbeat:
    return Heartbeat(
        r.name, load_from_proto(r.load), STATE_OF.get(r.state, ""),
        [KVEvent(_EVENT_KINDS.get(e.kind, ""), list(e.block_hashes), e.medium, e.instance) for e in r.events],
        [DecodeSample(s.batch, s.context_tokens, s.seconds) for s in r.decode_samples], r.drain_seq)


def heartbeat_to_proto(hb: Heartbeat) -> conductor_pb2.HeartbeatRequest:
    """An engine's heartbeat on the wire (the engine side of ``heartbeat_from_proto``)."""
    return conductor_pb2.HeartbeatRequest(
        name=hb.name, load=load_to_proto(hb.load), state=STATE_ENUMS.get(hb.state, common_pb2.INSTANCE_STATE_SERVING),
        events=[common_pb2.KVEvent(kind=_EVENT_ENUMS[e.kind], block_hashes=e.block_hashes, medium=e.medium,
                                   instance=e.instance) for e in hb.events],
        decode_samples=[conductor_pb2.DecodeSample(batch=s.batch, context_tokens=s.context_tokens, seconds=s.seconds)
                        for s in hb.decode_samples], drain_seq=hb.drain_seq)


def _instance(i: InstanceInfo) -> conductor_pb2.InstanceInfo:
    return conductor_pb2.InstanceInfo(name=i.name, role=ROLE_ENUMS.get(i.role, common_pb2.ROLE_UNSPECIFIED),
                                      address=i.address, state=STATE_ENUMS.get(i.state, 0),
                                      load=load_to_proto(i.load), uptime_s=i.uptime_s,
                                      last_heartbeat_age_s=i.last_heartbeat_age_s, model_id=i.model_id,
                                      pipeline=pipeline_to_proto(i.pipeline) if i.pipeline is not None else None,
                                      lent_to=i.lent_to)


def _conductor(c: ConductorInfo) -> conductor_pb2.ConductorInfo:
    return conductor_pb2.ConductorInfo(address=c.address, http_address=c.http_address, policy=c.policy,
                                       ttft_slo_s=c.ttft_slo_s or 0.0, tbt_slo_s=c.tbt_slo_s or 0.0,
                                       requests_in_flight=c.requests_in_flight, rejections=c.rejections,
                                       state=c.state, ready_timeout_s=c.ready_timeout_s)


def _store(s: StoreInfo) -> conductor_pb2.StoreInfo:
    return conductor_pb2.StoreInfo(
        address=s.address, reachable=s.reachable, error=s.error, epoch=s.epoch, segments=s.segments,
        objects=s.objects, hits=s.hits, misses=s.misses, evictions=s.evictions, clients=s.clients,
        tiers=[conductor_pb2.TierUse(medium=t.medium, segments=t.segments, used=t.used, capacity=t.capacity,
                                     objects=t.objects) for t in s.tiers])


def status_to_proto(s: ClusterStatus) -> conductor_pb2.StatusReply:
    reply = conductor_pb2.StatusReply(instances=[_instance(i) for i in s.instances], model_id=s.model_id,
                                      uptime_s=s.uptime_s, conductor=_conductor(s.conductor))
    if s.store is not None:
        reply.store.CopyFrom(_store(s.store))
    return reply
