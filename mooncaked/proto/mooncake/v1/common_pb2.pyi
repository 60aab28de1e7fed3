from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_CONDUCTOR: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_STORE: _ClassVar[Role]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_STARTING: _ClassVar[InstanceState]
    INSTANCE_STATE_SERVING: _ClassVar[InstanceState]
    INSTANCE_STATE_DRAINING: _ClassVar[InstanceState]
    INSTANCE_STATE_DEAD: _ClassVar[InstanceState]
ROLE_UNSPECIFIED: Role
ROLE_CONDUCTOR: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_STORE: Role
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_STARTING: InstanceState
INSTANCE_STATE_SERVING: InstanceState
INSTANCE_STATE_DRAINING: InstanceState
INSTANCE_STATE_DEAD: InstanceState

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "prompt_logprobs", "min_tokens", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    skip_special_tokens: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    min_tokens: int
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("queued_prefill_tokens", "running_requests", "waiting_requests", "free_kv_blocks", "total_kv_blocks", "prefix_hit_blocks", "prefix_query_blocks", "prefill_tokens_computed", "prompt_tokens_cached", "decode_tokens", "cached_kv_blocks", "preemptions")
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_hit_blocks: int
    prefix_query_blocks: int
    prefill_tokens_computed: int
    prompt_tokens_cached: int
    decode_tokens: int
    cached_kv_blocks: int
    preemptions: int
    def __init__(self, queued_prefill_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., prefix_hit_blocks: _Optional[int] = ..., prefix_query_blocks: _Optional[int] = ..., prefill_tokens_computed: _Optional[int] = ..., prompt_tokens_cached: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., cached_kv_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class TransferEndpoint(_message.Message):
    __slots__ = ("address", "backend", "region", "same_host_id", "shm_name", "key_server")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_SERVER_FIELD_NUMBER: _ClassVar[int]
    address: str
    backend: str
    region: str
    same_host_id: str
    shm_name: str
    key_server: str
    def __init__(self, address: _Optional[str] = ..., backend: _Optional[str] = ..., region: _Optional[str] = ..., same_host_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., key_server: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "element_size", "num_blocks", "bytes_per_block", "kv_stride_bytes", "layer_stride_bytes", "base_offset")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    num_blocks: int
    bytes_per_block: int
    kv_stride_bytes: int
    layer_stride_bytes: int
    base_offset: int
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., element_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., kv_stride_bytes: _Optional[int] = ..., layer_stride_bytes: _Optional[int] = ..., base_offset: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "medium", "instance", "parent_block_hash")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        KIND_STORED: _ClassVar[KVEvent.Kind]
        KIND_REMOVED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    KIND_STORED: KVEvent.Kind
    KIND_REMOVED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    instance: str
    parent_block_hash: int
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., instance: _Optional[str] = ..., parent_block_hash: _Optional[int] = ...) -> None: ...
