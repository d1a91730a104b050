"""Anthropic Messages API adapter: request bodies → Conversation, results → message JSON and SSE events.

Accepts what Claude Code sends (cache_control anywhere, thinking, metadata, role "system" entries inside
`messages`, server tools); fields that do not change generation are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from services.rollout.api_common import (
    all_tools,
    checked_max_tokens,
    checked_model,
    checked_number,
    checked_seed,
    checked_stop,
    chunks,
    content_text,
    one_tool,
    request_object,
    tool_spec,
)
from services.rollout.api_types import (
    Completion,
    HttpApi,
    ParsedRequest,
    SamplingRequest,
)
from services.rollout.conversation import ChatMessage, Conversation, ToolSpec
from services.rollout.errors import ApiError, invalid
from shared.chat import ToolCall

_PLACEHOLDERS = ("image", "document")


def _text_of(content: Any, where: str) -> str:
    """Text of a string or a list of content blocks; images/documents become placeholders."""
    return content_text(content, where, placeholders=_PLACEHOLDERS, bare_strings=True)


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
        if tool.get("type") not in (None, "custom"):
            continue  # server tools (web search, code execution...) are not rendered for a local model
        specs.append(tool_spec(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                               where=f"tools.{i}", schema_field="input_schema"))
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


def parse_request(body: Any, *, count_only: bool = False) -> ParsedRequest:
    body = request_object(body)
    model = checked_model(body)
    conversation = Conversation(
        messages=parse_messages(body.get("messages"), body.get("system")),
        tools=parse_tools(body.get("tools")),
    )
    max_tokens: int | None = None
    if not count_only:
        if body.get("max_tokens") is None:
            raise invalid("max_tokens: Field required", param="max_tokens")
        max_tokens = checked_max_tokens(body["max_tokens"], "max_tokens")
    top_k = body.get("top_k") or 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise invalid(f"top_k: expected a non-negative integer, got {top_k!r}", param="top_k")
    sampling = SamplingRequest(
        max_tokens=max_tokens,
        temperature=checked_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=checked_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k,
        # Not in the Messages API: a Gyre extension (the built-in agent sends one per call) that makes the
        # engine's sampling reproducible, as OpenAI's `seed` does on the other endpoint.
        seed=checked_seed(body.get("seed")),
        stop=checked_stop(body.get("stop_sequences"), "stop_sequences"),
        forced_tools=_forced_tools(body.get("tool_choice"), conversation),
    )
    return ParsedRequest(model=model, conversation=conversation, sampling=sampling, stream=bool(body.get("stream")))


def _forced_tools(choice: Any, conversation: Conversation) -> tuple[str, ...]:
    names = tuple(t.name for t in conversation.tools)
    if choice is None or not isinstance(choice, dict):
        return ()
    match choice.get("type"):
        case "any":
            return all_tools(names, "tool_choice", "any")
        case "tool":
            return one_tool(choice.get("name"), names, "tool_choice.name")
        case "auto" | "none" | None:
            return ()
        case other:
            raise invalid(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {other!r}",
                          param="tool_choice")


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
            for piece in chunks(block["text"]):
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


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class AnthropicAdapter:
    """The Messages API (`/v1/messages`) as an `ApiAdapter`."""

    api: HttpApi = "anthropic"

    def parse(self, body: Any) -> ParsedRequest:
        return parse_request(body)

    def response(self, result: Completion, body: Any, *, created: int) -> dict[str, Any]:
        return message(result)

    def response_headers(self, result: Completion) -> dict[str, str]:
        return {"request-id": f"req_{result.call_id}"}

    def stream(self, result: Completion, body: Any, *, created: int) -> Iterator[bytes]:
        return sse_events(result)

    def error_body(self, exc: ApiError) -> dict[str, Any]:
        return exc.anthropic_body()


ANTHROPIC = AnthropicAdapter()
