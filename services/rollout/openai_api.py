"""OpenAI Chat Completions adapter: request bodies → Conversation, results → completion JSON and SSE chunks."""

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
    nesting_problem,
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

_PLACEHOLDERS = ("image_url", "input_audio", "file")


def _text(content: Any, where: str) -> str:
    return content_text(content, where, placeholders=_PLACEHOLDERS, item="{where}[{i}]")


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return {"__raw__": raw}  # keep what the harness sent; it still renders and compares by value
        # Arguments nested past what the digests and the template walk stay the text they came as.
        return value if isinstance(value, dict) and nesting_problem(value) is None else {"__raw__": raw}
    return {}


def parse_messages(messages: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty array of messages", param="messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where}: expected an object", param=where)
        role = m.get("role")
        match role:
            case "system" | "developer":
                out.append(ChatMessage(role="system", content=_text(m.get("content"), f"{where}.content")))
            case "user":
                if "content" not in m:
                    raise invalid(f"{where}.content: missing required parameter", param=f"{where}.content")
                out.append(ChatMessage(role="user", content=_text(m.get("content"), f"{where}.content")))
            case "assistant":
                calls = []
                if not isinstance(m.get("tool_calls") or [], list):
                    raise invalid(f"{where}.tool_calls: expected an array", param=f"{where}.tool_calls")
                for j, tc in enumerate(m.get("tool_calls") or []):
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise invalid(f"{where}.tool_calls[{j}].function.name: missing required parameter")
                    calls.append(ToolCall(name=fn["name"], arguments=_arguments(fn.get("arguments"))))
                out.append(
                    ChatMessage(role="assistant", content=_text(m.get("content"), f"{where}.content"),
                                tool_calls=tuple(calls))
                )
            case "tool" | "function":
                out.append(ChatMessage(role="tool", content=_text(m.get("content"), f"{where}.content")))
            case _:
                raise invalid(
                    f"{where}.role: expected one of 'system', 'developer', 'user', 'assistant', 'tool', got {role!r}",
                    param=f"{where}.role",
                )
    return tuple(out)


def parse_tools(tools: Any) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid("tools: expected an array", param="tools")
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        specs.append(tool_spec(fn.get("name"), fn.get("description"),
                               fn.get("parameters", {"type": "object", "properties": {}}),
                               where=f"tools[{i}].function", schema_field="parameters", type_optional=True))
    return tuple(specs)


def parse_request(body: Any) -> ParsedRequest:
    body = request_object(body)
    model = checked_model(body)
    conversation = Conversation(messages=parse_messages(body.get("messages")), tools=parse_tools(body.get("tools")))
    if body.get("tool_choice") == "none":
        conversation = Conversation(messages=conversation.messages)
    max_tokens = checked_max_tokens(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise invalid(f"n: only n=1 is supported, got {n!r}", param="n")
    sampling = SamplingRequest(
        max_tokens=max_tokens,
        temperature=checked_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=checked_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=checked_seed(body.get("seed")),
        stop=checked_stop(body.get("stop"), "stop", single_string=True),
        forced_tools=_forced_tools(body.get("tool_choice"), conversation),
    )
    return ParsedRequest(model=model, conversation=conversation, sampling=sampling, stream=bool(body.get("stream")))


def _forced_tools(choice: Any, conversation: Conversation) -> tuple[str, ...]:
    names = tuple(t.name for t in conversation.tools)
    if choice == "required":
        return all_tools(names, "tool_choice", "required")
    if isinstance(choice, dict):
        fn = choice.get("function")
        return one_tool(fn.get("name") if isinstance(fn, dict) else None, names, "tool_choice.function.name")
    if choice not in (None, "auto", "none"):
        raise invalid(f"tool_choice: expected 'none', 'auto', 'required' or a function, got {choice!r}",
                      param="tool_choice")
    return ()


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def wants_logprobs(body: dict[str, Any]) -> bool:
    return bool(body.get("logprobs"))


# ---- responses ----


def finish_reason(c: Completion) -> str:
    if c.finish_reason == "length":
        return "length"
    if c.reply.tool_calls and c.stop_sequence is None:
        return "tool_calls"
    return "stop"


def usage(c: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


def _tool_calls(c: Completion) -> list[dict[str, Any]]:
    return [
        {"id": tool_id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        for tool_id, call in zip(c.tool_ids, c.reply.tool_calls, strict=True)
    ]


def _logprobs(c: Completion) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(c.token_texts, c.logprobs, strict=False)
        ]
    }


def completion(c: Completion, *, created: int, logprobs: bool = False) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.reply.content if (c.reply.content or not
                                                                                  c.reply.tool_calls) else None}
    if c.reply.tool_calls:
        msg["tool_calls"] = _tool_calls(c)
    return {
        "id": f"chatcmpl-{c.call_id}",
        "object": "chat.completion",
        "created": created,
        "model": c.model,
        "choices": [
            {"index": 0, "message": msg, "finish_reason": finish_reason(c),
             "logprobs": _logprobs(c) if logprobs else None}
        ],
        "usage": usage(c),
        "system_fingerprint": f"gyre-policy-{c.policy_version}",
    }


def sse_chunks(c: Completion, *, created: int, include_usage: bool) -> Iterator[bytes]:
    base = {"id": f"chatcmpl-{c.call_id}", "object": "chat.completion.chunk", "created": created, "model": c.model,
            "system_fingerprint": f"gyre-policy-{c.policy_version}"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if include_usage:
            body["usage"] = None
        return _data(body)

    yield chunk({"role": "assistant", "content": ""})
    if c.reply.content:
        for piece in chunks(c.reply.content):
            yield chunk({"content": piece})
    for index, call in enumerate(_tool_calls(c)):
        yield chunk({"tool_calls": [{"index": index} | call]})
    yield chunk({}, finish_reason(c))
    if include_usage:
        yield _data(base | {"choices": [], "usage": usage(c)})
    yield b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


class OpenAIAdapter:
    """Chat Completions (`/v1/chat/completions`) as an `ApiAdapter`."""

    api: HttpApi = "openai"

    def parse(self, body: Any) -> ParsedRequest:
        return parse_request(body)

    def response(self, result: Completion, body: Any, *, created: int) -> dict[str, Any]:
        return completion(result, created=created, logprobs=wants_logprobs(body))

    def response_headers(self, result: Completion) -> dict[str, str]:
        return {}

    def stream(self, result: Completion, body: Any, *, created: int) -> Iterator[bytes]:
        return sse_chunks(result, created=created, include_usage=wants_usage_chunk(body))

    def error_body(self, exc: ApiError) -> dict[str, Any]:
        return exc.openai_body()


OPENAI = OpenAIAdapter()
