"""Request bodies -> JSON values that are safe to use: malformed text is a 400, never a 500.

``json.loads`` alone lets through what breaks later: a lone UTF-16 surrogate (``"\\ud800"``) is a
valid JSON escape but no valid Unicode, so the tokenizer or protobuf failed on it with a 500; and
nesting deep enough to pass the parser can still overflow the code that walks or prints it. Both
are refused here, in one pass that runs only when the raw bytes could hold them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mooncaked.conductor.openai_schema import bad

MAX_DEPTH = 64  # arrays and objects inside each other; no request of ours needs more than a few
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # \uD800-\uDFFF, paired or not


def decode_json(raw: bytes) -> Any:
    """Parse a UTF-8 JSON body; ApiError 400 with a plain reason when it cannot be used."""
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (at byte {e.start})") from None
    except RecursionError:
        raise bad(f"the request body is nested too deep (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, and integers of more digits than Python converts
        raise bad(f"the request body is not valid JSON: {e}") from None
    may_nest = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
    if may_nest or _SURROGATE_ESCAPE.search(raw):
        _check(value, may_nest)
    return value


def _check(value: Any, depth_too: bool) -> None:
    """Walk the value (iteratively: no recursion to overflow) for lone surrogates and depth."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "body")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _text(v, where)
            continue
        if not isinstance(v, (list, dict)):
            continue
        if depth_too and depth > MAX_DEPTH:
            raise bad(f"the request body is nested too deep (more than {MAX_DEPTH} levels)")
        if isinstance(v, dict):
            for k, item in v.items():
                _text(k, f"{where} key {k[:40]!r}")
                stack.append((item, depth + 1, k if where == "body" else f"{where}.{k}"))
        else:
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(v))


def _text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{where} holds a lone UTF-16 surrogate ({s[e.start]!r} at character {e.start}), which is "
                  "not valid Unicode", where if where != "body" else None) from None
