"""Paged attention with torch's SDPA: any block size, CPU or GPU, no extra packages.

Decodes are batched into one SDPA call over their gathered blocks (the gather index is
built once per step and reused by every layer); on a CPU where our native kernels run, an fp32
cache is read in place instead (``decode_kernel``: csrc/paged_decode.cpp, no copy, no padding).
A prefill chunk with no cached context attends to its own new K/V directly; one with a cached
prefix gathers its blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncaked.engine.attention.metadata import AttentionMetadata, write_kv
from mooncaked.engine.native import DecodeAttention


class TorchAttention:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 decode_kernel: DecodeAttention | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.decode_kernel = decode_kernel

    store_kv = staticmethod(write_kv)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (already written to the cache). Returns [T, H, D]."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        start = nd
        for i in range(nd, len(meta.q_lens)):
            ql, cl = meta.q_lens[i], meta.ctx_lens[i]
            end = start + ql
            out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i, ql, cl)
            start = end
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        if self.decode_kernel is not None and q.dtype == k_cache.dtype == torch.float32 and q.device.type == "cpu":
            tables = meta.cache.get("decode_tables")
            if tables is None:  # once per step: every layer reads the same blocks
                tables = meta.cache["decode_tables"] = meta.block_tables[:nd].contiguous()
            return self.decode_kernel(q.contiguous(), k_cache, v_cache, tables, meta.context_lens[:nd], self.scale)
        tables, mask, beyond = meta.cache.get("decode") or meta.cache.setdefault("decode", self._decode_index(meta, q.dtype))  # type: ignore[misc]
        kh, d = self.num_kv_heads, self.head_dim
        # index_select on the block dim is a plain row copy; advanced indexing is several times slower
        flat = tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(-1, kh, d)  # [nd * L, Hkv, D], our own copy
        values = v_cache.index_select(0, flat).view(-1, kh, d)
        # slots past a sequence's length (the rest of its last block, padding) hold whatever a freed block
        # held: a masked score still multiplies its value, and 0 * NaN is NaN, so one request's broken KV
        # would poison every later request handed its blocks. Zero them (only those rows: a masked_fill
        # over the whole gathered copy cost 3x the attention itself).
        keys.index_fill_(0, beyond, 0)
        values.index_fill_(0, beyond, 0)
        # [nd * L, Hkv, D] -> [nd, Hkv, L, D]; the query heads sharing a KV head become its "query positions"
        keys = keys.view(nd, -1, kh, d).transpose(1, 2)
        values = values.view(nd, -1, kh, d).transpose(1, 2)
        qg = q.view(nd, kh, self.group, d)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return o.reshape(nd, self.num_heads, d)

    @staticmethod
    def _decode_index(meta: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per step, for every layer: the block tables, the [nd, 1, 1, L] additive mask (-inf past each
        sequence's length), and those rows' indices in the gathered [nd * L] positions."""
        nd = meta.num_decodes
        ctx = meta.context_lens[:nd]
        max_blocks = -(-max(meta.ctx_lens[:nd]) // meta.block_size)
        tables = meta.block_tables[:nd, :max_blocks].long()
        positions = torch.arange(max_blocks * meta.block_size, device=ctx.device)
        beyond = positions[None, :] >= ctx[:, None]  # [nd, L]
        # an additive mask: SDPA turns a boolean one into this on every call (every layer)
        mask = torch.zeros(beyond.shape, dtype=dtype, device=ctx.device).masked_fill_(beyond, float("-inf"))
        return tables, mask[:, None, None, :], beyond.reshape(-1).nonzero().squeeze(1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, i: int, ql: int, cl: int) -> torch.Tensor:
        kh, d = self.num_kv_heads, self.head_dim
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
        if cl == ql:
            keys, values = k, v
            mask = None
        else:
            nblocks = -(-cl // meta.block_size)
            table = meta.block_tables[i, :nblocks].long()
            keys = k_cache.index_select(0, table).view(-1, kh, d)[:cl]
            values = v_cache.index_select(0, table).view(-1, kh, d)[:cl]
            rows = torch.arange(cl - ql, cl, device=q.device)[:, None]
            mask = torch.arange(cl, device=q.device)[None, :] <= rows  # [ql, cl]
        kt = keys.transpose(0, 1).unsqueeze(0)
        vt = values.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qh, kt, vt, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.group > 1
        )
        return o.squeeze(0).transpose(0, 1)
