"""OpenAI Chat Completions adapter: request bodies → Conversation, results → completion JSON and SSE chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from services.rollout.anthropic_api import TOOL_NAME, Completion, ParsedRequest, SamplingRequest
from services.rollout.conversation import ChatMessage, Conversation, ToolSpec, schema_problem
from shared.chat import ToolCall
from services.rollout.errors import invalid


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or a list of content parts", param=where)
    parts: list[str] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{where}[{i}]: expected a content part with a string 'type'", param=where)
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{i}].text: expected a string", param=where)
            parts.append(part["text"])
        elif part["type"] in ("image_url", "input_audio", "file"):
            parts.append(f"[{part['type']}]")
    return "".join(parts)


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"__raw__": raw}  # keep what the harness sent; it still renders and compares by value
        return value if isinstance(value, dict) else {"__raw__": raw}
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
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise invalid(f"tools[{i}].function.name: expected a string matching {TOOL_NAME.pattern}, got {name!r}",
                          param=f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise invalid(f"tools[{i}].function.parameters: expected a JSON Schema object with type 'object'",
                          param=f"tools[{i}].function.parameters")
        if problem := schema_problem(params):
            raise invalid(f"tools[{i}].function.parameters.{problem}", param=f"tools[{i}].function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"tools[{i}].function.description: expected a string", param=f"tools[{i}].function.description")
        specs.append(ToolSpec(name=name, description=description, parameters=params))
    return tuple(specs)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(f"{name}: expected a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def parse_request(body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise invalid("request body: expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: missing required parameter", param="model")
    conversation = Conversation(messages=parse_messages(body.get("messages")), tools=parse_tools(body.get("tools")))
    if body.get("tool_choice") == "none":
        conversation = Conversation(messages=conversation.messages)
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
        raise invalid(f"max_tokens: expected an integer ≥ 1, got {raw!r}", param="max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise invalid(f"n: only n=1 is supported, got {n!r}", param="n")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop: expected a string or an array of strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid(f"seed: expected an integer, got {seed!r}", param="seed")
    sampling = SamplingRequest(
        max_tokens=raw,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=seed,
        stop=tuple(stop),
        forced_tools=_forced_tools(body.get("tool_choice"), conversation),
    )
    return ParsedRequest(model=model, conversation=conversation, sampling=sampling, stream=bool(body.get("stream")))


def _forced_tools(choice: Any, conversation: Conversation) -> tuple[str, ...]:
    names = tuple(t.name for t in conversation.tools)
    if choice == "required":
        if not names:
            raise invalid("tool_choice: 'required' needs at least one tool", param="tool_choice")
        return names
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise invalid(f"tool_choice.function.name: expected one of {list(names)}, got {name!r}",
                          param="tool_choice")
        return (name,)
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
        for i in range(0, len(c.reply.content), 64):
            yield chunk({"content": c.reply.content[i : i + 64]})
    for index, call in enumerate(_tool_calls(c)):
        yield chunk({"tool_calls": [{"index": index} | call]})
    yield chunk({}, finish_reason(c))
    if include_usage:
        yield _data(base | {"choices": [], "usage": usage(c)})
    yield b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
