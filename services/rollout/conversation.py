"""The API-neutral conversation the gateway renders: messages, tool calls and tool specs as frozen models.

Both the Anthropic and the OpenAI adapters normalise into these; token-in/token-out compares them by value.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Self

from pydantic import BaseModel, ConfigDict

from shared.chat import MessageRole, ToolCall, template_tool, template_tool_call


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy without the cached digests and keys (an update would make them stale)."""
        copy = super().model_copy(update=update, deep=deep)
        for klass in type(self).__mro__:
            for name, attr in vars(klass).items():
                if isinstance(attr, cached_property):
                    copy.__dict__.pop(name, None)
        return copy


class ChatMessage(_Frozen):
    role: MessageRole
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def template_dict(self) -> dict[str, Any]:
        """The shape the chat template reads (OpenAI-style tool calls)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        return out

    @cached_property
    def digest(self) -> bytes:
        """Identifies the message for comparing an echoed message with the one we produced (`digest_for` with
        no tool schemas)."""
        return self.digest_for(NO_DEFAULTS)

    def digest_for(self, defaults: ToolDefaults) -> bytes:
        """Identifies the message for comparing an echoed message with the one we produced, as a harness echoes
        it: surrounding whitespace of the text ignored, and each tool call's arguments as JSON values, in any key
        order, without the arguments its tool's schema gives as defaults (`defaults`), and with trailing spaces of
        each line of a string argument ignored. Claude Code re-sends its own Edit calls with `replace_all: false`
        added and strips trailing spaces from Write's content; the model's own tokens still stand for them.
        Computed once per conversation (Conversation.prefix_keys), each request's messages being new objects.
        """
        h = hashlib.sha256()
        for part in (self.role.encode(), self.content.strip().encode("utf-8", "surrogatepass")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        if self.tool_calls:
            calls = [[c.name, _echo_form(c.arguments, defaults.get(c.name, {}))] for c in self.tool_calls]
            h.update(json.dumps(calls, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
                "utf-8", "surrogatepass"))
        return h.digest()


ToolDefaults = Mapping[str, Mapping[str, Any]]  # tool name -> argument -> the default its schema gives
NO_DEFAULTS: ToolDefaults = {}
_MISSING = object()


def _echo_form(arguments: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as an echo of them is compared: defaults dropped, trailing spaces of each line
    of a string ignored."""
    return {k: _strip_lines(v) for k, v in arguments.items() if not _same_json(defaults.get(k, _MISSING), v)}


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values (false is not 0, 1.0 is 1)."""
    return a is not _MISSING and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _strip_lines(value: Any) -> Any:
    if isinstance(value, str):
        return "\n".join(line.rstrip(" \t") for line in value.split("\n"))
    if isinstance(value, dict):
        return {k: _strip_lines(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_lines(v) for v in value]
    return value


class ToolSpec(_Frozen):
    name: str
    description: str = ""
    parameters: dict[str, Any]

    def template_dict(self) -> dict[str, Any]:
        return template_tool(self.name, self.description, self.parameters)


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What is wrong with a tool's parameter schema beyond `type: object`, if anything: its `properties` must
    map names to schemas and its `required` list names (guided decoding reads both)."""
    props = schema.get("properties") or {}
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        return "properties: expected an object mapping each property name to a JSON Schema"
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return "required: expected an array of property names"
    return None


class Conversation(_Frozen):
    """What one request asks the model to continue: its messages (system first, if any) and its tools."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()

    def tools_key(self) -> str:
        body = [t.template_dict() for t in self.tools]
        return _digest(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False))

    @cached_property
    def tool_defaults(self) -> ToolDefaults:
        """The defaults each tool's parameter schema gives its top-level arguments."""
        out: dict[str, dict[str, Any]] = {}
        for tool in self.tools:
            props = tool.parameters.get("properties") or {}
            given = {name: p["default"] for name, p in props.items() if isinstance(p, dict) and "default" in p}
            if given:
                out[tool.name] = given
        return out

    def chain_key(self) -> str:
        """Identifies an agent chain: the same tools and the same leading system prompt.

        A sub-agent (its own system prompt and tool set) gets a different key; a compaction of the same
        agent keeps its key and becomes a fork within the chain.
        """
        system = self.messages[0].content if self.messages and self.messages[0].role == "system" else ""
        return _digest(self.tools_key() + "\x00" + system)

    def prefix_keys(self) -> tuple[str, ...]:
        """prefix_keys()[i] identifies (tools, messages[:i]); index 0 is the tools alone."""
        return self._prefix_keys

    @cached_property
    def _prefix_keys(self) -> tuple[str, ...]:
        keys = [self.tools_key()]
        for message in self.messages:
            keys.append(next_prefix_key(keys[-1], message, self.tool_defaults))
        return tuple(keys)


def next_prefix_key(key: str, message: ChatMessage, defaults: ToolDefaults = NO_DEFAULTS) -> str:
    """The prefix key of a conversation whose prefix key is `key` (it holds the tools, whose schemas give
    `defaults`), extended by `message`."""
    return hashlib.sha256(key.encode() + b"\x1e" + message.digest_for(defaults)).hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
