"""tools/shaped_model.py: the GPU bench's stand-in has the default model's shape, loads and decodes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from shaped_model import SHAPES, write_shaped_model  # noqa: E402

from mooncaked.engine import Engine, SamplingParams  # noqa: E402
from mooncaked.engine.default_model import default_model_dir  # noqa: E402


def test_the_smollm2_shape_is_the_default_models():
    real = json.loads((default_model_dir() / "config.json").read_text())
    shape = SHAPES["smollm2-135m"]
    assert {k: real.get(k) for k in shape} == shape


def test_a_shaped_checkpoint_loads_and_every_id_it_emits_decodes(tmp_path):
    vocab = SHAPES["smollm2-135m"]["vocab_size"]
    folder = write_shaped_model(tmp_path / "m", dtype=torch.float32, num_hidden_layers=1, hidden_size=64,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    engine = Engine.from_pretrained(folder, dtype="float32", block_size=16, kv_cache_bytes=4 << 20)
    cfg = engine.model_config
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == (vocab, 1, 64, 2)
    prompt = [vocab - 1, 100, 40_000, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    assert out.text.split() == [f"t{i}" for i in out.token_ids]
    assert engine.tokenizer.encode(f"t{vocab - 1} t40000") == [vocab - 1, 40_000]
