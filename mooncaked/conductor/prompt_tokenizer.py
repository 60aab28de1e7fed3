"""Tokenizing prompts off the conductor's event loop, and refusing long ones before any work.

The conductor's one event loop also answers the engines' heartbeats: a multi-megabyte prompt
tokenized on it stalled it for seconds and got every engine marked dead. So prompts are rendered
(chat template) and tokenized in a small thread pool (the Rust tokenizer releases the GIL while it
works, see ``Tokenizer.encode``), and a prompt whose characters cannot possibly fit in the context
is refused without tokenizing it at all.

That character bound must never refuse a prompt that fits: ``chars_per_token`` reads the
tokenizer's own description (tokenizer.json) and gives the most characters one token can stand
for, or None when no such bound exists (a word-level model whose unknown token swallows any word,
a pre-tokenizer that drops whitespace, a normalizer that deletes text). Then only the request body
limit bounds the work.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
import logging
import math
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.engine import RequestError
from mooncaked.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# half the cores at most: tokenizing threads busy on every core would starve the event loop (and the
# engines beside the conductor) of CPU, if not of the GIL
TOKENIZE_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
# normalizers that never shrink text by more than this factor (NFC/NFKC compose a base and up to
# three combining marks, e.g. U+1F85, into one character)
TRIM_AFTER_CHARS = 1 << 18  # after tokenizing this much text, hand the freed heap back to the system
_COMPOSING = {"NFC": 4.0, "NFKC": 4.0}
_KEEPING = {"NFD", "NFKD", "Lowercase", "Prepend"}  # never shorten text
# pre-tokenizers that split text without dropping any of it (unless their behavior is "removed")
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None: the tokenizer's big temporary buffers, freed in a pool thread's
    arena, otherwise stay in the conductor's RSS."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def _release_memory(text: str) -> None:
    trim = _malloc_trim()
    if trim is not None and len(text) >= TRIM_AFTER_CHARS:
        trim(0)


def _normalizer_factor(spec: dict | None) -> float | None:
    """How many input characters at most become one normalized character (None: unbounded)."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind in _KEEPING:
        return 1.0
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" in pattern and content:
            return max(1.0, len(pattern["String"]) / len(content))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex Replace: may delete text


def _keeps_all_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_all_text(p) for p in spec.get("pretokenizers", []))
    return kind in _SPLITTING and str(spec.get("behavior", "")).lower() != "removed"


def _model_bounded(spec: dict) -> bool:
    """False when one token can stand for any number of characters (an unknown-word token)."""
    kind = spec.get("type")
    if kind == "BPE":
        return not (spec.get("unk_token") and spec.get("fuse_unk"))
    if kind == "WordLevel":
        return not spec.get("unk_token")
    if kind == "Unigram":
        return spec.get("unk_id") is None or bool(spec.get("byte_fallback"))
    return False  # WordPiece: a word longer than max_input_chars_per_word becomes one [UNK]


def _vocab_strings(model: dict) -> Iterable[str]:
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        return vocab.keys()
    return (entry[0] for entry in vocab)  # Unigram: [piece, score] pairs


def chars_per_token(spec: dict[str, Any]) -> float | None:
    """The most characters of a prompt one token can cover, from a tokenizer.json's contents;
    None when the tokenizer has no such bound.

    A token's string in the vocabulary is never shorter than the text it covers: byte-level
    tokens spell one byte per character (a character is at least one byte), Metaspace's "▁" is
    one space, byte-fallback tokens ("<0xE4>") cover one byte. Normalizers that shrink text
    multiply the bound."""
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token swallows the whitespace beside it, however long
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_all_text(spec.get("pre_tokenizer")) or not _model_bounded(model):
        return None
    longest = max((len(s) for s in _vocab_strings(model)), default=0)
    longest = max([longest] + [len(t.get("content", "")) for t in added])
    return longest * factor if longest else None


def read_chars_per_token(model_dir: Path) -> float | None:
    """``chars_per_token`` of the model folder's tokenizer.json (None when it cannot be read)."""
    try:
        spec = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:
        log.warning("no character bound for prompts: cannot read %s/tokenizer.json: %s", model_dir, e)
        return None
    return chars_per_token(spec) if isinstance(spec, dict) else None


class TextTooLong(RequestError):
    """A prompt whose characters alone cannot fit in the context (refused before tokenizing)."""


@dataclass
class PromptTokenizer:
    """Prompt text -> token ids in a bounded thread pool, refusing text too long to fit first.

    ``max_context`` is the model's context in tokens; ``chars_per_token`` as ``chars_per_token``
    gives it (None: no character bound)."""

    tokenizer: Tokenizer
    max_context: int
    chars_per_token: float | None = None
    threads: int = TOKENIZE_THREADS
    _pool: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, model_dir: Path, max_context: int) -> PromptTokenizer:
        bound = read_chars_per_token(model_dir)
        log.info("prompts longer than %s characters are refused without tokenizing",
                 "(no bound for this tokenizer)" if bound is None else math.ceil(max_context * bound))
        return cls(tokenizer, max_context, bound)

    @property
    def max_chars(self) -> int | None:
        """Characters above which a text cannot fit in the context (None: no bound)."""
        if self.chars_per_token is None:
            return None
        return math.ceil(self.max_context * self.chars_per_token)

    def check_chars(self, text: str, what: str = "the prompt") -> None:
        limit = self.max_chars
        if limit is not None and len(text) > limit:
            raise TextTooLong(f"{what} is too long: {len(text)} characters cannot fit in the model's context of "
                              f"{self.max_context} tokens (this tokenizer's tokens hold at most "
                              f"{self.chars_per_token:g} characters each)")

    async def encode(self, text: str) -> list[int]:
        """Plain text (no chat template)."""
        self.check_chars(text)  # before the thread hop: the cheapest refusal
        return await self._run(self._encode, text)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Messages through the model's chat template (rendered in the pool too: it can be long)."""
        return await self._run(self._encode_chat, messages)

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        finally:
            _release_memory(text)

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages)
        self.check_chars(text, "the conversation")
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        finally:
            _release_memory(text)

    async def _run(self, fn, arg) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
