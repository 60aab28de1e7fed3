"""Turn a llama.cpp GGUF file into an HF-format model folder.

The engine loads HF folders only (config.json, model.safetensors, tokenizer.json);
GGUF is how small models are shipped (the default model is one). We dequantize to
float32 once at conversion time, undo the q/k row permutation llama.cpp's
converter applies for its RoPE layout, and rebuild the tokenizer from the GGUF's
vocabulary so that no model hub is needed at run time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from mooncaked.engine.gguf_tokenizer import GGUFMeta, UnsupportedGGUFError, build_tokenizer

__all__ = ["BadGGUFError", "GGUFModel", "UnsupportedGGUFError", "convert_gguf", "is_converted", "read_gguf"]

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# Types whose dequantization gguf-py implements and that plain llama-family models use.
SUPPORTED_TENSOR_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json")
MARKER_FILE = "conversion.json"
# Bump when the output of convert_gguf changes, so cached folders are redone.
CONVERSION_FORMAT = 1


@dataclass(frozen=True)
class _Arch:
    architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter permutes q/k rows for this arch


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True),
    # Qwen2Model in convert_hf_to_gguf.py does not permute (no LlamaModel.permute).
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class GGUFModel:
    """Everything an HF folder holds, in memory."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


class BadGGUFError(ValueError):
    """The file is not readable GGUF: not GGUF at all, truncated (a download cut short) or corrupt."""


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Read a GGUF file into HF-named float32 tensors, an HF config and a tokenizer.

    Every failure names the file: `BadGGUFError` when it cannot be read, `UnsupportedGGUFError`
    when it is valid GGUF we cannot convert."""
    path = Path(path)
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise BadGGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF'): "
                           "give 'default', an HF model folder or a .gguf file")
    try:
        reader = gguf.GGUFReader(path)
        return _read(reader, path)
    except UnsupportedGGUFError as e:
        if str(path) in str(e):
            raise
        raise UnsupportedGGUFError(f"{path}: {e}") from e
    except (ValueError, IndexError, KeyError, struct.error) as e:
        # the header promises fields or tensor bytes the file does not hold
        raise BadGGUFError(f"{path} ({path.stat().st_size} bytes) is truncated or corrupt: "
                           "download it again") from e


def _read(reader: gguf.GGUFReader, path: Path) -> GGUFModel:
    meta = GGUFMeta(reader)
    arch = _ARCHS.get(meta.arch)
    if arch is None:
        raise UnsupportedGGUFError(
            f"{path}: GGUF architecture {meta.arch!r} is not supported (supported: {sorted(_ARCHS)})")
    raw = {t.name: t for t in reader.tensors}
    config = _hf_config(meta, arch, raw)
    tensors = _hf_tensors(raw, arch, config)
    if "rope_freqs.weight" in raw:
        scaling = llama3_rope_scaling(_dequantize(raw["rope_freqs.weight"]).numpy(), config["head_dim"],
                                      config["rope_theta"], config["max_position_embeddings"])
        if scaling is not None:
            config["rope_scaling"] = scaling
    tokenizer, tokenizer_config = build_tokenizer(meta)
    generation_config = _generation_config(meta)
    config["bos_token_id"] = generation_config.get("bos_token_id")
    config["eos_token_id"] = meta.get(gguf.Keys.Tokenizer.EOS_ID)
    logger.info("read %s: %s, %d layers, %d tensors", path, arch.architecture,
                config["num_hidden_layers"], len(tensors))
    return GGUFModel(config, tensors, tokenizer, tokenizer_config, generation_config)


def _hf_config(meta: GGUFMeta, arch: _Arch, raw: dict[str, gguf.ReaderTensor]) -> dict[str, Any]:
    keys = gguf.Keys
    hidden = int(meta.require(keys.LLM.EMBEDDING_LENGTH))
    n_head = int(meta.require(keys.Attention.HEAD_COUNT))
    vocab_rows = int(raw["token_embd.weight"].shape[1])  # GGUF shapes are (cols, rows)
    config = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(meta.require(keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(keys.Attention.HEAD_COUNT_KV, n_head)),
        "head_dim": int(meta.get(keys.Attention.KEY_LENGTH, hidden // n_head)),
        "rms_norm_eps": _f32(meta.require(keys.Attention.LAYERNORM_RMS_EPS)),
        "rope_theta": _f32(meta.get(keys.Rope.FREQ_BASE, 10000.0)),
        "max_position_embeddings": int(meta.require(keys.LLM.CONTEXT_LENGTH)),
        "tie_word_embeddings": "output.weight" not in raw,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in raw,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = _metadata_rope_scaling(meta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _f32(value: float) -> float:
    """GGUF stores float32: print 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def _metadata_rope_scaling(meta: GGUFMeta) -> dict[str, Any] | None:
    """Linear and YaRN scaling are stored as metadata; llama3's as a rope_freqs tensor."""
    kind = meta.get(gguf.Keys.Rope.SCALING_TYPE)
    factor = meta.get(gguf.Keys.Rope.SCALING_FACTOR)
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(meta.require(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN))}
    raise UnsupportedGGUFError(f"RoPE scaling type {kind!r} is not supported")


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float,
                        max_positions: int) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency `rope_freqs` factors.

    The llama3 curve only depends on original_max_position_embeddings through the
    ratios old/low_freq_factor and old/high_freq_factor, so we fix `old` and fit the
    two factors to the smooth band; the result is checked against every factor.
    """
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)  # 1 = unscaled, 0 = fully
    band = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    if band.sum() < 2:
        raise UnsupportedGGUFError("rope_freqs has too few smoothly scaled frequencies to recover "
                                   "llama3 RoPE scaling from it")
    slope, intercept = np.polyfit(x[band], smooth[band], 1)
    x_low, x_high = -intercept / slope, (1 - intercept) / slope  # where smooth is 0 and 1
    old = 8192 if 8192 < max_positions else max(1, max_positions // 2)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(x_low * old),
               "high_freq_factor": float(x_high * old), "original_max_position_embeddings": old}
    if not np.allclose(_llama3_factors(scaling, inv_freq), factors, rtol=1e-4, atol=1e-5):
        raise UnsupportedGGUFError("rope_freqs tensor does not follow llama3 RoPE scaling")
    return scaling


def _llama3_factors(s: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    """The factors llama.cpp's converter writes for an HF llama3 rope_scaling."""
    old, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / s["factor"] + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, s["factor"], mid))


