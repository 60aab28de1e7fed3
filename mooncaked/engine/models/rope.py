"""Rotary position embeddings, including llama3-style frequency scaling."""

from __future__ import annotations

import math

import torch

from mooncaked.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Meta's llama3 scaling: long wavelengths are divided by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds a cos/sin table for every position up to ``max_positions``; applied in the HF half-split layout.

    The table is stored full width, the sine signed (``[-sin, sin]``), so that a rotation is four ops
    (``x * cos + roll(x) * sin``) instead of eight: on CPU a decode step is bound by per-op overhead,
    and the results are bit for bit the half-split formula's (``a - b`` is ``a + (-b)`` in IEEE)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos and signed sin rows for a step's positions, ``[T, 1, D]``: looked up once, used
        by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, H, D]) by the looked-up angles, in the HF half-split layout:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``, with ``roll`` swapping the halves and ``sin`` signed."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
