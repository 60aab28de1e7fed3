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
    stage_of = getattr(model, "param_name", None)
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
            if stage_of is not None:
                target = stage_of(target)  # a pipeline stage holds only its own layers (and ends)
                if target is None:
                    continue
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
    expected = set(checkpoint_shapes(cfg))
    if stage_of is not None:
        expected = {n for n in expected if stage_of(n.removeprefix("model.")) is not None}
    missing = sorted(expected - filled)
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``cfg`` must hold, with its shape."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return shapes


def check_checkpoint(cfg: ModelConfig, model_dir: Path) -> None:
    """Compare the safetensors headers (no tensor is read) with what ``cfg`` needs, before a model of
    ``cfg``'s size is allocated: a config.json that claims more than its weights hold is refused here."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors weights")
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    found[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad header
            raise ConfigError(f"{f} is not a readable safetensors file ({e}): download it again") from e
    expected = checkpoint_shapes(cfg)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ConfigError(f"checkpoint tensor {name} has shape {found[name]}, but config.json says {shape}")
