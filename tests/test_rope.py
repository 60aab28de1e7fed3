"""Rotary embeddings (engine/models/rope.py): the four-op form over a full-width, signed table is bit for
bit the half-split formula HF applies, for plain and llama3-scaled frequencies, and for q and k rotated
together (the model rotates the q|k columns of one projection in one call)."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.config import RopeConfig
from mooncaked.engine.models.rope import RotaryEmbedding, apply_rotary, inverse_frequencies


def _half_split(x: torch.Tensor, rope: RopeConfig, positions: torch.Tensor) -> torch.Tensor:
    """The reference: HF's rotate_half layout, from the frequencies directly."""
    freqs = torch.outer(positions.float(), inverse_frequencies(rope, x.shape[-1]))
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("rope", [RopeConfig(theta=10000.0),
                                  RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                             original_max_position_embeddings=64)])
def test_rotation_equals_the_half_split_formula_bit_for_bit(rope):
    torch.manual_seed(75)
    table = RotaryEmbedding(rope, head_dim=32, max_positions=256, dtype=torch.float32)
    positions = torch.tensor([0, 1, 7, 100, 255])
    q, k = torch.randn(5, 6, 32), torch.randn(5, 2, 32)
    cos, sin = table.lookup(positions, torch.float32)
    assert torch.equal(apply_rotary(q, cos, sin), _half_split(q, rope, positions))
    qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)  # as the model does it: q|k heads in one call
    assert torch.equal(qk[:, :6], _half_split(q, rope, positions))
    assert torch.equal(qk[:, 6:], _half_split(k, rope, positions))
    assert not torch.equal(apply_rotary(q, cos, sin)[1:], q[1:])  # position 0 alone is the identity
