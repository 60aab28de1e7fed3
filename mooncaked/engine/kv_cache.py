"""The paged KV pool: one tensor holding every layer's K and V blocks.

Layout ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: each layer's
K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views (flash-attn's
paged layout), and one allocation makes the whole pool one registrable memory region for
the transfer engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mooncaked.engine.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def plan_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                    kv_cache_bytes: int | None, gpu_memory_fraction: float) -> int:
    """Blocks that fit in the budget: an explicit byte count, or a share of free GPU memory."""
    if kv_cache_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * gpu_memory_fraction)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
    n = kv_cache_bytes // bytes_per_block(cfg, block_size, dtype)
    if n < 1:
        raise ConfigError(  # a ValueError: the user's setting
            f"kv_cache_bytes={kv_cache_bytes} holds no block of {bytes_per_block(cfg, block_size, dtype)} bytes; "
            "give more KV memory or a smaller block_size"
        )
    return int(n)


@dataclass
class KVCache:
    pool: torch.Tensor  # [L, 2, N, bs, Hkv, D]

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, pool: torch.Tensor | None = None) -> "KVCache":
        """Zeroed pool (zeroing also prefaults every page, so no fault lands on the hot path).

        ``pool`` lets a caller hand in memory it allocated itself (e.g. shared memory that a
        transfer backend registered); it is reshaped, not copied.
        """
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if pool is None:
            pool = torch.zeros(shape, dtype=dtype, device=device)
        else:
            pool = pool.view(dtype).view(shape)
            pool.zero_()
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size,
                 pool.numel() * pool.element_size() / 2**20)
        return cls(pool)

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]

    @property
    def block_size(self) -> int:
        return self.pool.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool[i, 0], self.pool[i, 1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.layer(i) for i in range(self.pool.shape[0])]

    def layout(self) -> "KVLayout":
        return KVLayout.of(self.pool)


@dataclass(frozen=True)
class KVLayout:
    """Where (layer, K|V, block, token) lives in the pool's bytes; what a peer needs to address it."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int

    @classmethod
    def of(cls, pool: torch.Tensor) -> "KVLayout":
        layers, _, blocks, bs, heads, dim = pool.shape
        return cls(layers, blocks, bs, heads, dim, str(pool.dtype).removeprefix("torch."), pool.element_size())

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """One block of one layer, K or V."""
        return self.block_size * self.token_bytes

    @property
    def whole_block_bytes(self) -> int:
        """One block of every layer, K and V: what a pull moves and a pool object holds."""
        return 2 * self.num_layers * self.block_bytes

    @property
    def kv_stride(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def layer_stride(self) -> int:
        return 2 * self.kv_stride

    def offset(self, layer: int, kv: int, block: int, token: int = 0) -> int:
        return layer * self.layer_stride + kv * self.kv_stride + block * self.block_bytes + token * self.token_bytes

    def compatible(self, other: "KVLayout", num_layers: int | None = None) -> str | None:
        """Why KV cannot be copied between the two pools block for block, or None. ``num_layers``: a
        pipeline stage's pool holds a range of the model's layers; ``other`` must hold all of them."""
        if num_layers is not None and other.num_layers != num_layers:
            return f"num_layers differs: the model has {num_layers} here, {other.num_layers} there"
        names = ("block_size", "num_kv_heads", "head_dim", "dtype")
        for name in names if num_layers is not None else ("num_layers", *names):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)} here, {getattr(other, name)} there"
        return None
