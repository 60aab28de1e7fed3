"""The native decode attention (csrc/paged_decode.cpp) against torch's gather + SDPA path, and in an engine."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.attention.metadata import AttentionMetadata
from mooncaked.engine.attention.torch_backend import TorchAttention
from native_kernels import native_or_skip
from tiny_models import random_prompts


def _kernel_or_skip():
    return native_or_skip().paged_decode_attention


def _decode_step(lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int = 16, blocks: int = 128,
                 seed: int = 0):
    """A paged cache whose unused slots hold NaN (a freed block's leftovers), sequences scattered over it."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.full((blocks, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    max_blocks = -(-max(lens) // block_size)
    order = torch.randperm(blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks).int()
    for i, n in enumerate(lens):
        slots = (order[i].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k_cache.view(-1, kv_heads, dim)[slots] = torch.randn(n, kv_heads, dim, generator=g)
        v_cache.view(-1, kv_heads, dim)[slots] = torch.randn(n, kv_heads, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    nd = len(lens)
    meta = AttentionMetadata(slot_mapping=torch.zeros(nd, dtype=torch.long), q_lens=[1] * nd, ctx_lens=lens,
                             block_tables=order, num_decodes=nd, cu_seqlens_q=torch.zeros(nd + 1, dtype=torch.int32),
                             cu_seqlens_k=torch.zeros(nd + 1, dtype=torch.int32),
                             context_lens=torch.tensor(lens, dtype=torch.int32), block_size=block_size)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (4, 1, 32)])
def test_native_decode_attention_equals_torchs_and_never_reads_past_a_length(heads, kv_heads, dim):
    kernel = _kernel_or_skip()
    lens = [1, 15, 16, 17, 100, 130, 2, 64]  # block edges, one token, lengths of many blocks
    q, k_cache, v_cache, meta = _decode_step(lens, heads, kv_heads, dim, seed=heads + dim)
    scale = dim ** -0.5
    want = TorchAttention(heads, kv_heads, dim, scale)._decode(q, k_cache, v_cache, meta)
    got = TorchAttention(heads, kv_heads, dim, scale, kernel)._decode(q, k_cache, v_cache, meta)
    assert torch.isfinite(got).all()  # the NaN past every length was never read
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_decode_attention_refuses_what_would_read_outside_the_cache():
    kernel = _kernel_or_skip()
    q, k_cache, v_cache, meta = _decode_step([20, 5], 4, 2, 32)
    tables, lens = meta.block_tables.contiguous(), meta.context_lens
    bad_block = tables.clone()
    bad_block[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, k_cache, v_cache, bad_block, lens, 0.1)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k_cache, v_cache, tables, torch.tensor([20, 33], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(q.double(), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        narrow = [t[..., :24].contiguous() for t in (q, k_cache, v_cache)]
        kernel(*narrow, tables, lens, 0.1)


def test_an_engine_decodes_the_same_tokens_with_the_native_kernel_as_with_torchs(tiny_model_factory):
    """The tiny llama (head_dim 16) in fp32: a batch of prompts of different lengths, decoded by the native
    kernel and by torch's path on the same engine, gives the same greedy tokens."""
    _kernel_or_skip()
    _, folder = tiny_model_factory("llama")
    engine = Engine.from_pretrained(folder, dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                                    max_num_batched_tokens=16, enable_prefix_caching=False)
    backend = engine.runner.backend
    assert backend.decode_kernel is not None
    prompts = random_prompts([3, 9, 17, 40, 70], seed=5)
    params = SamplingParams(max_tokens=12, min_tokens=12, ignore_eos=True)
    native = [o.token_ids for o in engine.generate(prompts, params)]
    backend.decode_kernel = None
    assert [o.token_ids for o in engine.generate(prompts, params)] == native
