"""The chat format every service agrees on: the ChatML template with Hermes-style tool calls, its marker tokens,
the one `ToolCall`, and the parser (and writer) of `<tool_call>` blocks. Pure: no I/O beyond reading the template.

The format (shared/chat_template.jinja; the gateway renders with it and parses generations back):
  <|im_start|>system\\n{system text}<|im_end|>\\n                   -- only when a system message or tools exist
  With tools the system turn is:
  <|im_start|>system\\n{system text}\\n\\n# Tools\\n\\n...<tools>\\n{tool json}\\n...\\n</tools>\\n\\n...<|im_end|>\\n
      (one tool per line: `tojson` (json.dumps, ", "/": " separators, key order kept) of an OpenAI tool's
      `function` object, or of the tool itself for other shapes such as Anthropic's name/input_schema)
  <|im_start|>user\\n{text}<|im_end|>\\n
  <|im_start|>assistant\\n{text}<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call><|im_end|>\\n
      (several calls: each `<tool_call>` block after the previous one, separated by "\\n"; when the text is
      non-empty the first block is preceded by "\\n"; ARGS is a JSON object, or a given JSON string verbatim)
  Consecutive `tool` messages form ONE user turn:
  <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
  Any other role (e.g. a later `system` message) renders as <|im_start|>{role}\\n{text}<|im_end|>\\n.
  add_generation_prompt appends `<|im_start|>assistant\\n`.
  Content may be a string or a list of parts ({"text": ...} or strings); parts are concatenated.
A generation ends with `<|im_end|>` (the EOS). `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>` are single non-special tokens, so they survive
`skip_special_tokens=True` decoding; `parse_tool_calls` extracts the calls from decoded text (the format is
Hermes/Qwen's, so vLLM's `hermes` tool parser reads it too). Other families' ways of writing a call, and how a
checkpoint's is detected from its template: shared/tool_formats.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# Who wrote a message (not to be confused with a cell's role, `shared.cells.Role`).
MessageRole = Literal["system", "user", "assistant", "tool"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Special tokens are dropped by skip_special_tokens decoding; the tool-call markers must not be.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS: tuple[str, ...] = (
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


class ToolCall(BaseModel):
    """One function call the model made: a `<tool_call>` block, with `arguments` the decoded JSON object."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: dict[str, Any]


class ParsedReply(BaseModel):
    """A generation split into its free text, its well-formed tool calls, and the raw malformed blocks."""

    model_config = ConfigDict(frozen=True)

    content: str
    tool_calls: tuple[ToolCall, ...]
    malformed: tuple[str, ...]


def chat_template() -> str:
    """The Jinja chat template shipped with `shared` (see the module docstring for the format)."""
    return resources.files("shared").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def template_tool_call(call: ToolCall) -> dict[str, Any]:
    """A tool call in the OpenAI shape the chat template reads."""
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def template_tool(name: str, description: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A tool definition in the OpenAI function shape the chat template reads."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> ParsedReply:
    """Split decoded assistant text into content and tool calls.

    A block is well-formed when it holds a JSON object with a string "name" and an "arguments" object
    (or a string containing one). Anything else between the markers, and an unterminated `<tool_call>`
    (a generation cut off by max_tokens), is returned verbatim in `malformed` so the caller can retry.
    """
    calls: list[ToolCall] = []
    malformed: list[str] = []
    pieces: list[str] = []
    cursor = 0
    for match in _TOOL_CALL_RE.finditer(text):
        pieces.append(text[cursor : match.start()])
        cursor = match.end()
        call = _parse_call_body(match.group(1))
        if call is None:
            malformed.append(match.group(0))
        else:
            calls.append(call)
    tail = text[cursor:]
    open_at = tail.find(TOOL_CALL_OPEN)
    if open_at >= 0:
        malformed.append(tail[open_at:])
        tail = tail[:open_at]
    pieces.append(tail)
    return ParsedReply(content="".join(pieces).strip(), tool_calls=tuple(calls), malformed=tuple(malformed))


def _parse_call_body(body: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(body))
    except json.JSONDecodeError:
        return None


def call_from_object(obj: Any, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call a decoded JSON value stands for: an object with a string "name" and, under the first of `keys` it
    has, an arguments object (or a string holding one); None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(name=obj["name"], arguments=arguments) if isinstance(arguments, dict) else None


def format_tool_call(name: str, arguments: Mapping[str, Any], text: str = "") -> str:
    """The assistant text the template gives one tool call after `text` (the inverse of `parse_tool_calls`)."""
    block = f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{TOOL_CALL_CLOSE}"
    return f"{text}\n{block}" if text else block


def tool_call_regex(tools: Sequence[tuple[str, Mapping[str, Any]]], names: Sequence[str]) -> str:
    """A regex for one `<tool_call>` block calling one of `names` (guided decoding for tool_choice any/tool).

    `tools` are (name, JSON schema of the arguments); the call inside is `object_pattern`'s."""
    return TOOL_CALL_OPEN + "\n" + object_pattern(tools, names) + "\n" + TOOL_CALL_CLOSE


def object_pattern(tools: Sequence[tuple[str, Mapping[str, Any]]], names: Sequence[str], *,
                   arguments_key: str = "arguments") -> str:
    """A regex for the JSON object of one call to one of `names`: `{"name": NAME, "<arguments_key>": {...}}`.

    Arguments cover the schema's required scalar properties (all scalar ones when none are required), with short
    safe values; that is enough for a small model to produce a well-formed call.
    """
    alternatives = []
    for name, parameters in tools:
        if name not in names:
            continue
        props = parameters.get("properties") or {}
        required = [k for k in parameters.get("required") or [] if k in props]
        keys = required or list(props)
        fields = []
        for key in keys:
            spec = props.get(key)
            kind = spec.get("type", "string") if isinstance(spec, dict) else "string"  # `true`: any value
            value = _VALUE_PATTERNS.get(kind if isinstance(kind, str) else "string")
            if value is None:
                if key in required:
                    value = _VALUE_PATTERNS["string"]
                else:
                    continue
            fields.append(re.escape(json.dumps(key)) + ": " + value)
        args = r"\{" + ", ".join(fields) + r"\}"
        alternatives.append(r'\{"name": ' + re.escape(json.dumps(name)) + ", " + re.escape(json.dumps(arguments_key))
                            + ": " + args + r"\}")
    if not alternatives:
        raise ValueError(f"no tool named any of {list(names)}")
    return "(" + "|".join(alternatives) + ")"


_VALUE_PATTERNS = {
    "string": r'"[a-zA-Z0-9 ._/-]{1,24}"',
    "integer": r"-?[0-9]{1,6}",
    "number": r"-?[0-9]{1,6}",
    "boolean": r"(true|false)",
}

__all__ = [
    "ADDED_TOKENS",
    "EOS_TOKEN",
    "MessageRole",
    "PAD_TOKEN",
    "ParsedReply",
    "SPECIAL_TOKENS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCall",
    "call_from_object",
    "chat_template",
    "format_tool_call",
    "object_pattern",
    "parse_tool_calls",
    "template_tool",
    "template_tool_call",
    "tool_call_regex",
]