def _hf_tensors(raw: dict[str, gguf.ReaderTensor], arch: _Arch, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            if name != "rope_freqs.weight":
                logger.warning("ignoring GGUF tensor %s (no HF counterpart)", name)
            continue
        value = _dequantize(t)
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        n_head = heads.get(name.split(".")[2]) if name.startswith("blk.") else None
        if n_head is not None and value.shape[0] != n_head * config["head_dim"]:
            raise UnsupportedGGUFError(
                f"tensor {name!r} has {value.shape[0]} rows, not {n_head} heads x {config['head_dim']}")
        if n_head is not None and arch.permuted_qk:
            value = unpermute_qk(value, n_head)
        tensors[hf_name] = value
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - tensors.keys()
    if missing:
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {sorted(missing)}")
    return tensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _dequantize(t: gguf.ReaderTensor) -> torch.Tensor:
    qtype = Q(t.tensor_type)
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedGGUFError(
            f"tensor {t.name!r} has GGML type {qtype.name}, which is not supported "
            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))})")
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest axis first
    values = gguf.quants.dequantize(t.data, qtype).reshape(shape)
    # F32 data is a read-only view of the mapped file: copy it out.
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py's LlamaModel.permute (rows, per head).

    The converter reshapes rows as (head, 2, half) and swaps the last two, which
    interleaves the two RoPE halves; we reshape as (head, half, 2) and swap back.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())


def _generation_config(meta: GGUFMeta) -> dict[str, Any]:
    keys = gguf.Keys.Tokenizer
    eos = [meta.get(k) for k in (keys.EOS_ID, keys.EOT_ID, keys.EOM_ID)]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    config: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    for name, key in (("bos_token_id", keys.BOS_ID), ("pad_token_id", keys.PAD_ID)):
        if meta.get(key) is not None:
            config[name] = int(meta.get(key))
    return config


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write an HF folder for `gguf_path` at `out_dir`, atomically.

    The folder is built under a temporary name next to `out_dir` and renamed into
    place, so readers never see half a folder. If another process finished the
    same conversion first, its folder is kept and ours discarded.
    """
    source, out = Path(gguf_path), Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = read_gguf(source)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_hf_folder(model, tmp, _marker(source))
        _make_shareable(tmp)
        _install(tmp, out, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s into %s", source, out)
    return out


def write_hf_folder(model: GGUFModel, folder: Path, marker: dict[str, Any]) -> None:
    """Write the HF files; `marker` (conversion.json) lets later runs recognise the folder."""
    save_file({k: v.contiguous() for k, v in model.tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.tokenizer.save(str(folder / "tokenizer.json"))
    for name, data in (("config.json", model.config), ("tokenizer_config.json", model.tokenizer_config),
                       ("generation_config.json", model.generation_config)):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")
    # Written last: its presence says the folder is whole.
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _make_shareable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a model cache is read by others."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _marker(source: Path) -> dict[str, Any]:
    return {"source": source.name, "source_size": source.stat().st_size, "format": CONVERSION_FORMAT}


def is_converted(folder: str | os.PathLike[str], gguf_path: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a complete conversion of this GGUF by this converter version."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(Path(gguf_path)) and all((folder / f).is_file() for f in HF_FILES)


def _install(tmp: Path, out: Path, source: Path) -> None:
    """Rename `tmp` to `out`; a stale `out` is moved aside first, a current one kept."""
    for _ in range(3):
        try:
            os.rename(tmp, out)  # replaces nothing but an empty directory
            return
        except OSError:
            if is_converted(out, source):
                logger.info("%s was converted concurrently; keeping that copy", out)
                return
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        try:
            os.rename(out, trash / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not move the converted model into {out}")
