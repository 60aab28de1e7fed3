"""Weight-only quantization of the model's linear layers, done at load time (no new file format).

Modes: "bf16" (engine/bf16_weights.py: bf16 weights, fp32 for the head's best candidates), "fp16",
"int8", "int4" (here); every mode's head rescores its best candidates in fp32 (CandidateHead).

Why: a CPU decode step is bound by the bytes of weights it reads; int8 reads a quarter of fp32's,
int4 (groups of 32) about a sixth. The kernels are torch's own (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, as gpt-fast uses them); on AVX2 they are fast only with bf16
activations, so a quantized layer casts its input to bf16 and its output back, while the residual
stream, norms, attention and the KV cache stay in the model's dtype. For many rows at once
(prefill) the kernels lose to an fp32 GEMM, so there the layer uses the fp32 weights it kept
(``dense``, where memory allows) or dequantizes its own on the fly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.engine.bf16_weights import EXACT_ROWS, Bf16Linear, CandidateHead
from mooncaked.engine.config import ConfigError
from mooncaked.engine.four_bit import (
    FOUR_BIT_ROWS,
    INT4_GROUP,
    INT4_ROWS,
    FourBitFp32,
    FourBitPair,
    dequantize_int4,
    exact_four_bit,
    quantize_int4,
)

log = logging.getLogger(__name__)

QUANTIZE_MODES: tuple[str, ...] = ("none", "bf16", "int8", "int4", "fp16")
# rows at or below which the quantized kernel beats dequantize + fp32 GEMM (measured on AVX2, 2 cores)
SMALL_M = {"int8": 64, "int4": 64, "fp16": 64}
# share of the free memory the fp32 weights may keep using so that prefill runs an fp32 GEMM (int8, int4,
# and fp16, whose prefill multiplies the fp16 grid widened to fp32)
DENSE_SHARE = 0.25


def check_quantize(mode: str, device: str) -> str:
    if mode not in QUANTIZE_MODES:
        raise ConfigError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if mode != "none" and torch.device(device).type != "cpu":
        raise ConfigError(f"quantize={mode} is a CPU path; use quantize=none on {device}")
    return mode


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ≈ q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class QuantLinear(nn.Module):
    """A drop-in for ``nn.Linear`` (forward only) holding quantized weights.

    ``dense``: keep the fp32 weights for calls of more than ``small_m`` rows (prefill), where an fp32
    GEMM beats the quantized kernel; without it such calls dequantize the weights each time."""

    def __init__(self, linear: nn.Linear, mode: str, dense: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.mode = mode
        self.out_features, self.in_features = w.shape
        self.small_m = SMALL_M[mode]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.dense = w if dense else None  # shares the loaded tensor: no copy
        if mode == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
            self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        else:
            q, scale, zero = quantize_int4(w)
            if not dense:  # unpacked, for the big-M path's dequantization
                self.register_buffer("q", q)
                self.register_buffer("scale", scale)
                self.register_buffer("zero", zero)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.register_buffer("packed", packed)
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
            self.register_buffer("scales_zeros", sz.to(torch.bfloat16))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dense is not None:
            return self.dense.to(dtype)
        if self.mode == "int8":
            return (self.q.to(dtype) * self.scale[:, None].to(dtype))
        return dequantize_int4(self.q, self.scale, self.zero).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.small_m:
            y = F.linear(x2, self.dequantized(x.dtype))
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.q, self.scale_bf16).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, INT4_GROUP,
                                                           self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Fp16Linear(nn.Module):
    """A drop-in for ``nn.Linear`` (forward only): fp16 weights, fp32 activations and output.

    fbgemm's fp16 GEMM (``quantized::linear_dynamic_fp16``) widens the weights to fp32 in registers
    (F16C), so it reads half of fp32's bytes and rounds nothing but the weights, to 2^-11 relative
    (8x finer than bf16); it needs AVX2, not native bf16. It wins where a step reads weights (decode,
    a few rows); for many rows (prefill) an fp32 GEMM is 1.3x faster on AVX2, so ``dense`` keeps the
    same fp16-rounded weights widened to fp32 for calls of more than ``SMALL_M["fp16"]`` rows: both
    paths multiply by the very same weight values, so a prompt's tokens do not depend on which ran.
    Weights on a 4-bit grid, where our AVX-512 kernel runs (engine/four_bit.py), are read as 4 bits by
    calls of up to NATIVE_ROWS rows (decode steps): the grid's own weights, closer to fp32 still, in
    ~half fbgemm's time at one row (docs/performance.md)."""

    def __init__(self, linear: nn.Linear, dense: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.small_m = SMALL_M["fp16"]
        bias = None if linear.bias is None else linear.bias.detach().float()
        # weights on a 4-bit grid, where our kernel runs: calls of a few rows read 4 bits, fp32 activations
        self.four_bit = exact_four_bit(linear.weight) if linear.weight.dtype == torch.float32 else None
        grid = linear.weight.detach().to(torch.float16).float()  # what fbgemm multiplies by
        try:
            self.packed = torch.ops.quantized.linear_prepack_fp16(grid, bias)
        except RuntimeError as e:  # fbgemm missing (not x86) or the CPU lacks AVX2
            raise ConfigError(f"fp16 weights need torch's fbgemm on an AVX2 CPU: {e}") from e
        # the op's overload itself: the packet's Python dispatch checks cost ~6 us a call, 121 calls a step
        self._gemm = torch.ops.quantized.linear_dynamic_fp16.default
        self.dense = grid if dense else None
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the model's own calls: no reshape, no casts
            return self._matmul(x)
        y = self._matmul(x.reshape(-1, self.in_features).float())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.four_bit is not None and x2.shape[0] <= self.four_bit.rows:
            y = self.four_bit(x2)
            return y if self.bias is None else y + self.bias
        if self.dense is not None and x2.shape[0] > self.small_m:
            return F.linear(x2, self.dense, self.bias)
        return self._gemm(x2, self.packed)


class Fp16Scorer(nn.Module):
    """The fp16 path's head scorer (CandidateHead's ``cheap``): calls of a few rows read a lossy 4-bit
    copy of the head (engine/four_bit.py: 14 MB a decode step for the default model instead of 57 in
    fp16), the rest fbgemm's fp16 GEMM. It only picks the candidates that CandidateHead rescores in
    fp32, as the bf16 path's scorer does; used where torch's int4 kernel is fast (native bf16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.fp16 = Fp16Linear(linear)
        self.four_bit = FourBitPair.of(linear.weight, lossy_ok=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.four_bit is not None and h.dim() == 2 and h.shape[0] <= FOUR_BIT_ROWS:
            return self.four_bit(h)
        return self.fp16(h)


def quantize_model(model: nn.Module, mode: str, include_lm_head: bool = True, dense: bool | None = None,
                   four_bit_head: bool = False, exact_small_steps: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` (in place) whose input size fits ``mode``; returns
    how many. The embedding stays as it is: a tied lm_head gets its own quantized copy. ``dense``
    (QuantLinear, Fp16Linear): keep fp32 weights for prefill; None: where they fit in DENSE_SHARE of free memory.
    ``four_bit_head`` (fp16): the head's scorer reads 4 bits for a few rows (Fp16Scorer; a CPU with native bf16).
    ``exact_small_steps`` (bf16): the runner's small steps multiply in fp32 where the native kernel reads the grid."""
    if mode == "none":
        return 0
    if mode == "bf16":
        return _bf16_weights(model, exact_small_steps)
    if dense is None:
        dense = _dense_fits(model)
    if mode == "fp16":
        # the head scores a few rows a step (its best candidates rescored in fp32): no dense copy
        return _replace_linears(model, lambda lin: Fp16Linear(lin, dense), Fp16Scorer if four_bit_head else Fp16Linear)
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child_name == "lm_head" and not include_lm_head:
                continue
            if mode == "int4" and (child.in_features % INT4_GROUP or child.out_features % INT4_ROWS):
                log.warning("quantize: %s.%s kept unquantized (%d x %d: int4 needs inputs a multiple of %d, "
                            "outputs of %d)", name, child_name, child.out_features, child.in_features,
                            INT4_GROUP, INT4_ROWS)
                continue
            quantized = QuantLinear(child, mode, dense)
            # the head decides near-tied tokens: its best candidates are rescored in fp32 (bf16_weights.py)
            setattr(module, child_name, CandidateHead(child, cheap=quantized) if child_name == "lm_head" else quantized)
            count += 1
    return count


def _dense_fits(model: nn.Module) -> bool:
    """Whether the linear layers' fp32 weights (already loaded) may stay: their bytes within DENSE_SHARE of
    the memory still available (Linux; elsewhere they stay)."""
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return True
    fits = nbytes <= DENSE_SHARE * free
    log.info("quantize: %s the fp32 weights (%.0f MiB) for prefill (%.0f MiB free)",
             "keeping" if fits else "not keeping", nbytes / 2**20, free / 2**20)
    return fits


def _bf16_weights(model: nn.Module, exact_small_steps: bool) -> int:
    # every output in fp32, the MLP's gate|up too: silu(gate) * up in bf16 cost 11 points of greedy agreement.
    # Where the weights are on a 4-bit grid and the native kernel runs, short prefills multiply by the grid's
    # weights in fp32 too: a prompt's K/V without bf16 rounding is half of what keeps greedy tokens fp32's
    count = _replace_linears(model, lambda lin: Bf16Linear(lin, exact_steps=exact_small_steps), None)
    four_bit = [m.four_bit for m in model.modules() if isinstance(m, Bf16Linear)]
    exact = sum(f is not None and f.exact for f in four_bit)
    lossy = sum(f is not None and not f.exact for f in four_bit)
    fp32 = sum(m.exact_steps for m in model.modules() if isinstance(m, Bf16Linear))
    log.info("bf16 weights: %d of %d linear layers (the head's scorer included) are on a 4-bit grid and read as "
             "4 bits by calls of up to %d rows, %d more as lossy 4 bits (a head's scorer); %d multiply steps of up "
             "to %d tokens in fp32 (native kernel: %s)", exact, len(four_bit),
             max((f.rows for f in four_bit if f is not None), default=0), lossy, fp32, EXACT_ROWS,
             "yes" if any(isinstance(f, FourBitFp32) for f in four_bit) else "no")
    return count


def _replace_linears(model: nn.Module, layer: Callable[[nn.Linear], nn.Module],
                     cheap_head: Callable[[nn.Linear], nn.Module] | None) -> int:
    """Every ``nn.Linear`` becomes ``layer(linear)``; the head a CandidateHead scoring with
    ``cheap_head(head)`` (None: CandidateHead's own bf16 scorer)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if name == "lm_head":
                child = CandidateHead(child, cheap=None if cheap_head is None else cheap_head(child))
            else:
                child = layer(child)
            setattr(module, name, child)
            count += 1
    return count


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """Perplexity of ``tokens[1:]`` under ``logits`` ([len(tokens), vocab], row i predicts token i+1)."""
    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(tokens[1:], device=logits.device)
    nll = -logp.gather(1, target[:, None]).mean()
    return float(torch.exp(nll))


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]], prefix: bool = False) -> float:
    """Share of positions where two greedy runs chose the same token. ``prefix`` counts only up to
    each pair's first divergence (the stricter figure: after one differing token the contexts differ)."""
    total = agree = 0
    for ref, cand in zip(reference, candidate, strict=True):
        total += len(ref)
        for a, b in zip(ref, cand):
            if a == b:
                agree += 1
            elif prefix:
                break
    return agree / total if total else 1.0
