"""Structured outputs: a grammar turned into the tokens each step may choose.

The grammar is llguidance's (a JSON schema, a regex or Lark, compiled by ``json_schema_grammar`` /
``regex_grammar`` at the front that took the request), carried as a string in ``SamplingParams.grammar``
so that the prefill (the first token) and the decode (the rest) constrain alike. llguidance computes a
step's mask over the vocabulary from the model's own ``tokenizer.json`` in tens of microseconds; each
request has a ``Constraint`` (its matcher) that follows the tokens it produced.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_GRAMMAR_BYTES = 64 << 10  # a schema bigger than this is refused before it is compiled
NO_TOKEN = "the grammar (response_format) lets no token of this model's vocabulary come next"


def _llguidance():
    import llguidance  # lazily: only requests with a grammar need it

    return llguidance


def json_schema_grammar(schema: dict | bool) -> str:
    """A JSON schema as a grammar: compact JSON (no free whitespace, which a model could emit forever)."""
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def regex_grammar(regex: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str) -> str:
    """A grammar in llguidance's Lark dialect (``%json {schema}`` embeds a JSON schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def grammar_error(grammar: object) -> str | None:
    """Why ``grammar`` cannot constrain a request, or None: checked before the request is queued (by each
    process it passes through; the last answers are remembered, as most requests repeat a few schemas)."""
    if not isinstance(grammar, str) or not grammar:
        return "grammar must be a non-empty string"
    if len(grammar.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        return f"the grammar is over {MAX_GRAMMAR_BYTES} bytes"
    return _checked(grammar)


@functools.lru_cache(maxsize=64)  # at most 64 x 64 KiB held
def _checked(grammar: str) -> str | None:
    """llguidance's check (a wide schema near the bound: ~16 ms)."""
    failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    return f"the grammar is not valid: {messages[0]}" if failed else None


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it (built once per engine: ~0.2 s for 49k tokens)."""

    def __init__(self, model_dir: Path, eos_ids: set[int] | frozenset[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ll = _llguidance().LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=vocab_size,
                                            eos_token=sorted(eos_ids) or None)


class Constraint:
    """One request's grammar state: which tokens may come next, and whether it is complete. One that
    could not be made (``failed``) allows nothing and says why, so only its own request fails."""

    def __init__(self, tokenizer: GrammarTokenizer | None, grammar: str, produced: list[int],
                 failed: str | None = None) -> None:
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
        self.failed = failed
        self.matcher = _llguidance().LLMatcher(tokenizer.ll, grammar, log_level=0) if tokenizer is not None else None
        if produced and self.error is None:  # a decode instance's: the prefill chose the first token
            self.matcher.consume_tokens(produced)

    @classmethod
    def for_request(cls, model_dir: Path, eos_ids: frozenset[int], vocab_size: int, grammar: str,
                    produced: list[int]) -> "Constraint":
        tok = grammar_tokenizer(model_dir, eos_ids, vocab_size)
        if isinstance(tok, str):  # no tokenizer.json, or one llguidance cannot read: this request fails
            return cls(None, grammar, produced, failed=f"the grammar cannot be applied to this model: {tok}")
        return cls(tok, grammar, produced)

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a token it did not allow, a limit), or None."""
        if self.matcher is None:
            return self.failed or "the grammar failed"
        return (self.matcher.get_error() or "the grammar failed") if self.matcher.is_error() else None

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more."""
        return self.matcher is not None and self.matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens that may come next (EOS among them once the output may end)."""
        if self.error is not None:
            return torch.zeros(max(self.vocab_size, 1), dtype=torch.bool)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(np.bool_))

    def accept(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.consume_token(token)


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(model_dir: Path, eos_ids: frozenset[int], vocab_size: int) -> GrammarTokenizer | str:
    """The model's GrammarTokenizer, or why there is none (said once; each request then fails with it)."""
    try:
        return GrammarTokenizer(model_dir, eos_ids, vocab_size)
    except Exception as e:
        log.warning("requests with a grammar cannot be served for %s: %s", model_dir, e)
        return str(e)
