"""Weights that already lie on a 4-bit grid (a Q4 GGUF's, as the default model's) read as 4 bits
where a step is bound by reading them: a call of a few rows (a decode step of batch 1 to 4, or to 16
with our native kernel; a prefill of a few new tokens).

Why: such a step reads every weight once, 269 MB a step for the default model in bf16 and about
100 MB here. torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, as gpt-fast uses it) takes bf16
scales and zeros, and rounding a Q4_1 block's fp16 scale and offset to bf16 cost 12 points of greedy
agreement on the default model (0.826, every layer 4-bit). So a layer holds two pairs for the same
4-bit values: the bf16-rounded scale and zero, and what the rounding left of them; the two products
add up to the grid's own weights (0.914), and what is left is the kernel's bf16 output rounding
(docs/performance.md, "An AMX host"). Only weights found exactly on the grid qualify: re-quantizing
any others would lose far more than bf16 does.

Where our native kernel runs (engine/native.py: AVX-512), a weight on the grid is read by it instead
(``FourBitFp32``): the same 4 bits, fp32 activations and fp32 sums, so a few-row call multiplies by the
grid's weights and rounds nothing else; it is as fast as the int4 kernel here (docs/performance.md).
"""

from __future__ import annotations

import torch

from mooncaked.engine.native import Q4Linear, q4_kernel

