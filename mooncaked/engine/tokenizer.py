"""Text <-> token ids with the `tokenizers` library, the model's chat template, and
incremental detokenization for streams."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long prompt tokenized
        # in a conductor thread must not stall the event loop that answers heartbeats
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.token_id(self.bos_token)
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Holds back text that ends in an incomplete UTF-8 sequence, and enough characters to
    recognise a stop string that is still being generated.
    """

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""  # everything decoded so far (stop string excluded once found)
    emitted: int = 0  # characters of `text` already handed out
    _prefix_offset: int = 0
    _read_offset: int = 0

    def add(self, ids: list[int]) -> bool:
        """Decode up to ``ids`` (all output ids so far); True when a stop string was found."""
        prefix = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        for s in self.stop:
            # search only where a new match can start
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def take_delta(self, final: bool) -> str:
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
