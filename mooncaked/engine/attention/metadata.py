"""Per-step attention inputs, built once by the model runner and handed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of sequences; sequence i contributes ``q_lens[i]`` new tokens.

    Decodes (one new token) come first, then prefill chunks, so backends can run the two
    kinds as two contiguous slices.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    q_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # tokens in the cache per sequence after this step (prefix + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    num_decodes: int  # the first num_decodes sequences have q_len == 1
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32 (== ctx_lens)
    block_size: int
    # backend-private values that are the same for every layer (computed on first use)
    cache: dict[str, object] = field(default_factory=dict)



def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Scatter a step's new K/V ([T, Hkv, D]) into their cache slots; the same for every backend."""
    kh, d = k_cache.shape[-2:]
    k_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, v)
