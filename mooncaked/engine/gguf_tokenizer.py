"""GGUF metadata access and the tokenizer rebuilt from it with `tokenizers`.

llama.cpp keeps the vocabulary, merges, token types and pre-tokenizer name in the GGUF
metadata; we turn them back into a `tokenizers.Tokenizer` plus the HF tokenizer_config.
"""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

class UnsupportedGGUFError(ValueError):
    """The file is valid GGUF, but uses an architecture, tensor type or tokenizer we cannot convert."""


# tokenizer.ggml.pre → split regex before byte-level mapping (None: GPT-2's own regex).
_GPT2_PRE: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None, "mpt": None, "olmo": None, "jais": None,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# These split every digit, then apply GPT-2's regex (llama-vocab.cpp groups them so).
_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"})
_SPECIAL_TYPES = frozenset({gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN})


class GGUFMeta:
    """Key/value metadata of one GGUF file, with `{arch}` keys resolved."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields
        arch = self._fields.get(gguf.Keys.General.ARCHITECTURE)
        self.arch = "" if arch is None else str(arch.contents())

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedGGUFError(f"GGUF metadata lacks {key.format(arch=self.arch)!r}")
        return value


def build_tokenizer(meta: GGUFMeta) -> tuple[Tokenizer, dict[str, Any]]:
    keys = gguf.Keys.Tokenizer
    kind = meta.require(keys.MODEL)
    tokens: list[str] = meta.require(keys.LIST)
    types: list[int] = meta.get(keys.TOKEN_TYPE) or [gguf.TokenType.NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _bpe_tokenizer(meta, tokens)
        default_bos = False
    elif kind == "llama":
        tokenizer = _spm_tokenizer(meta, tokens, types)
        default_bos = True
    else:
        raise UnsupportedGGUFError(f"tokenizer model {kind!r} is not supported (gpt2, llama)")
    tokenizer.add_special_tokens([
        AddedToken(tok, special=True, normalized=False)
        for tok, ty in zip(tokens, types) if ty in _SPECIAL_TYPES])
    tokenizer.add_tokens([
        AddedToken(tok, special=False, normalized=False)
        for tok, ty in zip(tokens, types) if ty == gguf.TokenType.USER_DEFINED])
    config = _tokenizer_config(meta, tokens, default_bos)
    _set_post_processor(tokenizer, config, meta)
    return tokenizer, config


def _bpe_tokenizer(meta: GGUFMeta, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.require(gguf.Keys.Tokenizer.MERGES)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _bpe_pre_tokenizer(
        str(meta.get(gguf.Keys.Tokenizer.PRE, "default")),
        bool(meta.get(gguf.Keys.Tokenizer.ADD_PREFIX, False)))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bpe_pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    """Mirror the pre-tokenizer the model's own tokenizer.json uses (llama.cpp names it)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRE:
        raise UnsupportedGGUFError(f"tokenizer pre-tokenizer {pre!r} is not supported")
    regex = _GPT2_PRE[pre]
    if regex is None:
        return byte_level
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])


def _spm_tokenizer(meta: GGUFMeta, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE (llama/mistral): merges ranked by the score of the merged piece."""
    scores: list[float] = meta.require(gguf.Keys.Tokenizer.SCORES)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score, ty in zip(tokens, scores, types):
        if ty != gguf.TokenType.NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_id = meta.get(gguf.Keys.Tokenizer.UNK_ID)
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
        unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get(gguf.Keys.Tokenizer.ADD_PREFIX, True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tokenizer


def _tokenizer_config(meta: GGUFMeta, tokens: list[str], default_bos: bool) -> dict[str, Any]:
    keys = gguf.Keys.Tokenizer

    def token(key: str) -> str | None:
        token_id = meta.get(key)
        return None if token_id is None or token_id >= len(tokens) else tokens[token_id]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(keys.BOS_ID),
        "eos_token": token(keys.EOS_ID),
        "unk_token": token(keys.UNK_ID),
        "pad_token": token(keys.PAD_ID),
        "add_bos_token": bool(meta.get(keys.ADD_BOS, default_bos)),
        "add_eos_token": bool(meta.get(keys.ADD_EOS, False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(gguf.Keys.LLM.CONTEXT_LENGTH, 2048)),
    }
    template = meta.get(keys.CHAT_TEMPLATE)
    if template is not None:
        config["chat_template"] = template
    return config


def _set_post_processor(tokenizer: Tokenizer, config: dict[str, Any], meta: GGUFMeta) -> None:
    """Add BOS/EOS when the model wants them, as HF's tokenizer.json does."""
    before = [(config["bos_token"], meta.get(gguf.Keys.Tokenizer.BOS_ID))] if config["add_bos_token"] else []
    after = [(config["eos_token"], meta.get(gguf.Keys.Tokenizer.EOS_ID))] if config["add_eos_token"] else []
    if not before and not after:
        return
    pieces = [tok for tok, _ in before]
    tail = [tok for tok, _ in after]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(pieces + ["$A"] + tail),
        pair=" ".join(pieces + ["$A"] + tail + pieces + ["$B:1"] + tail),
        special_tokens=list(dict.fromkeys(before + after)))
