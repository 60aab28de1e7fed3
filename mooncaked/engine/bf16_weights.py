"""bf16 weights under an fp32 model: the CPU path where the CPU multiplies bf16 natively.

Why this shape (measured on the default model, docs/performance.md "Engine"): bf16 GEMMs on an
AVX512-BF16 CPU are 2-3x fp32's and read half the bytes, but the whole model in bf16 flips a third
of the greedy tokens of a 135M model. Two places carry the error: the residual stream (kept fp32
here: only the linear layers' inputs are rounded to bf16, their outputs come back as fp32) and the
vocabulary head, where near-tied logits decide the token. The head scores the whole vocabulary in
bf16 and then recomputes its ``CANDIDATES`` best in fp32 from the fp32 weights, so the greedy choice
is fp32's unless fp32's best token is not among bf16's top candidates.

The weights are handed to oneDNN once, in its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's CPU freezing does): a plain-layout bf16 GEMM re-packs its weight on every call, which
at a decode step's few rows doubled the time of every linear layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.engine.config import ConfigError
from mooncaked.engine.four_bit import FourBitFp32, four_bit_form

# bf16 logits of this model are off by ~0.1 at most; the 16 best cover every near tie we saw
CANDIDATES = 16
# a step of at most NATIVE_ROWS sequences (engine/four_bit.py) and this many tokens (a short prompt, a new chat
# turn after a cached prefix, a few decodes) multiplies in fp32 where the native kernel reads the layers' grid
# (``fp32_step``, ``Bf16Linear.exact_steps``; docs/performance.md)
EXACT_ROWS = 64
# set by the model runner around such a step: a mode of the step, as torch's autocast is, not of any one call
_FP32_STEP: ContextVar[bool] = ContextVar("mooncaked_fp32_step", default=False)
# rows the packed layout is tuned for (measured: any of 1, 16 or none gives decode steps 1.5-2x a plain GEMM)
PACK_ROWS = 16


class PackedBf16:
    """A bf16 weight [N, K] as oneDNN's pre-packed operand (plain ``F.linear`` where torch has no oneDNN)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features = w.shape[0]
        self.packed = None
        if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            except RuntimeError as e:  # a CPU whose flags we could not read (engine/precision.py checks them)
                raise ConfigError(f"bf16 weights are not supported on this CPU: {e}") from e
        self.plain = None if self.packed is not None else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., K] (any float dtype) times the weight, as bf16 [..., N]."""
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        else:
            y = F.linear(x2, self.plain)
        return y.reshape(*x.shape[:-1], self.out_features)


class Bf16Linear(nn.Module):
    """A drop-in for ``nn.Linear`` (forward only): bf16 weights, input rounded to bf16, output in
    ``out_dtype`` (default: the layer's own dtype; the bias is added there).

    Weights already on a 4-bit grid (a Q4 GGUF's) are also held as 4 bits, read by calls of a few rows
    (engine/four_bit.py): there a step's time is the bytes of weights it reads."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None, lossy_four_bit: bool = False,
                 exact_steps: bool = False) -> None:
        """``lossy_four_bit``: weights off the grid get a lossy 4-bit copy too (a scorer whose picks are
        rescored in fp32). ``exact_steps``: where the weights are on the grid and the native fp32 kernel runs,
        it multiplies every call of the runner's small steps (``fp32_step``), not only few-row ones: the
        grid's own weights with fp32 activations, and faster than an fp32 GEMM at a small step's <= 64 rows
        (docs/performance.md), so no fp32 copy of the weights is kept."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = out_dtype or linear.weight.dtype
        self.weight = PackedBf16(linear.weight)
        # only where torch has oneDNN: the CPUs the bf16 path was measured on
        self.four_bit = four_bit_form(linear.weight, lossy_four_bit) if self.weight.packed is not None else None
        fp32_grid = isinstance(self.four_bit, FourBitFp32) and linear.weight.dtype == torch.float32
        self.exact_steps = exact_steps and fp32_grid
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def bf16_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bf16 GEMM's own bf16 output, unconverted, where this call would take it (not a 4-bit call, not an
        exact step, no bias); else None. Lets the MLP fuse what follows (csrc/rowwise.cpp silu_mul_bf16)."""
        if self.bias is not None or x.dim() != 2 or self.out_dtype != torch.float32 or self._reads_four_bit(x):
            return None
        return self.weight(x)

    def _reads_four_bit(self, x: torch.Tensor) -> bool:
        """Whether this call reads the 4-bit form: a few rows, or any call of an exact small step."""
        return self.four_bit is not None and x.dim() == 2 and (
            x.shape[0] <= self.four_bit.rows or (self.exact_steps and _FP32_STEP.get()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._reads_four_bit(x):
            y = self.four_bit(x).to(self.out_dtype)  # type: ignore[misc]
        else:
            y = self.weight(x).to(self.out_dtype)
        return y if self.bias is None else y + self.bias


@contextmanager
def fp32_step(on: bool = True) -> Iterator[None]:
    """Within it, layers with ``exact_steps`` multiply every call by the grid's own weights in fp32: the model
    runner's small steps. With few-row calls exact too, a lone short prompt and its decode steps give fp32's
    greedy tokens."""
    token = _FP32_STEP.set(on)
    try:
        yield
    finally:
        _FP32_STEP.reset(token)


class CandidateHead(nn.Module):
    """The vocabulary head: cheap logits for every token, fp32 for the ``k`` best of them.

    ``cheap`` scores the whole vocabulary (default: the head's weights in bf16, Bf16Linear; engine/quant.py
    passes an int8/int4 layer); the fp32 weights are shared (with the embedding when tied), and
    only ``k`` rows of them are read per token."""

    def __init__(self, linear: nn.Linear, k: int = CANDIDATES, cheap: nn.Module | None = None) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a vocabulary head with a bias is not supported")
        self.weight = linear.weight  # fp32, shared
        # it only picks candidates that are then rescored in fp32: 4 bits off the grid serve (the default
        # model's tied head, 57 MB a step in bf16; no greedy token changed)
        self.cheap = cheap if cheap is not None else Bf16Linear(linear, torch.float32, lossy_four_bit=True)
        self.k = min(k, linear.out_features)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        h2 = h.reshape(-1, shape[-1])
        logits = self.cheap(h2).float()
        top = logits.topk(self.k, dim=-1).indices  # [T, k]
        rows = self.weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)  # [T, k, D]
        exact = torch.bmm(rows, h2.float().unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(-1, top, exact).reshape(*shape[:-1], -1)
