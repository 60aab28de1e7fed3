"""Attention backends behind one interface: ``store_kv`` then ``forward`` per layer."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from mooncaked.engine.attention.flash_backend import flash_unavailable_reason
from mooncaked.engine.attention.metadata import AttentionMetadata
from mooncaked.engine.attention.torch_backend import TorchAttention
from mooncaked.engine.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend", "flash_unavailable_reason"]


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


def make_backend(choice: str, device: str | torch.device, block_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float) -> AttentionBackend:
    """``auto`` takes flash where it can run and says why not otherwise."""
    if choice not in ("auto", "flash", "torch"):
        raise ValueError(f"unknown attention backend {choice!r}; expected auto, flash or torch")
    if choice in ("auto", "flash"):
        reason = flash_unavailable_reason(device, block_size)
        if reason is None:
            from mooncaked.engine.attention.flash_backend import FlashAttention

            return FlashAttention(num_heads, num_kv_heads, head_dim, scale)
        if choice == "flash":
            raise ConfigError(f"attention backend 'flash' cannot run: {reason}; use auto or torch")
        if torch.device(device).type == "cuda":
            log.warning("using the torch attention backend: %s", reason)
    kernel = None
    # on CPU an fp32 cache's decodes are read in place (csrc/paged_decode.cpp: head_dim in 16-float vectors)
    if torch.device(device).type == "cpu" and head_dim % 16 == 0:
        from mooncaked.engine.native import decode_attention_kernel

        kernel = decode_attention_kernel()
    return TorchAttention(num_heads, num_kv_heads, head_dim, scale, kernel)
