from mooncaked.proto.mooncake.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("block_ids", "endpoint", "layout", "ttl_s")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    endpoint: _common_pb2.TransferEndpoint
    layout: _common_pb2.KVLayout
    ttl_s: float
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("found", "ttl_s")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    found: bool
    ttl_s: float
    def __init__(self, found: _Optional[bool] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_endpoint", "decode_block_ids", "decode_layout", "plan", "decode_address", "decode_ttl_s", "stage_addresses")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_endpoint: _common_pb2.TransferEndpoint
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_layout: _common_pb2.KVLayout
    plan: PrefillPlan
    decode_address: str
    decode_ttl_s: float
    stage_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., decode_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., plan: _Optional[_Union[PrefillPlan, _Mapping]] = ..., decode_address: _Optional[str] = ..., decode_ttl_s: _Optional[float] = ..., stage_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillPlan(_message.Message):
    __slots__ = ("reuse_blocks", "pull_from", "pull_blocks", "pull_address", "replicate", "pool_fallback", "helpers")
    REUSE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    POOL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    HELPERS_FIELD_NUMBER: _ClassVar[int]
    reuse_blocks: int
    pull_from: str
    pull_blocks: int
    pull_address: str
    replicate: bool
    pool_fallback: bool
    helpers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reuse_blocks: _Optional[int] = ..., pull_from: _Optional[str] = ..., pull_blocks: _Optional[int] = ..., pull_address: _Optional[str] = ..., replicate: _Optional[bool] = ..., pool_fallback: _Optional[bool] = ..., helpers: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_cached_tokens", "num_computed_tokens", "finished", "finish_reason", "compute_s", "push_bytes", "push_s", "first_top_logprobs", "local_blocks", "pulled_blocks", "pulled_from", "replicated", "deviations", "prompt_logprobs", "prompt_top_logprobs")
    class DeviationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_FROM_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    DEVIATIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: float
    num_cached_tokens: int
    num_computed_tokens: int
    finished: bool
    finish_reason: str
    compute_s: float
    push_bytes: int
    push_s: float
    first_top_logprobs: _common_pb2.TopLogprobs
    local_blocks: int
    pulled_blocks: int
    pulled_from: str
    replicated: bool
    deviations: _containers.ScalarMap[str, int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., compute_s: _Optional[float] = ..., push_bytes: _Optional[int] = ..., push_s: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., local_blocks: _Optional[int] = ..., pulled_blocks: _Optional[int] = ..., pulled_from: _Optional[str] = ..., replicated: _Optional[bool] = ..., deviations: _Optional[_Mapping[str, int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "first_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: float
    first_top_logprobs: _common_pb2.TopLogprobs
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found", "ended")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    ended: bool
    def __init__(self, found: _Optional[bool] = ..., ended: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("name", "role", "load", "layout", "uptime_s", "model_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.Role
    load: _common_pb2.InstanceLoad
    layout: _common_pb2.KVLayout
    uptime_s: float
    model_id: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., load: _Optional[_Union[_common_pb2.InstanceLoad, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., uptime_s: _Optional[float] = ..., model_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("state", "drain_seq")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SEQ_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.InstanceState
    drain_seq: int
    def __init__(self, state: _Optional[_Union[_common_pb2.InstanceState, str]] = ..., drain_seq: _Optional[int] = ...) -> None: ...

class CachedPrefixRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedPrefixReply(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class LendRequest(_message.Message):
    __slots__ = ("block_hashes", "lease_s", "borrower")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BORROWER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    borrower: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., borrower: _Optional[str] = ...) -> None: ...

class LendReply(_message.Message):
    __slots__ = ("loan_id", "block_ids", "endpoint", "layout", "lease_s")
    LOAN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    loan_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    endpoint: _common_pb2.TransferEndpoint
    layout: _common_pb2.KVLayout
    lease_s: float
    def __init__(self, loan_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("loan_id",)
    LOAN_ID_FIELD_NUMBER: _ClassVar[int]
    loan_id: str
    def __init__(self, loan_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StageOpenRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_endpoint", "decode_block_ids", "decode_layout", "decode_address", "decode_ttl_s", "downstream", "stage_index", "stage_count", "lead_cached_block_ids", "lead_endpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEAD_CACHED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEAD_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_endpoint: _common_pb2.TransferEndpoint
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_layout: _common_pb2.KVLayout
    decode_address: str
    decode_ttl_s: float
    downstream: _containers.RepeatedScalarFieldContainer[str]
    stage_index: int
    stage_count: int
    lead_cached_block_ids: _containers.RepeatedScalarFieldContainer[int]
    lead_endpoint: _common_pb2.TransferEndpoint
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., decode_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., decode_address: _Optional[str] = ..., decode_ttl_s: _Optional[float] = ..., downstream: _Optional[_Iterable[str]] = ..., stage_index: _Optional[int] = ..., stage_count: _Optional[int] = ..., lead_cached_block_ids: _Optional[_Iterable[int]] = ..., lead_endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ...) -> None: ...

class StageOpenReply(_message.Message):
    __slots__ = ("cached_blocks", "inbox", "inbox_offset", "row_bytes")
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INBOX_FIELD_NUMBER: _ClassVar[int]
    INBOX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    inbox: _common_pb2.TransferEndpoint
    inbox_offset: int
    row_bytes: int
    def __init__(self, cached_blocks: _Optional[int] = ..., inbox: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., inbox_offset: _Optional[int] = ..., row_bytes: _Optional[int] = ...) -> None: ...

class StageInputRequest(_message.Message):
    __slots__ = ("request_id", "start_tokens", "ready_tokens", "lead_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_tokens: int
    ready_tokens: int
    lead_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., start_tokens: _Optional[int] = ..., ready_tokens: _Optional[int] = ..., lead_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StageInputReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageFinishRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...
