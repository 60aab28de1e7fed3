"""Tiny random HF checkpoints of each supported architecture, written to disk for the tests.

The oracle is `transformers` itself running the same files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from shaped_model import write_word_tokenizer  # noqa: E402  (the benches' stand-in models use the same one)

VOCAB = 256

ARCH_KW: dict[str, dict] = {
    # llama3 rope scaling with a small original context so that long prompts exercise it; tied embeddings
    "llama": dict(tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=24),
}


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over tokens "t0".."t255": text round-trips and stop strings can be tested."""
    write_word_tokenizer(folder, VOCAB)


def make_tiny_model(arch: str, folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_position_embeddings: int = 512, num_layers: int = 2, hidden_size: int = 64):
    """Build, save and return (HF model, folder) for one architecture; a longer context for long-prompt tests."""
    import transformers

    cls_name, cfg_name = {
        "llama": ("LlamaForCausalLM", "LlamaConfig"),
        "mistral": ("MistralForCausalLM", "MistralConfig"),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    }[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **ARCH_KW[arch],
    )
    model = getattr(transformers, cls_name)(cfg)
    # random init is small; scale weights up so logits are far apart and greedy choices are stable
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "bias" in name:
                p.normal_(0, 0.5)
    model = model.to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model, folder


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], device=model.device)).logits[0].float()
