"""Between wire messages and the engine's own types (one place, so each side keeps its vocabulary)."""

from __future__ import annotations

from mooncaked.engine import SamplingParams
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.engine.outputs import TopLogprobs
from mooncaked.proto.mooncake.v1 import common_pb2


def sampling_from_proto(p: common_pb2.SamplingParams, default_max_tokens: int = 256) -> SamplingParams:
    """Raises RequestError (-> INVALID_ARGUMENT) for values the engine cannot honour."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else default_max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        logit_bias=dict(p.logit_bias),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        min_tokens=p.min_tokens,
        grammar=p.grammar if p.HasField("grammar") else None,
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, logprobs=s.logprobs,
        skip_special_tokens=s.skip_special_tokens, top_logprobs=s.top_logprobs, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=s.logit_bias, min_tokens=s.min_tokens,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.repetition_penalty != 1:
        p.repetition_penalty = s.repetition_penalty
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.grammar is not None:
        p.grammar = s.grammar
    return p


def top_to_proto(top: TopLogprobs) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_from_proto(p: common_pb2.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(list(p.token_ids), list(p.logprobs))


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_layers=layout.num_layers, block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, dtype=layout.dtype, element_size=layout.element_size,
        num_blocks=layout.num_blocks, bytes_per_block=layout.block_bytes, kv_stride_bytes=layout.kv_stride,
        layer_stride_bytes=layout.layer_stride, base_offset=0,
    )


def layout_from_proto(p: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(p.num_layers, p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim, p.dtype, p.element_size)
