"""Anthropic Messages API adapter: request bodies → Conversation, results → message JSON and SSE events.

Accepts what Claude Code sends (cache_control anywhere, thinking, metadata, role "system" entries inside
`messages`, server tools); fields that do not change generation are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from services.rollout.conversation import ChatMessage, Conversation, ToolSpec, schema_problem
from shared.chat import ToolCall
from services.rollout.errors import invalid

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


@dataclass(frozen=True)
class SamplingRequest:
    """API-neutral sampling options; max_tokens None means "what the context leaves"."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    forced_tools: tuple[str, ...] = ()  # tool_choice any/tool: the reply must call one of these


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    conversation: Conversation
    sampling: SamplingRequest
    stream: bool


@dataclass(frozen=True)
class Completion:
    """What the gateway produced for one call, before it is shaped into an API response."""

    call_id: str
    model: str
    reply: ChatMessage
    tool_ids: tuple[str, ...]
    finish_reason: str  # "stop" | "length"
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    policy_version: int
    logprobs: tuple[float, ...] = ()
    token_texts: tuple[str, ...] = ()
    call_index: int | None = None  # the index the call was recorded under in its execution's log


def _text_of(content: Any, where: str) -> str:
    """Text of a string or a list of content blocks; images/documents become placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or a list of content blocks, got {type(content).__name__}")
    parts: list[str] = []
    for i, block in enumerate(content):
        if isinstance(block, str):
            parts.append(block)
            continue
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}.{i}: expected a content block object with a string 'type'")
        kind = block["type"]
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}.{i}.text: Field required (a string)")
            parts.append(block["text"])
        elif kind in ("image", "document"):
            parts.append(f"[{kind}]")
    return "".join(parts)


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(_text_of([b], "system") for b in system if _text_of([b], "system"))
    raise invalid(f"system: expected a string or a list of text blocks, got {type(system).__name__}")


def parse_tools(tools: Any) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid(f"tools: expected a list, got {type(tools).__name__}", param="tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools.{i}: expected a tool object", param="tools")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            continue  # server tools (web search, code execution...) are not rendered for a local model
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise invalid(f"tools.{i}.name: expected a string matching {TOOL_NAME.pattern}, got {name!r}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise invalid(
                f"tools.{i}.input_schema: expected a JSON Schema object with \"type\": \"object\", got "
                f"{json.dumps(schema)[:200] if schema is not None else 'nothing'}"
            )
        if problem := schema_problem(schema):
            raise invalid(f"tools.{i}.input_schema.{problem}")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"tools.{i}.description: expected a string")
        specs.append(ToolSpec(name=name, description=description, parameters=schema))
    return tuple(specs)


def parse_messages(messages: Any, system: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(messages, list):
        raise invalid("messages: Field required (a list of messages)")
    if not messages:
        raise invalid("messages: at least one message is required")
    out: list[ChatMessage] = []
    system_text = _system_text(system)
    if system_text:
        out.append(ChatMessage(role="system", content=system_text))
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise invalid(f"{where}: expected a message object")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role: expected 'user' or 'assistant', got {role!r}")
        if "content" not in message:
            raise invalid(f"{where}.content: Field required")
        content = message["content"]
        if role == "system":
            out.append(ChatMessage(role="system", content=_text_of(content, f"{where}.content")))
        elif role == "assistant":
            out.append(_assistant(content, where))
        else:
            out.extend(_user(content, where))
    return tuple(out)


def _assistant(content: Any, where: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    if not isinstance(content, list):
        raise invalid(f"{where}.content: expected a string or a list of content blocks")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}.content.{j}: expected a content block object with a string 'type'")
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of([block], f"{where}.content"))
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise invalid(f"{where}.content.{j}: tool_use needs a string 'name' and an object 'input'")
            calls.append(ToolCall(name=name, arguments=args))
        # thinking / redacted_thinking / server tool blocks carry nothing the local model produced.
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=tuple(calls))


def _user(content: Any, where: str) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: expected a string or a list of content blocks")
    out: list[ChatMessage] = []
    pending: list[str] = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}.content.{j}: expected a content block object with a string 'type'")
        if block["type"] == "tool_result":
            if pending:
                out.append(ChatMessage(role="user", content="".join(pending)))
                pending = []
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{where}.content.{j}.tool_use_id: Field required")
            text = _text_of(block.get("content"), f"{where}.content.{j}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append(ChatMessage(role="tool", content=text))
        else:
            pending.append(_text_of([block], f"{where}.content"))
    if pending or not out:
        out.append(ChatMessage(role="user", content="".join(pending)))
    return out


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(f"{name}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)


def parse_request(body: Any, *, count_only: bool = False) -> ParsedRequest:
    if not isinstance(body, dict):
        raise invalid("request body: expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: Field required")
    conversation = Conversation(
        messages=parse_messages(body.get("messages"), body.get("system")),
        tools=parse_tools(body.get("tools")),
    )
    max_tokens: int | None = None
    if not count_only:
        raw = body.get("max_tokens")
        if raw is None:
            raise invalid("max_tokens: Field required")
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise invalid(f"max_tokens: expected an integer ≥ 1, got {raw!r}")
        max_tokens = raw
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop_sequences: expected a list of non-empty strings")
    top_k = body.get("top_k") or 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise invalid(f"top_k: expected a non-negative integer, got {top_k!r}")
    # Not in the Messages API: a Gyre extension (the built-in agent sends one per call) that makes the
    # engine's sampling reproducible, as OpenAI's `seed` does on the other endpoint.
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise invalid(f"seed: expected an integer in [0, 2^63), got {seed!r}")
    sampling = SamplingRequest(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        forced_tools=_forced_tools(body.get("tool_choice"), conversation),
    )
    return ParsedRequest(model=model, conversation=conversation, sampling=sampling, stream=bool(body.get("stream")))


def _forced_tools(choice: Any, conversation: Conversation) -> tuple[str, ...]:
    names = tuple(t.name for t in conversation.tools)
    if choice is None or not isinstance(choice, dict):
        return ()
    match choice.get("type"):
        case "any":
            if not names:
                raise invalid("tool_choice: 'any' needs at least one tool")
            return names
        case "tool":
            if choice.get("name") not in names:
                raise invalid(f"tool_choice.name: expected one of {list(names)}, got {choice.get('name')!r}")
            return (choice["name"],)
        case "auto" | "none" | None:
            return ()
        case other:
            raise invalid(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {other!r}")


# ---- responses ----


def stop_reason(c: Completion) -> str:
    if c.finish_reason == "length":
        return "max_tokens"
    if c.stop_sequence is not None:
        return "stop_sequence"
    if c.reply.tool_calls:
        return "tool_use"
    return "end_turn"


def usage(c: Completion) -> dict[str, int]:
    # Anthropic counts cache reads apart from input_tokens; their sum is the prompt length.
    return {
        "input_tokens": c.prompt_tokens - c.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": c.cached_tokens,
        "output_tokens": c.completion_tokens,
    }


def content_blocks(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reply.content or not c.reply.tool_calls:
        blocks.append({"type": "text", "text": c.reply.content})
    for tool_id, call in zip(c.tool_ids, c.reply.tool_calls, strict=True):
        blocks.append({"type": "tool_use", "id": tool_id, "name": call.name, "input": call.arguments})
    return blocks


def message(c: Completion) -> dict[str, Any]:
    return {
        "id": f"msg_{c.call_id}",
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": content_blocks(c),
        "stop_reason": stop_reason(c),
        "stop_sequence": c.stop_sequence,
        "usage": usage(c),
    }


def sse_events(c: Completion) -> Iterator[bytes]:
    """The standard event sequence: message_start, ping, per block start/delta/stop, message_delta, message_stop."""
    start = message(c) | {"content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = usage(c) | {"output_tokens": 0}
    yield _sse("message_start", {"type": "message_start", "message": start})
    yield _sse("ping", {"type": "ping"})
    for index, block in enumerate(content_blocks(c)):
        if block["type"] == "text":
            yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": "text", "text": ""}})
            for piece in _chunks(block["text"]):
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": piece}})
        else:
            yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": block | {"input": {}}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": json.dumps(block["input"])}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
    yield _sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason(c), "stop_sequence": c.stop_sequence},
                                 "usage": usage(c)})
    yield _sse("message_stop", {"type": "message_stop"})


def _chunks(text: str, size: int = 64) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