INT4_GROUP = 32  # Q4_0/Q4_1 blocks: 32 inputs share a scale (and an offset)
INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu packs output rows in 16s
# rows at or below which a call reads the 4-bit weights; above, oneDNN's bf16 GEMM wins. Measured in the
# engine on a 2-vCPU AMX host, where every step streams the weights from DRAM (docs/performance.md, "The AMX
# host again"): decode steps of batch 2 / 3 / 4 took 26.7 / 28.9 / 33.1 ms against 35.1 / 35.9 / 36.2 in bf16
# (2 threads), batch 5 50.9 against 40.4. (With the weights in cache, as a one-layer bench has them, bf16 wins
# from 2 rows.)
FOUR_BIT_ROWS = 4
# the same for our native fp32 kernel (FourBitFp32), which rebuilds each pair of inputs' weights once for up to
# 16 rows: 30 layers' linear weights of the default model, AVX-512 Zen 5 host, 2 vCPUs, ms at 1 / 4 / 8 / 12 / 16
# rows: 2.7 / 4.0 / 7.4 / 10.1 / 12.1 against oneDNN bf16's 8.3 / 8.4 / 9.7 / 10.6 / 12.1 (docs/performance.md):
# a decode step of up to 16 sequences multiplies by the grid's own weights with fp32 activations, at bf16's cost
NATIVE_ROWS = 16
# a weight is on the grid when re-quantizing it moves no value by more than this share of its group's step
GRID_TOLERANCE = 1e-3


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group`` inputs: w ≈ (q - 8) * scale + zero, q in 0..15.
    Returns q [N, K] (uint8), scale and zero [N, K/group] (fp32)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q.contiguous(), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * scale + zero`` per group of INT4_GROUP inputs, as fp32 [N, K]."""
    n, k = q.shape
    qg = q.float().reshape(n, k // INT4_GROUP, INT4_GROUP) - 8
    return (qg * scale[..., None] + zero[..., None]).reshape(n, k)


def on_grid(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether ``dequantize_int4(q, scale, zero)`` gives back ``w`` (to GRID_TOLERANCE of each group's step)."""
    n, k = w.shape
    err = (dequantize_int4(q, scale, zero) - w.float()).abs().reshape(n, k // INT4_GROUP, INT4_GROUP).amax(-1)
    return bool((err <= GRID_TOLERANCE * scale).all())


class FourBitPair:
    """A weight [N, K] on a 4-bit grid, as packed 4-bit values and two bf16 (scale, zero) pairs."""

    rows = FOUR_BIT_ROWS  # calls of up to this many rows read it

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, exact: bool = True) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        coarse = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)  # [N, K/g, 2]
        fine = (torch.stack([scale, zero], dim=-1) - coarse.float()).to(torch.bfloat16)
        # the kernel wants [K/g, N, 2]
        self.coarse = coarse.transpose(0, 1).contiguous()
        self.fine = fine.transpose(0, 1).contiguous() if exact else None

    @property
    def exact(self) -> bool:
        """Whether it multiplies by the grid's own weights (two pairs), not a lossy copy (one)."""
        return self.fine is not None

    @classmethod
    def of(cls, weight: torch.Tensor, lossy_ok: bool = False) -> "FourBitPair | None":
        """The 4-bit form of ``weight`` when it is on a 4-bit grid of INT4_GROUP inputs (two pairs: exact);
        else None, or with ``lossy_ok`` the weight re-quantized to 4 bits with one bf16 pair (for a scorer
        whose choices are checked in fp32 anyway). None too where the shape or device does not fit."""
        grid = grid_of(weight, lossy_ok)
        return None if grid is None else cls(*grid)

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2`` [M, K] (rounded to bf16, as the bf16 path rounds it) times the weight, as fp32 [M, N]."""
        xb = x2.to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(xb, self.packed, INT4_GROUP, self.coarse).float()
        return y if self.fine is None else y + mm(xb, self.packed, INT4_GROUP, self.fine)


class FourBitFp32:
    """A weight [N, K] on a 4-bit grid as packed 4-bit values and fp32 block scales and offsets, multiplied
    with fp32 activations by the native kernel (csrc/q4_gemv.cpp): the grid's own weights, fp32 sums."""

    exact = True
    rows = NATIVE_ROWS  # calls of up to this many rows read it

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kernel: Q4Linear) -> None:
        n, k = q.shape
        tiles = n // INT4_ROWS
        # tiles of 16 output features (what the kernel unpacks): byte j of input pair p holds feature j's value
        # of input 2p in the low nibble and of 2p + 1 in the high one; scales and offsets [tile, block, j]
        pairs = q.reshape(tiles, INT4_ROWS, k // 2, 2)
        self.packed = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous()
        offset = zero - 8 * scale  # w = scale * q + offset, q in 0..15
        self.scale, self.offset = (v.float().reshape(tiles, INT4_ROWS, k // INT4_GROUP).permute(0, 2, 1).contiguous()
                                   for v in (scale, offset))
        self.kernel = kernel

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2`` [M, K] times the weight, as fp32 [M, N] (nothing rounded to bf16)."""
        return self.kernel(x2.float().contiguous(), self.packed, self.scale, self.offset)


def grid_of(weight: torch.Tensor, lossy_ok: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """``(q, scale, zero, exact)`` of ``weight`` re-quantized to 4 bits: exact when it was on the grid; None
    when it was not (unless ``lossy_ok``) or when the shape or device does not fit."""
    w = weight.detach()
    n, k = w.shape
    if w.device.type != "cpu" or k % INT4_GROUP or n % INT4_ROWS:
        return None
    # a first block of rows decides most checkpoints (bf16 or fp16 weights are never on a grid) without
    # re-quantizing the whole weight at load
    if not lossy_ok and not on_grid(w[:INT4_ROWS], *quantize_int4(w[:INT4_ROWS])):
        return None
    q, scale, zero = quantize_int4(w)
    exact = on_grid(w, q, scale, zero)
    if not exact and not lossy_ok:
        return None
    return q, scale, zero, exact


def four_bit_form(weight: torch.Tensor, lossy_ok: bool = False) -> "FourBitFp32 | FourBitPair | None":
    """How few-row calls read ``weight`` as 4 bits: a weight on the grid by the native fp32 kernel where it
    runs, else by torch's int4 kernel (FourBitPair, also for lossy copies); None: not at all."""
    grid = grid_of(weight, lossy_ok)
    if grid is None:
        return None
    q, scale, zero, exact = grid
    kernel = q4_kernel() if exact else None  # built on first use: only a checkpoint on the grid pays for it
    return FourBitFp32(q, scale, zero, kernel) if kernel is not None else FourBitPair(q, scale, zero, exact)


def exact_four_bit(weight: torch.Tensor) -> FourBitFp32 | None:
    """The native fp32 form of a weight on the grid; None off the grid or where the kernel does not run
    (for a path whose few-row calls must not round activations: no torch int4 fallback)."""
    grid = grid_of(weight)
    kernel = q4_kernel() if grid is not None else None
    return None if grid is None or kernel is None else FourBitFp32(*grid[:3], kernel)
