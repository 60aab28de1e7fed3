from mooncaked.proto.mooncake.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "messages", "raw", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: TokenIds
    messages: ChatMessages
    raw: bool
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., raw: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "prompt_tokens", "num_cached_tokens", "logprobs", "prefill_instance", "decode_instance", "request_id", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    num_cached_tokens: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    prefill_instance: str
    decode_instance: str
    request_id: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., request_id: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("without_pool_stats",)
    WITHOUT_POOL_STATS_FIELD_NUMBER: _ClassVar[int]
    without_pool_stats: bool
    def __init__(self, without_pool_stats: _Optional[bool] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("name", "role", "address", "state", "load", "uptime_s", "last_heartbeat_age_s", "model_id", "pipeline", "lent_to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    LENT_TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.Role
    address: str
    state: _common_pb2.InstanceState
    load: _common_pb2.InstanceLoad
    uptime_s: float
    last_heartbeat_age_s: float
    model_id: str
    pipeline: PipelineMember
    lent_to: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.InstanceState, str]] = ..., load: _Optional[_Union[_common_pb2.InstanceLoad, _Mapping]] = ..., uptime_s: _Optional[float] = ..., last_heartbeat_age_s: _Optional[float] = ..., model_id: _Optional[str] = ..., pipeline: _Optional[_Union[PipelineMember, _Mapping]] = ..., lent_to: _Optional[str] = ...) -> None: ...

class ConductorInfo(_message.Message):
    __slots__ = ("address", "http_address", "policy", "ttft_slo_s", "tbt_slo_s", "requests_in_flight", "rejections", "state", "ready_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    http_address: str
    policy: str
    ttft_slo_s: float
    tbt_slo_s: float
    requests_in_flight: int
    rejections: int
    state: str
    ready_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., http_address: _Optional[str] = ..., policy: _Optional[str] = ..., ttft_slo_s: _Optional[float] = ..., tbt_slo_s: _Optional[float] = ..., requests_in_flight: _Optional[int] = ..., rejections: _Optional[int] = ..., state: _Optional[str] = ..., ready_timeout_s: _Optional[float] = ...) -> None: ...

class TierUse(_message.Message):
    __slots__ = ("medium", "segments", "used", "capacity", "objects")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    medium: str
    segments: int
    used: int
    capacity: int
    objects: int
    def __init__(self, medium: _Optional[str] = ..., segments: _Optional[int] = ..., used: _Optional[int] = ..., capacity: _Optional[int] = ..., objects: _Optional[int] = ...) -> None: ...

class StoreInfo(_message.Message):
    __slots__ = ("address", "reachable", "error", "epoch", "segments", "objects", "tiers", "hits", "misses", "evictions", "clients")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    reachable: bool
    error: str
    epoch: int
    segments: int
    objects: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUse]
    hits: int
    misses: int
    evictions: int
    clients: int
    def __init__(self, address: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., segments: _Optional[int] = ..., objects: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUse, _Mapping]]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., clients: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("instances", "model_id", "uptime_s", "conductor", "store")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    model_id: str
    uptime_s: float
    conductor: ConductorInfo
    store: StoreInfo
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., model_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., conductor: _Optional[_Union[ConductorInfo, _Mapping]] = ..., store: _Optional[_Union[StoreInfo, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "role", "address", "model_id", "layout", "transfer", "pipeline", "step_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.Role
    address: str
    model_id: str
    layout: _common_pb2.KVLayout
    transfer: _common_pb2.TransferEndpoint
    pipeline: PipelineMember
    step_tokens: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., transfer: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., pipeline: _Optional[_Union[PipelineMember, _Mapping]] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class PipelineMember(_message.Message):
    __slots__ = ("group", "stage", "stages", "chunk_tokens")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group: str
    stage: int
    stages: int
    chunk_tokens: int
    def __init__(self, group: _Optional[str] = ..., stage: _Optional[int] = ..., stages: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DecodeSample(_message.Message):
    __slots__ = ("batch", "context_tokens", "seconds")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    context_tokens: int
    seconds: float
    def __init__(self, batch: _Optional[int] = ..., context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "load", "state", "events", "decode_samples", "drain_seq")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SEQ_FIELD_NUMBER: _ClassVar[int]
    name: str
    load: _common_pb2.InstanceLoad
    state: _common_pb2.InstanceState
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVEvent]
    decode_samples: _containers.RepeatedCompositeFieldContainer[DecodeSample]
    drain_seq: int
    def __init__(self, name: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.InstanceLoad, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.InstanceState, str]] = ..., events: _Optional[_Iterable[_Union[_common_pb2.KVEvent, _Mapping]]] = ..., decode_samples: _Optional[_Iterable[_Union[DecodeSample, _Mapping]]] = ..., drain_seq: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class SetDrainRequest(_message.Message):
    __slots__ = ("name", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain: bool
    def __init__(self, name: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class SetDrainReply(_message.Message):
    __slots__ = ("state", "name")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.InstanceState
    name: str
    def __init__(self, state: _Optional[_Union[_common_pb2.InstanceState, str]] = ..., name: _Optional[str] = ...) -> None: ...
