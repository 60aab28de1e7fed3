"""GGUF → HF conversion, checked against tiny transformers models written the way
llama.cpp's convert_hf_to_gguf.py writes them (same q/k permutation, metadata keys,
tensor names from gguf's own name map, quantization from gguf.quants)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mooncaked.engine.gguf_loader import (
    UnsupportedGGUFError,
    convert_gguf,
    is_converted,
    llama3_rope_scaling,
    read_gguf,
)

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n'}}{% endfor %}")
PROMPT = "hello world, the capital of France is Paris 2024 <|im_end|>"
# Error bound of each storage type, relative to the tensor's max |value|: a half
# step of rounding, or for the symmetric Q*_0 types one full step where the
# extreme value of the other sign is clipped (Q4_0: max/8, Q5_0: max/16).
TOLERANCE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q5_1: 0.035,
             Q.Q4_0: 0.13, Q.Q4_1: 0.07}


def converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute, with n_head already chosen (q: heads, k: kv heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class Vocab:
    """Tokenizer metadata for the GGUF, as the converter writes it."""

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = "smollm"
    bos: int = 1
    eos: int = 2
    add_bos: bool = False


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A small byte-level BPE with SmolLM2's pre-tokenizer, trained here (no hub).

    Trained before the digit splitter is added, so it holds digit merges ("20")
    that only the right pre-tokenizer keeps from applying.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10 + [PROMPT] * 5, trainer)
    assert len(tok.encode("2024").tokens) < 4
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.fixture(scope="module")
def bpe_vocab(bpe: Tokenizer) -> Vocab:
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(bpe.to_str())["model"]["merges"]
    return Vocab("gpt2", tokens, [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                                  for t in tokens],
                 merges=[m if isinstance(m, str) else " ".join(m) for m in merges])


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                    tie_word_embeddings=False)
    config = LlamaConfig(**(settings | overrides))
    return _randomize(LlamaForCausalLM(config))


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    return _randomize(Qwen2ForCausalLM(config))


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Larger-than-init weights, so that a wrong permutation visibly changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


def write_gguf(path: Path, model: torch.nn.Module, vocab: Vocab, qtype: Q = Q.F32, *,
               arch: str = "llama", overrides: dict[str, tuple[np.ndarray, Q]] | None = None,
               rope_freqs: np.ndarray | None = None) -> Path:
    """Write `model` as convert_hf_to_gguf.py would; `overrides` replaces stored tensors by name."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _write_vocab(writer, vocab)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg.num_hidden_layers)
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = value.detach().float()
        if arch == "llama" and ".q_proj." in hf_name:
            data = converter_permute(data, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf_name:
            data = converter_permute(data, cfg.num_key_value_heads)
        stored_type = qtype if data.ndim == 2 else Q.F32  # llama.cpp keeps norms/biases in F32
        data_np, stored_type = (overrides or {}).get(name, (data.numpy(), stored_type))
        if data_np.dtype == np.float32 and stored_type != Q.F32:
            data_np = gguf.quants.quantize(data_np, stored_type)
        writer.add_tensor(name, data_np, raw_dtype=stored_type)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _write_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def stored_tensors(path: Path) -> dict[str, np.ndarray]:
    """What the file holds, dequantized by gguf itself, in torch's axis order."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            for t in reader.tensors}


def hf_logits(model: torch.nn.Module, bpe: Tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([bpe.encode(PROMPT).ids])).logits


def test_f32_tensors_equal_hf_exactly_with_qk_permutation_undone(tmp_path: Path, bpe_vocab: Vocab) -> None:
    model = tiny_llama()
    read = read_gguf(write_gguf(tmp_path / "m.gguf", model, bpe_vocab))
    expected = model.state_dict()
    assert set(read.tensors) == set(expected)
    for name, value in expected.items():
        assert read.tensors[name].dtype == torch.float32
        assert torch.equal(read.tensors[name], value), name
    # the stored q rows really were permuted, so equality above means we undid it
    assert not torch.equal(converter_permute(expected["model.layers.0.self_attn.q_proj.weight"], 4),
                           expected["model.layers.0.self_attn.q_proj.weight"])


def test_config_round_trips(tmp_path: Path, bpe_vocab: Vocab) -> None:
    model = tiny_llama()
    config = read_gguf(write_gguf(tmp_path / "m.gguf", model, bpe_vocab)).config
    want = model.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "rms_norm_eps"):
        assert config[key] == getattr(want, key), key
    assert config["head_dim"] == 16 and config["rope_theta"] == 10000.0
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert config["torch_dtype"] == "float32" and "rope_scaling" not in config


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
def test_quantized_tensors_match_gguf_dequantize(tmp_path: Path, bpe_vocab: Vocab, qtype: Q) -> None:
    model = tiny_llama()
    path = write_gguf(tmp_path / "m.gguf", model, bpe_vocab, qtype)
    read, stored = read_gguf(path).tensors, stored_tensors(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for hf_name, original in model.state_dict().items():
        ours = read[hf_name]
        as_stored = ours
        if ".q_proj." in hf_name:
            as_stored = converter_permute(ours, 4)
        if ".k_proj." in hf_name:
            as_stored = converter_permute(ours, 2)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        np.testing.assert_array_equal(as_stored.numpy(), stored[gguf_name], err_msg=hf_name)
        bound = TOLERANCE[qtype] * original.abs().max().item()
        assert (ours - original).abs().max().item() <= bound, hf_name


@pytest.mark.parametrize("attention_bias", [False, True])
def test_converted_folder_gives_hf_logits(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab,
                                          attention_bias: bool) -> None:
    model = tiny_llama(attention_bias=attention_bias)
    folder = convert_gguf(write_gguf(tmp_path / "m.gguf", model, bpe_vocab), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(hf_logits(loaded, bpe), hf_logits(model, bpe), rtol=0, atol=1e-5)


def test_qwen2_is_not_unpermuted_and_keeps_biases(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab) -> None:
    model = tiny_qwen2()
    folder = convert_gguf(write_gguf(tmp_path / "m.gguf", model, bpe_vocab, arch="qwen2"), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(loaded, Qwen2ForCausalLM)
    torch.testing.assert_close(hf_logits(loaded, bpe), hf_logits(model, bpe), rtol=0, atol=1e-5)


def test_q8_0_model_stays_close_to_hf(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab) -> None:
    model = tiny_llama()
    folder = convert_gguf(write_gguf(tmp_path / "m.gguf", model, bpe_vocab, Q.Q8_0), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    want, got = hf_logits(model, bpe), hf_logits(loaded, bpe)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def _llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 2000}
    model = tiny_llama(rope_scaling=scaling, max_position_embeddings=16000)
    plain = tiny_llama(max_position_embeddings=16000)
    assert not torch.allclose(hf_logits(model, bpe), hf_logits(plain, bpe), atol=1e-4)  # scaling matters
    factors = _llama3_factors(16, 10000.0, 8.0, 1.0, 8.0, 2000)
    path = write_gguf(tmp_path / "m.gguf", model, bpe_vocab, rope_freqs=factors)
    folder = convert_gguf(path, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(hf_logits(loaded, bpe), hf_logits(model, bpe), rtol=0, atol=1e-5)


def test_llama3_rope_scaling_of_llama_3_1() -> None:
    factors = _llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    scaling = llama3_rope_scaling(factors, 128, 500000.0, 131072)
    assert scaling is not None and scaling["original_max_position_embeddings"] == 8192
    assert scaling["factor"] == pytest.approx(8.0)
    assert scaling["low_freq_factor"] == pytest.approx(1.0, rel=1e-3)
    assert scaling["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)
    assert llama3_rope_scaling(np.ones(64, np.float32), 128, 500000.0, 8192) is None


def test_tokenizer_matches_the_original(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab) -> None:
    read = read_gguf(write_gguf(tmp_path / "m.gguf", tiny_llama(), bpe_vocab))
    tok = read.tokenizer
    for text in (PROMPT, "The lazy dog 1234567 jumps!", "café ☕ naïve", "  two\n\nlines  ",
                 "<|im_start|>user\nhello<|im_end|>\n"):
        assert tok.encode(text).ids == bpe.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]
    assert read.tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert read.tokenizer_config["bos_token"] == "<|im_start|>"
    assert read.tokenizer_config["eos_token"] == "<|im_end|>"
    assert read.tokenizer_config["add_bos_token"] is False


def test_sentencepiece_llama_tokenizer(tmp_path: Path) -> None:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello",
              "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    vocab = Vocab("llama", tokens, types, scores=scores, pre=None, add_bos=True)
    read = read_gguf(write_gguf(tmp_path / "m.gguf", tiny_llama(), vocab))
    tok = read.tokenizer
    assert tok.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]
    assert tok.encode("hé").tokens == ["<s>", "▁h", "<0xC3>", "<0xA9>"]
    for text in ("hello world", "hé", "world hello"):
        assert tok.decode(tok.encode(text).ids) == text
    assert read.tokenizer_config["add_bos_token"] is True


def test_unknown_architecture_is_named(tmp_path: Path, bpe_vocab: Vocab) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_llama(), bpe_vocab, arch="mamba")
    with pytest.raises(ValueError, match="'mamba'"):
        read_gguf(path)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path, bpe_vocab: Vocab) -> None:
    raw = np.random.default_rng(0).integers(0, 255, size=(128, 64 // 32 * 18), dtype=np.uint8)
    path = write_gguf(tmp_path / "m.gguf", tiny_llama(), bpe_vocab,
                      overrides={"blk.1.ffn_up.weight": (raw, Q.IQ4_NL)})
    with pytest.raises(UnsupportedGGUFError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL"):
        read_gguf(path)
    # a failed conversion leaves neither the folder nor its temporary
    with pytest.raises(UnsupportedGGUFError):
        convert_gguf(path, tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []


def test_convert_writes_complete_folder_atomically(tmp_path: Path, bpe_vocab: Vocab) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_llama(), bpe_vocab)
    out = tmp_path / "models" / "tiny"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: convert_gguf(path, out), range(2)))
    assert results == [out, out] and is_converted(out, path)
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temporaries left
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("<|im_end|>").ids == [2]
    # a stale folder (other source) is replaced, not merged into
    (out / "conversion.json").write_text("{}")
    (out / "stale.txt").write_text("x")
    convert_gguf(path, out)
    assert is_converted(out, path) and not (out / "stale.txt").exists()


def test_our_engine_serves_a_gguf_file_like_transformers(tmp_path: Path, bpe: Tokenizer, bpe_vocab: Vocab) -> None:
    """`Engine.from_pretrained("x.gguf")`: converted once into the cache, then logits and greedy
    tokens equal transformers running the original weights."""
    from mooncaked.engine import Engine, SamplingParams

    model = tiny_llama()
    path = write_gguf(tmp_path / "m.gguf", model, bpe_vocab)
    engine = Engine.from_pretrained(path, cache_dir=tmp_path / "cache", dtype="float32", block_size=4,
                                    kv_cache_bytes=4 << 20)
    ids = bpe.encode(PROMPT).ids
    torch.testing.assert_close(engine.score(ids, chunk_size=5), hf_logits(model, bpe)[0], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    assert engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids == want
    again = Engine.from_pretrained(path, cache_dir=tmp_path / "cache", block_size=4, kv_cache_bytes=4 << 20)
    assert again.model_dir == engine.model_dir  # the conversion is reused
