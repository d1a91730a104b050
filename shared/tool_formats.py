"""Tool-call formats: how a model family writes a tool call in the text it generates, so that the gateway reads
the calls back out of any checkpoint's replies (and constrains decoding to one when a request forces a tool).

  hermes       <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>  one block a call, after any text (Qwen 2.5
               and 3, Hermes fine-tunes, and Gyre's own template: shared/chat.py)
  llama3_json  {"name": N, "parameters": A}  the whole reply, after `<|python_tag|>` where the template writes it;
               several calls are joined by "; " (Llama 3.1–3.3's JSON tool calling; some templates say
               "arguments")
  mistral      [TOOL_CALLS][{"name": N, "arguments": A}, ...]  after any text (Mistral's v3 tokenizers)

A reply that tried a call and cannot be read (a cut-off block, JSON that is not an object with a string "name" and
an object of arguments) keeps the attempt, verbatim, in `malformed`, as `parse_tool_calls` does, and its text holds
a marker `has_tool_call_marker` sees, so the harness re-samples it.

`detect_format(render)` renders a probe call through a chat template and names the format the template writes, so
a checkpoint whose template writes calls no parser here reads is refused at start with its own rendering quoted,
not discovered mid-run as replies without calls. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shared.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedReply,
    ToolCall,
    call_from_object,
    format_tool_call,
    object_pattern,
    parse_tool_calls,
    tool_call_regex,
)

FormatName = Literal["hermes", "llama3_json", "mistral"]
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
PROBE_TOOL = "gyre_probe"
PROBE_ARGUMENTS = {"probe_argument": "probe-value"}


class ToolFormatError(ValueError):
    """A chat template writes tool calls in a way none of the formats here reads."""


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's way of writing tool calls: parse a reply, write one call, constrain decoding to one."""

    name: FormatName
    arguments_key: str = "arguments"  # llama3_json templates write "parameters" (Meta's) or "arguments"
    prefix: str = ""  # what a llama3_json template writes before the call (`<|python_tag|>` in some)

    def parse(self, text: str) -> ParsedReply:
        if self.name == "hermes":
            return parse_tool_calls(text)
        if self.name == "llama3_json":
            return _parse_llama(text)
        return _parse_mistral(text)

    def format(self, name: str, arguments: Mapping[str, Any], text: str = "") -> str:
        """The text a model of this family generates for one call after `text` (the inverse of `parse`)."""
        if self.name == "hermes":
            return format_tool_call(name, arguments, text)
        body = json.dumps({"name": name, self.arguments_key: dict(arguments)})
        if self.name == "llama3_json":
            return self.prefix + body  # the whole reply: a call carries no text beside it
        return f"{text}{MISTRAL_TAG}[{body}]"

    def regex(self, tools: Sequence[tuple[str, Mapping[str, Any]]], names: Sequence[str]) -> str:
        """A regex for exactly one call to one of `names` (guided decoding for tool_choice any/tool)."""
        if self.name == "hermes":
            return tool_call_regex(tools, names)
        body = object_pattern(tools, names, arguments_key=self.arguments_key)
        if self.name == "llama3_json":
            return re.escape(self.prefix) + body
        return re.escape(MISTRAL_TAG) + r"\[" + body + r"\]"


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes"),
    "llama3_json": ToolCallFormat("llama3_json", arguments_key="parameters"),
    "mistral": ToolCallFormat("mistral"),
}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ToolFormatError(f"unknown tool-call format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def has_tool_call_marker(text: str) -> bool:
    """Whether text holds a marker of any format's call (a reply that tried to call a tool, well-formed or not):
    the gateway leaves an attempt it could not read in the text, so the harness can tell it from an answer."""
    stripped = text.lstrip()
    return (TOOL_CALL_OPEN in text or TOOL_CALL_CLOSE in text or PYTHON_TAG in text or MISTRAL_TAG in text
            or stripped.startswith('{"name"'))


def _call(obj: Any) -> ToolCall | None:
    return call_from_object(obj, ("arguments", "parameters"))


def _parse_llama(text: str) -> ParsedReply:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        if tagged:
            return ParsedReply(content="", tool_calls=(), malformed=(text.strip(),))
        return ParsedReply(content=text.strip(), tool_calls=(), malformed=())
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            calls = []
            break
        call = _call(obj)
        if call is None:
            calls = []
            break
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    if not calls:  # an object that is not a call, or a call cut off: the attempt stays visible
        return ParsedReply(content="", tool_calls=(), malformed=(text.strip(),))
    return ParsedReply(content="", tool_calls=tuple(calls), malformed=())


def _parse_mistral(text: str) -> ParsedReply:
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return ParsedReply(content=text.strip(), tool_calls=(), malformed=())
    content, rest = text[:at].strip(), text[at + len(MISTRAL_TAG):].strip()
    try:
        items, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return ParsedReply(content=content, tool_calls=(), malformed=(text[at:].strip(),))
    calls = [_call(item) for item in items] if isinstance(items, list) else [None]
    if not calls or any(c is None for c in calls):
        return ParsedReply(content=content, tool_calls=(), malformed=(text[at:].strip(),))
    trailing = rest[end:].strip()
    content = "\n".join(p for p in (content, trailing) if p)
    return ParsedReply(content=content, tool_calls=tuple(c for c in calls if c is not None), malformed=())


def detect_format(render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str]) -> ToolCallFormat:
    """The format a chat template writes tool calls in. `render(messages, tools)` renders a conversation (no
    generation prompt): the probe conversation with and without an assistant turn that calls the probe tool, so
    that only that turn's text is classified (the tools' own JSON in the system turn is not)."""
    tools = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "probe", "parameters": {
        "type": "object", "properties": {"probe_argument": {"type": "string"}}}}}]
    user = {"role": "user", "content": "probe"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": PROBE_TOOL, "arguments": PROBE_ARGUMENTS}}]}
    before = render([user], tools)
    after = render([user, call], tools)
    shared = 0
    while shared < min(len(before), len(after)) and before[shared] == after[shared]:
        shared += 1
    turn = after[shared:]
    if PROBE_TOOL not in turn:
        raise ToolFormatError("the chat template does not write an assistant turn's tool calls (a probe call "
                              f"rendered as {turn[:160]!r})")
    if TOOL_CALL_OPEN in turn:
        return FORMATS["hermes"]
    if MISTRAL_TAG in turn:
        return FORMATS["mistral"]
    body = turn[turn.index("{"):] if "{" in turn else ""
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and obj.get("name") == PROBE_TOOL:
        key = next((k for k in ("parameters", "arguments") if obj.get(k) == PROBE_ARGUMENTS), None)
        if key is not None:
            return ToolCallFormat("llama3_json", arguments_key=key, prefix=PYTHON_TAG if PYTHON_TAG in turn else "")
    raise ToolFormatError(f"the chat template writes a tool call as {turn[:160]!r}, which none of Gyre's formats "
                          f"({', '.join(sorted(FORMATS))}) reads")


__all__ = [
    "FORMATS",
    "FormatName",
    "ToolCallFormat",
    "ToolFormatError",
    "detect_format",
    "get_format",
    "has_tool_call_marker",
]
