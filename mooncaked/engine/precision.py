"""Which precision an engine runs in: the activations' dtype and how the linear layers hold weights.

Why a decision of its own: on a CPU a decode step is bound by the bytes of weights it reads, and the
fastest path that keeps the quality bar depends on the machine (docs/performance.md "Engine"). Where
the CPU multiplies bf16 natively (AVX512-BF16 or AMX), bf16 weights halve the bytes and run the GEMMs
2-3x faster than fp32. Where it does not (AVX2), bf16 is emulated and slow, and the int8/int4 kernels
round every activation to bf16 (12-14 points of greedy agreement lost); fbgemm's fp16 GEMM halves the
bytes with fp32 activations, and its greedy tokens were fp32's. We read the CPU's flags, never assume
them. ``--dtype float32`` always keeps the exact path (the one equal to transformers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mooncaked.engine.config import ConfigError

log = logging.getLogger(__name__)

# x86 flags (as /proc/cpuinfo spells them) of native bf16 dot products; both measured fast with torch's oneDNN GEMMs
NATIVE_BF16_FLAGS: frozenset[str] = frozenset({"avx512_bf16", "amx_bf16"})
# what fbgemm's fp16 GEMM (engine/quant.py Fp16Linear) needs: AVX2 + FMA, F16C for the widening
FP16_GEMM_FLAGS: frozenset[str] = frozenset({"avx2", "fma", "f16c"})
# what oneDNN's pre-packed bf16 GEMM (engine/bf16_weights.py) needs, one of these sets (its own error message)
ONEDNN_BF16_FLAG_SETS: tuple[frozenset[str], ...] = (frozenset({"avx_ne_convert"}),
                                                    frozenset({"avx512bw", "avx512vl", "avx512dq"}))


@dataclass(frozen=True)
class Precision:
    """``dtype``: activations, residual stream, norms, attention and KV cache. ``weights``: how the
    linear layers hold theirs (engine/quant.py: "none" = in ``dtype``; "bf16", "int8", "int4")."""

    dtype: torch.dtype
    weights: str
    reason: str  # why, for the log line a user reads

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float32 and self.weights == "none"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux x86: the first ``flags`` line); empty where they cannot be read."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError as e:
        log.info("cannot read %s (%s): assuming no native bf16", cpuinfo, e)
    return frozenset()


def native_bf16(flags: Iterable[str]) -> bool:
    """Whether a CPU with these flags multiplies bf16 natively."""
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


def fp16_gemm(flags: Iterable[str]) -> bool:
    """Whether fbgemm's fp16 GEMM runs here: this torch has fbgemm and the CPU AVX2, FMA and F16C."""
    return FP16_GEMM_FLAGS <= frozenset(flags) and "fbgemm" in torch.backends.quantized.supported_engines


def pick_precision(requested: torch.dtype | None, quantize: str, device: torch.device,
                   model_dtype: torch.dtype, flags: Iterable[str]) -> Precision:
    """``requested`` None is auto. Pure (the CPU's flags are an argument), so it is tested on any machine.

    - any device, a dtype requested: that dtype, with the weights ``quantize`` says;
    - GPU, auto: the model's own dtype;
    - CPU, auto: fp32 activations; the weights ``quantize`` says, else the fastest that kept the
      quality bar (docs/performance.md "Engine"): bf16 where the CPU has native bf16, fp16 where
      fbgemm's fp16 GEMM runs (AVX2), else fp32.
    """
    if requested is not None:
        return Precision(requested, quantize, f"dtype {_name(requested)} requested")
    if device.type != "cpu":
        return Precision(model_dtype, quantize, f"the model's own dtype on {device.type}")
    if quantize != "none":
        return Precision(torch.float32, quantize, f"{quantize} weights requested")
    if native_bf16(flags):
        found = ", ".join(sorted(NATIVE_BF16_FLAGS.intersection(flags)))
        return Precision(torch.float32, "bf16", f"auto: the CPU has native bf16 ({found})")
    if fp16_gemm(flags):
        return Precision(torch.float32, "fp16", "auto: no native bf16 (AVX512-BF16 or AMX) on this CPU; "
                         "fp16 weights under fp32 activations (fbgemm, AVX2+FMA+F16C)")
    return Precision(torch.float32, "none", "auto: the CPU has neither native bf16 (AVX512-BF16 or AMX) nor "
                     "AVX2+FMA+F16C for fp16 weights")


def unsupported_reason(weights: str, device: torch.device, flags: Iterable[str]) -> str | None:
    """Why this CPU cannot run ``weights`` (None when it can, or when its flags are unknown: then torch decides).

    Only the bf16 weights have such a need: oneDNN refuses to pack bf16 weights without
    AVX-NE-CONVERT or AVX512 BW+VL+DQ, with a RuntimeError deep in the first layer's load."""
    flags = frozenset(flags)
    if weights != "bf16" or device.type != "cpu" or not flags:
        return None
    if any(need <= flags for need in ONEDNN_BF16_FLAG_SETS):
        return None
    missing = " or ".join("+".join(sorted(need - flags)) for need in ONEDNN_BF16_FLAG_SETS)
    return (f"bf16 weights (--quantize bf16) need a CPU with {missing} (oneDNN's bf16 GEMM); this CPU has "
            f"none of them: use --dtype auto, --quantize int8/int4 or --dtype float32")


def check_supported(precision: Precision, device: torch.device, flags: Iterable[str]) -> None:
    """Refuse, with a ConfigError naming the missing CPU flags, a precision this CPU cannot run."""
    reason = unsupported_reason(precision.weights, device, flags)
    if reason is not None:
        raise ConfigError(reason)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
