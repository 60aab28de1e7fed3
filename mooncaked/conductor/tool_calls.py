"""OpenAI function calling (``tools``, ``tool_choice``) in chat completions, for any model.

Chat templates differ in whether and how they show tools (the default model's shows none), so the tools are
described in the system message, and the answer is held to a grammar (engine/grammar.py): with
``"required"`` or a named function, exactly one call as JSON, ``{"name": ..., "arguments": {...}}``, its
arguments held to the function's own JSON schema; with ``"auto"``, either such a call or text that does not
start with ``{``. A call in the answer becomes the message's ``tool_calls`` (finish reason
``tool_calls``). Earlier calls and their results in ``messages`` are shown to the model in the same form.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 64
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_FORMAT = '{"name": <function name>, "arguments": <its arguments as a JSON object>}'


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` the front cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """The functions a request offers, and how the answer may use them."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} each
    choice: str  # "auto", "required", or the one function's name that must be called

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None when it offers none or says ``tool_choice: "none"``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                            '{...}}}}, its name 1-64 of a-z, A-Z, 0-9, _ and -', f"tools[{i}]")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or not isinstance(f.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object and its description a "
                            "string", f"tools[{i}]")
        functions.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    if len({f["name"] for f in functions}) != len(functions):
        raise ToolError("tools must have distinct names", "tools")
    if choice in (None, "auto", "required", "none"):
        return None if choice == "none" else Tools(tuple(functions), choice or "auto")
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str) or name not in {f["name"] for f in functions}:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": <one of the tools>}}', "tool_choice")
    return Tools(tuple(functions), name)


def system_text(tools: Tools) -> str:
    """What the model is told of the tools, after any system message of the request's own."""
    listed = json.dumps([{k: f[k] for k in ("name", "description", "parameters")} for f in tools.functions])
    if tools.choice == "auto":
        how = f"To call one, answer with only this JSON and nothing else: {CALL_FORMAT}. Otherwise answer in text."
    elif tools.choice == "required":
        how = f"Answer with a call of one of them, as only this JSON: {CALL_FORMAT}."
    else:
        how = f"Answer with a call of {tools.choice}, as only this JSON: {CALL_FORMAT}."
    return f"You can call these functions:\n{listed}\n{how}"


def call_schema(tools: Tools) -> dict[str, Any]:
    """The JSON schema of one call the answer may make. Arguments that list their properties and say nothing
    of others get no others (a model asked for a city must not invent a country), as OpenAI's strict mode."""
    offered = [f for f in tools.functions if tools.choice in ("auto", "required") or f["name"] == tools.choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _closed(f["parameters"])},
              "required": ["name", "arguments"], "additionalProperties": False} for f in offered]
    return {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def grammar_source(tools: Tools) -> tuple[str, str]:
    """``("json", schema)`` for a call that must come, ``("lark", grammar)`` for a call or text."""
    schema = json.dumps(call_schema(tools))
    if tools.choice != "auto":
        return "json", schema
    return "lark", f"start: call | text\ncall: %json {schema}\ntext: /[^{{][\\s\\S]*/\n"


def calls_in(text: str, tools: Tools) -> list[dict[str, Any]] | None:
    """The answer's call as OpenAI's ``tool_calls``, or None when it answered in text."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None  # cut short (max_tokens): the text is returned as it is
    if not isinstance(call, dict) or call.get("name") not in tools.names:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}]


def shown_content(message: dict, i: int) -> str | None:
    """An assistant message's earlier ``tool_calls`` as the model would have written them (None: it has none)."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"messages[{i}].tool_calls must be a non-empty list", f"messages[{i}].tool_calls")
    shown = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise ToolError(f'messages[{i}].tool_calls holds {{"function": {{"name": ..., "arguments": "<JSON>"}}}}',
                            f"messages[{i}].tool_calls")
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            raise ToolError(f"messages[{i}].tool_calls: arguments must be a JSON string",
                            f"messages[{i}].tool_calls") from None
        shown.append(json.dumps({"name": f["name"], "arguments": args}))
    return "\n".join(shown)
