"""Our native kernels, built on first use with torch's C++ extension tooling and cached on disk.

Why native code at all (docs/performance.md, "Engine"):

- ``q4_linear`` (``csrc/q4_gemv.cpp``): a decode step of a few rows is bound by reading the weights, and
  the default model's weights lie on a 4-bit grid. torch's int4 kernel reads them as 4 bits only with
  bf16 activations and bf16 output, whose rounding flips near-tied greedy tokens; with fp32 activations
  it is a scalar path ~30x slower. Ours reads the same 4 bits with fp32 activations and fp32 sums.
- ``paged_decode_attention`` (``csrc/paged_decode.cpp``): torch's decode attention over a paged cache
  gathers every sequence's blocks into a copy per layer and runs a masked SDPA over the padded copy; ours
  reads each K/V row once, in place, for all the query heads that share it.
- ``rms_norm``, ``add_rms_norm``, ``rotary``, ``silu_mul_bf16``, ``qkv_rotary_bf16`` (``csrc/rowwise.cpp``):
  the row-wise steps between a layer's matrix products, one pass each where torch makes four to six.

One module from all sources (``csrc/module.cpp`` binds them), built once per machine and source
(gcc, Python's headers, ninja from PyPI), ~30 s on 2 cores, then loaded from ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). Where it cannot be built or run (no AVX-512, no compiler,
``MOONCAKED_NATIVE=0``), ``native_module()`` returns None, logs why once, and callers keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mooncaked.engine.precision import cpu_flags

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / f for f in ("module.cpp", "q4_gemv.cpp", "paged_decode.cpp",
                                                                 "rowwise.cpp"))
# the instructions the kernels are compiled for (/proc/cpuinfo names)
NATIVE_FLAGS = frozenset({"avx512f", "avx512bw"})
# at::parallel_for splits work over torch's OpenMP threads only when the extension is built with OpenMP
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-fopenmp"]
# a build lock older than this was left by a build that died: torch would wait on it forever
STALE_LOCK_S = 600.0

# engines built on their own threads in one process (--role all) ask at once: one builds and loads, the rest wait
_BUILD_LOCK = threading.Lock()

Q4Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, k_cache, v_cache, block_tables, ctx_lens, scale) -> out
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def native_unavailable(flags: frozenset[str] | None = None) -> str | None:
    """Why the native kernels are not used here (None when they can be tried): turned off, or the CPU."""
    if os.environ.get("MOONCAKED_NATIVE", "1") == "0":
        return "MOONCAKED_NATIVE=0"
    return cpu_cannot_run(flags)


def cpu_cannot_run(flags: frozenset[str] | None = None) -> str | None:
    """Why this CPU cannot run the native kernels (None when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    missing = NATIVE_FLAGS - (cpu_flags() if flags is None else flags)
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    return None


def q4_kernel() -> Q4Linear | None:
    """``q4_linear(x, qt, dt, mt)`` (csrc/q4_gemv.cpp: weights in tiles of 16 output features, as FourBitFp32
    holds them), or None where the native module is unavailable."""
    module = native_module()
    return None if module is None else module.q4_linear


def decode_attention_kernel() -> DecodeAttention | None:
    """``paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale)`` (csrc/paged_decode.cpp),
    or None where the native module is unavailable."""
    module = native_module()
    return None if module is None else module.paged_decode_attention


def native_module():
    """The built module, or None where it is unavailable (logged once)."""
    with _BUILD_LOCK:
        return _native_once()


@functools.cache
def _native_once():
    reason = native_unavailable()
    if reason is not None:
        log.info("native kernels not used (%s): torch's kernels serve", reason)
        return None
    try:
        return _build()
    except Exception as e:  # a missing compiler, headers or ninja: the torch kernels still serve
        log.warning("native kernels could not be built (%s: %s): torch's kernels serve (on the bf16 path's "
                    "few-row steps its int4 kernel, whose bf16 activations flip near-tied greedy tokens)",
                    type(e).__name__, str(e).strip()[-400:])
        return None


def _build():
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, found without an activated virtualenv
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    source = b"".join(f.read_bytes() for f in SOURCES)
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = "mooncaked_native_" + digest
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        log.warning("native: removing a stale build lock %s", lock)
        lock.unlink(missing_ok=True)
    if not (build_dir / f"{name}.so").exists():  # said where a user sees it: startup pauses for it, once
        log.warning("building the native kernels once for this machine (~30 s; cached in %s)", build_dir)
    t0 = time.perf_counter()
    module = cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], build_directory=str(build_dir),
                                extra_cflags=CFLAGS, verbose=False)
    log.info("native kernels ready in %.1f s (%s)", time.perf_counter() - t0, build_dir)
    return module
