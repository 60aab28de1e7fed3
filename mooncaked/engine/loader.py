"""Find a model on disk and load its weights into our model, with no hub access.

``model`` is ``"default"`` (the bundled SmolLM2-135M-Instruct), an HF folder
(``config.json`` + ``*.safetensors``), or a ``.gguf`` file (converted once into a cache
folder). Checkpoint names are remapped here, and q/k/v and gate/up are fused, so the
model code never sees a checkpoint's layout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from mooncaked.engine.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


def resolve_model_dir(model: str | Path | None, cache_dir: Path | None = None) -> Path:
    """The HF-format folder that ``model`` names, converting a GGUF file once if needed."""
    if model is None or str(model) == "default":
        from mooncaked.engine.default_model import default_model_dir

        return default_model_dir(cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} not found: give 'default', an HF folder or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf" and not _starts_with_gguf_magic(path):
            raise ConfigError(f"model {str(model)!r} is a file but not a .gguf model: give 'default', "
                              "an HF folder (config.json + *.safetensors) or a .gguf file")
        from mooncaked.engine.default_model import cached_conversion

        return cached_conversion(path, cache_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {str(model)!r} has no config.json: give 'default', "
                          "an HF folder (config.json + *.safetensors) or a .gguf file")
    return path


def _starts_with_gguf_magic(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == b"GGUF"


def read_model_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{model_dir / 'config.json'} must hold a JSON object")
    try:
        return ModelConfig.from_hf(raw), raw
    except ConfigError as e:
        raise ConfigError(f"model {model_dir}: {e}") from e


def _checkpoint_tensors(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        try:
            st = safe_open(f, framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad header
            raise ConfigError(f"{f} is not a readable safetensors file ({e}): download it again") from e
        with st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_weights(model: torch.nn.Module, cfg: ModelConfig, model_dir: Path, dtype: torch.dtype) -> None:
    """Copy checkpoint tensors into ``model``, fusing projections; every parameter must be filled."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {
        "q_proj": ("qkv_proj", 0, q_size),
        "k_proj": ("qkv_proj", q_size, kv_size),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
        "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
        "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
    }
    with torch.no_grad():
        for name, tensor in _checkpoint_tensors(model_dir):
            if "rotary_emb" in name:
                continue
            target = name.removeprefix("model.")
            if target == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = target.split(".")
            offset = None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, offset, size = fused[parts[-2]]
                parts[-2] = fused_name
            target = ".".join(parts)
            if target not in params:
                log.debug("ignoring checkpoint tensor %s", name)
                continue
            param = params[target]
            dest = param.data if offset is None else param.data.narrow(0, offset, size)
            if dest.shape != tensor.shape:
                raise ConfigError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dtype))
            filled.add(name)
    expected = _expected_checkpoint_names(cfg)
    missing = sorted(expected - filled)
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _expected_checkpoint_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names
