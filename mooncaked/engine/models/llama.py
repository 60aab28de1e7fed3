"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One file, written as plainly as the math: a block is two residual lines. Projections are
fused (q|k|v and gate|up) when the weights are loaded, so a layer is four matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.engine.attention import AttentionBackend, AttentionMetadata
from mooncaked.engine.config import ModelConfig
from mooncaked.engine.models.rope import RotaryEmbedding, apply_rotary
from mooncaked.engine.stage import PipelineStage

Rope = tuple[torch.Tensor, torch.Tensor]

LayerHook = Callable[[int, AttentionMetadata], None]

# prefill rows the MLP runs at once on CPU (MLP.forward)
MLP_CHUNK_ROWS = 512


class RMSNorm(nn.Module):
    # our native kernels (engine/native.py) where the model runs on a CPU that has them: one pass a row
    native = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _native_fits(self, x: torch.Tensor) -> bool:
        return (self.native is not None and x.dtype == self.weight.dtype == torch.float32 and x.dim() == 2
                and x.is_contiguous() and x.shape[1] % 16 == 0)

    def add_norm(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + r, norm(x + r))``: a residual add and the next sublayer's input, in one pass where native."""
        if self._native_fits(x) and r.dtype == x.dtype and r.shape == x.shape and r.is_contiguous():
            return self.native.add_rms_norm(x, r, self.weight, self.eps)
        h = x + r
        return h, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_fits(x):
            return self.native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: normalise in fp32 like the reference implementation
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    native = None  # as RMSNorm's: the rotary embedding in one pass

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        fused = self._rotate_bf16(x, rope)
        if fused is not None:  # the bf16 path's qkv rotated straight from bf16 (the same math, one pass)
            qk, v = fused
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            return self._attend(q, k, v, t, kv, meta)
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k rotated in one call: half the ops of a decode step's rotary
            qk = self._rotate(qk, rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:  # Qwen3 normalises q and k per head before rotating them
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q, k = apply_rotary(self.q_norm(q), *rope), apply_rotary(self.k_norm(k), *rope)  # type: ignore[misc]
        return self._attend(q, k, v, t, kv, meta)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv
        self.backend.store_kv(k, v, k_cache, v_cache, meta)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(o.reshape(t, self.q_size))

    def _rotate_bf16(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rotated q|k, v) in fp32 from the qkv projection's own bf16 output, where it gives one (bf16_out)."""
        raw = getattr(self.qkv_proj, "bf16_out", None)
        cos, sin = rope
        if (raw is None or self.native is None or self.q_norm is not None or self.head_dim % 32
                or cos.dtype != torch.float32):
            return None
        qkv = raw(x)
        if qkv is None:
            return None
        return self.native.qkv_rotary_bf16(qkv.contiguous(), cos.squeeze(1), sin.squeeze(1),
                                           self.num_heads + self.num_kv_heads, self.head_dim)

    def _rotate(self, qk: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin = rope
        if self.native is not None and qk.dtype == cos.dtype == torch.float32 and self.head_dim % 32 == 0:
            return self.native.rotary(qk, cos.squeeze(1), sin.squeeze(1))
        return apply_rotary(qk, cos, sin)


class MLP(nn.Module):
    native = None  # as RMSNorm's: silu(gate) * up straight from the bf16 path's bf16 output

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MLP_CHUNK_ROWS or x.device.type != "cpu":
            return self._rows(x)
        # on CPU, a long prefill's [tokens, 2 * intermediate] activations a few rows at a time: whole, they
        # outgrow glibc's largest reused chunk (32 MB), so every layer mmaps and page-faults them anew (a GPU
        # keeps its own cache of blocks, and wants the big GEMM)
        return torch.cat([self._rows(part) for part in x.split(MLP_CHUNK_ROWS)])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        # the bf16 path (engine/bf16_weights.py): its gate|up comes out in bf16 and the down projection rounds
        # its input to bf16, so the fp32 middle is one native pass from bf16 to bf16 (the same math)
        raw = getattr(self.gate_up_proj, "bf16_out", None) if self.native is not None and self.inter % 16 == 0 else None
        gu = raw(x) if raw is not None else None
        if gu is not None:
            return self.down_proj(self.native.silu_mul_bf16(gu.contiguous()))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h, n = self.post_attention_layernorm.add_norm(x, self.self_attn(self.input_layernorm(x), rope, kv, meta))
        return h + self.mlp(n)


class LlamaForCausalLM(nn.Module):
    """The whole model, or one pipeline stage's part of it (``stage``: a contiguous range of layers;
    the first stage has the embedding, the last the final norm and the head). A stage that is not
    the first takes the previous stage's hidden states instead of token ids; one that is not the
    last returns its hidden states un-normed, as the next stage's residual stream."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage or PipelineStage.of(0, 1, cfg.num_layers)
        self.first, self.last = self.stage.is_first, self.stage.is_last
        if self.first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(self.stage.num_stage_layers))
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and self.first:
                self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, torch.float32)

    def use_native(self, kernels) -> None:
        """Let the norms, rotary embeddings and MLP middles run our native kernels (engine/native.py; None:
        torch's ops)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.native = kernels

    def param_name(self, checkpoint_name: str) -> str | None:
        """Our parameter that a checkpoint tensor (``model.`` prefix removed) fills, or None when this
        stage does not hold it. Layer i of the checkpoint is this stage's layer i - first_layer."""
        st = self.stage
        if checkpoint_name.startswith("layers."):
            _, index, rest = checkpoint_name.split(".", 2)
            i = int(index)
            if not st.first_layer <= i < st.end_layer:
                return None
            return f"layers.{i - st.first_layer}.{rest}"
        if checkpoint_name == "embed_tokens.weight":
            if self.first:
                return checkpoint_name
            # a last stage without the embedding still needs the tied weights for its head
            return "lm_head.weight" if self.last and self.cfg.tie_word_embeddings else None
        if checkpoint_name in ("norm.weight", "lm_head.weight"):
            return checkpoint_name if self.last else None
        return checkpoint_name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                layer_hook: LayerHook | None = None, hidden_in: torch.Tensor | None = None,
                layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Hidden states of every new token; each layer's new K/V lands in ``kv_caches`` first.

        ``layer_hook(i, meta)`` runs right after (this stage's) layer i has written its K/V, which is
        where the prefill role starts pushing that layer to the decode instance. ``hidden_in``: the
        previous stage's hidden states of the new tokens (a stage that is not the first).
        ``layers``: run only layers [first, end) of the ones held (an elastic pipeline's share of a
        prompt on a whole-model engine): the embedding only from layer 0, the norm only to the last.
        """
        lo, hi = layers if layers is not None else (0, len(self.layers))
        if not 0 <= lo < hi <= len(self.layers):
            raise ValueError(f"layer range {lo}-{hi} is outside the {len(self.layers)} layers held")
        if self.first and lo == 0:
            x = self.embed_tokens(input_ids)
        else:
            if hidden_in is None or hidden_in.shape != (positions.shape[0], self.cfg.hidden_size):
                raise ValueError(f"stage {self.stage} (layers from {lo}) needs hidden states of shape "
                                 f"({positions.shape[0]}, {self.cfg.hidden_size})")
            x = hidden_in
        rope = self.rope.lookup(positions, x.dtype)
        for i in range(lo, hi):
            x = self.layers[i](x, rope, kv_caches[i], meta)
            if layer_hook is not None:
                layer_hook(i, meta)
        return self.norm(x) if self.last and hi == len(self.layers) else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def score_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits to score a prompt with: from the head's fp32 weights where it keeps them (the CPU
        default's head picks candidates with cheaper weights, by how many rows a call has), so a
        prompt's score does not depend on how its steps were cut."""
        weight = getattr(self.lm_head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            return F.linear(hidden.float(), weight)
        return self.compute_logits(hidden)
