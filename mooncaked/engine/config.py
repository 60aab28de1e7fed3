"""Typed model and engine configuration.

``ModelConfig`` is read once from an HF ``config.json`` dict and validated there, so
the model code never has to guess which of the two config conventions a file uses
(transformers < 5 writes ``rope_theta`` + ``rope_scaling``; transformers 5 writes one
``rope_parameters`` dict and may omit ``head_dim`` or ``attention_bias``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# architecture name -> (q/k/v projections carry a bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ConfigError(ValueError):
    """A model config that cannot be served; the message names the field."""


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype's name as torch's dtype; None or "auto" is None (engine/precision.py decides)."""
    if name is None or name == "auto":
        return None
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Validate an HF config dict; every failure names the offending field. Sizes are bounded
        here, so a hostile file is refused before anything is allocated for it."""
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ConfigError("config.json needs 'architectures': a list naming the model class")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r} in 'architectures'; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        f = _Fields(cfg)
        hidden = f.integer("hidden_size", hi=MAX_DIM)
        heads = f.integer("num_attention_heads", hi=MAX_DIM)
        kv_heads = f.integer("num_key_value_heads", default=heads, hi=MAX_DIM)
        if heads % kv_heads:
            raise ConfigError(f"config.json field 'num_key_value_heads' ({kv_heads}) must divide "
                              f"num_attention_heads ({heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; set 'head_dim'")
        head_dim = f.integer("head_dim", default=hidden // heads, hi=MAX_DIM)
        vocab = f.integer("vocab_size", hi=MAX_VOCAB)
        window = None
        if f.flag("use_sliding_window", arch == "MistralForCausalLM"):
            window = f.integer("sliding_window", default=None, hi=MAX_POSITIONS)
        bos = f.integer("bos_token_id", default=None, lo=0, hi=vocab - 1)
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab for e in eos_list):
            raise ConfigError(f"config.json field 'eos_token_id' must be a token id or a list of them "
                              f"(below vocab_size {vocab}), got {eos!r}")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size", hi=MAX_DIM),
            num_layers=f.integer("num_hidden_layers", hi=MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            rope=_parse_rope(cfg),
            max_position_embeddings=f.integer("max_position_embeddings", default=2048, hi=MAX_POSITIONS),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            attention_bias=f.flag("attention_bias", default_bias),
            qk_norm=qk_norm,
            dtype=parse_dtype(f.text("torch_dtype") or f.text("dtype")) or torch.float32,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_list),
            sliding_window=window,
        )


# bounds no real model reaches (the largest open models: hidden 16k, vocab 256k, 126 layers, 1M context)
MAX_DIM = 1 << 17
MAX_VOCAB = 1 << 22
MAX_LAYERS = 1024
MAX_POSITIONS = 1 << 24


class _Fields:
    """Typed reads of config.json fields: a wrong type or range is a ConfigError naming the field."""

    _MISSING = object()

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def integer(self, key: str, default: Any = _MISSING, lo: int = 1, hi: int = 1 << 62) -> Any:
        value = self.cfg.get(key)
        if value is None:
            if default is self._MISSING:
                raise ConfigError(f"config.json is missing required field {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"config.json field {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
            raise ConfigError(f"config.json field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"config.json field {key!r} must be true or false, got {value!r}")
        return value

    def text(self, key: str) -> str | None:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"config.json field {key!r} must be a string, got {value!r}")
        return value


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError("config.json fields 'rope_parameters' and 'rope_scaling' must be objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ConfigError(f"unsupported rope type {rope_type!r} in 'rope_parameters'/'rope_scaling'")
    f = _Fields({**merged, "rope_theta": theta})
    return RopeConfig(
        theta=f.number("rope_theta", 10000.0),
        rope_type=rope_type,
        factor=f.number("factor", 1.0),
        low_freq_factor=f.number("low_freq_factor", 1.0),
        high_freq_factor=f.number("high_freq_factor", 4.0),
        original_max_position_embeddings=f.integer("original_max_position_embeddings", default=8192, hi=MAX_POSITIONS),
    )


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model: where, in what precision, and with how much KV memory."""

    device: str = "cpu"
    # None: auto (engine/precision.py: fp32 + bf16 weights on a native-bf16 CPU, fp16 weights on AVX2)
    dtype: torch.dtype | None = None
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: gpu_memory_fraction of free GPU memory, or 1 GiB on CPU
    gpu_memory_fraction: float = 0.85
    max_num_seqs: int = 64
    # the token budget of one step (chunked prefill cuts prompts to it); None: step_tokens picks by device
    max_num_batched_tokens: int | None = None
    # a step packs further prompts' prefill only up to this many prefill tokens in all; None: by device
    prefill_pack_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"  # "auto" | "flash" | "torch"
    enable_prefix_caching: bool = True
    # CPU, bf16 weights on a 4-bit grid, native kernel: small steps multiply in fp32 (engine/bf16_weights.py)
    exact_small_steps: bool = True
    # GPU, flash backend: decode steps replay CUDA graphs captured at start-up (engine/cuda_graphs.py)
    cuda_graphs: bool = True
    hash_seed: int = 0
    record_kv_events: bool = False  # keep BlockStored/BlockRemoved events for the conductor's index
    quantize: str = "none"  # "none" | "bf16" | "int8" | "int4": the linear layers' weights (CPU; engine/quant.py)
    pipeline_stage: tuple[int, int] | None = None  # (K, N): stage K of an N-stage CPP group (engine/stage.py)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0 or any(n is not None and n <= 0 for n in (self.max_num_batched_tokens,
                                                                           self.prefill_pack_tokens)):
            raise ConfigError("max_num_seqs, max_num_batched_tokens and prefill_pack_tokens must be positive")
        if self.attention_backend not in ("auto", "flash", "torch"):
            raise ConfigError(f"attention_backend must be auto, flash or torch, got {self.attention_backend!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.pipeline_stage is not None:
            k, n = self.pipeline_stage
            if n < 1 or not 0 <= k < n:
                raise ConfigError(f"pipeline_stage {k}/{n}: need 0 <= K < N (stages count from 0)")
        check_device(self.device)
        from mooncaked.engine.quant import check_quantize

        check_quantize(self.quantize, self.device)

    @property
    def step_tokens(self) -> int:
        """The step's token budget: the one set, else ``DEFAULT_STEP_TOKENS`` for the device's kind."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_STEP_TOKENS.get(torch.device(self.device).type, DEFAULT_STEP_TOKENS["cuda"])

    @property
    def pack_tokens(self) -> int:
        """Prefill tokens up to which a step takes a second prompt: the one set, else
        ``DEFAULT_PACK_TOKENS`` for the device's kind (none there: the whole step budget)."""
        pack = self.prefill_pack_tokens or DEFAULT_PACK_TOKENS.get(torch.device(self.device).type)
        return min(pack or self.step_tokens, self.step_tokens)


# A step's token budget when none is set. A GPU gains from big steps (short prompts batched keep it
# busy). A CPU does not: prefill is compute-bound from ~100 tokens on (SmolLM2-135M on 2 AVX2 cores: 10.5
# ms a token in a 128-token step, 11.6 in a 512-token one), so a bigger step buys no throughput and only
# holds every prompt in it, and every running decode, until the whole step ends: 2048 tokens are ~20 s
# there, and all the prompts batched into them got their first token at the end. With 256, prompts finish
# about in arrival order, as the scheduler's cost model and the simulator assume (docs/performance.md,
# "Simulator vs replay").
DEFAULT_STEP_TOKENS = {"cuda": 2048, "cpu": 256}

# How many prefill tokens a step may hold when it packs several prompts (a prompt alone always gets the
# whole step budget). Every prompt in a step gets its first token when the step ends, so packing a second
# prompt delays the first by the second's compute; it pays only where a step's fixed cost dwarfs its
# per-token cost. On a GPU that holds up to the whole budget. On a CPU it holds only for tiny prompts: a
# step costs ~54 ms plus ~8.8 ms a token (SmolLM2-135M, 1 thread, AVX2: 0.195 s for 16 tokens, 1.18 s for
# 128), so two 150-token prompts packed finish together at ~2.7 s, where one after the other they finish
# at ~1.4 s and ~2.7 s. Small prompts still pack up to 32 tokens, where the fixed cost is < 20 % of the
# step. Prompts then prefill one after another, as the conductor's cost model and the simulator assume
# (docs/performance.md, "Simulator vs replay").
DEFAULT_PACK_TOKENS: dict[str, int | None] = {"cuda": None, "cpu": 32}


def check_device(device: str) -> torch.device:
    """The torch device `device` names, if this machine and this torch build can run on it."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ConfigError(f"device {device!r}: this torch {torch.__version__} is built without CUDA; "
                              "use --device cpu, or install a CUDA build of torch")
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"device {device!r}: no CUDA GPU is visible (check the driver and "
                              "CUDA_VISIBLE_DEVICES), or use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    return dev
