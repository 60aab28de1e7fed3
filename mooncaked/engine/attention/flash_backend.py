"""Paged attention with flash-attn's CUDA kernels (optional extra ``mooncaked[gpu]``).

Prefill chunks (with or without a cached prefix) go through ``flash_attn_varlen_func``
with the block table; decodes through ``flash_attn_with_kvcache``. flash-attn's paged
kernels need a block size that is a multiple of 256.
"""

from __future__ import annotations

import importlib.util

import torch

from mooncaked.engine.attention.metadata import AttentionMetadata, write_kv

FLASH_BLOCK_MULTIPLE = 256


def flash_unavailable_reason(device: str | torch.device, block_size: int) -> str | None:
    """Why the flash backend cannot run here, or None when it can."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return "the flash backend needs a CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'mooncaked[gpu]')"
    if block_size % FLASH_BLOCK_MULTIPLE:
        return f"flash-attn's paged kernels need block_size to be a multiple of {FLASH_BLOCK_MULTIPLE}, got {block_size}"
    return None


class FlashAttention:
    name = "flash"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # lazy: GPU extra

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    store_kv = staticmethod(write_kv)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            o = self._with_kvcache(
                q[:nd].unsqueeze(1), k_cache, v_cache,
                cache_seqlens=meta.context_lens[:nd], block_table=meta.block_tables[:nd],
                softmax_scale=self.scale, causal=True,
            )
            out[:nd] = o.squeeze(1)
        if nd < len(meta.q_lens):
            cu_q = meta.cu_seqlens_q[nd:] - meta.cu_seqlens_q[nd]
            cu_k = meta.cu_seqlens_k[nd:] - meta.cu_seqlens_k[nd]
            out[nd:] = self._varlen(
                q[nd:], k_cache, v_cache,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(meta.q_lens[nd:]), max_seqlen_k=max(meta.ctx_lens[nd:]),
                softmax_scale=self.scale, causal=True, block_table=meta.block_tables[nd:],
            )
        return out
