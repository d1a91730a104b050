"""Request normalisation for both APIs (pure): what Claude Code and OpenAI clients send becomes one conversation."""

from __future__ import annotations

import pytest

from services.rollout import anthropic_api, openai_api
from services.rollout.codec import reply_message
from services.rollout.conversation import ChatMessage
from services.rollout.errors import ApiError
from shared.chat import ToolCall, tool_call_regex

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def test_anthropic_blocks_become_template_messages() -> None:
    parsed = anthropic_api.parse_request({
        "model": "m", "max_tokens": 5,
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                              {"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a.txt"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                {"type": "text", "text": "<system-reminder>note</system-reminder>"}]},
            {"role": "system", "content": "background task done"},
        ],
        "tools": [{"name": "bash", "description": "run", "input_schema": SCHEMA}],
    })
    assert parsed.conversation.messages == (
        ChatMessage(role="system", content="A\nB"),
        ChatMessage(role="user", content="hi[image]"),
        ChatMessage(role="assistant", content="ok", tool_calls=(ToolCall(name="bash", arguments={"command": "ls"}),)),
        ChatMessage(role="tool", content="a.txt"),
        ChatMessage(role="tool", content="Error: boom"),
        ChatMessage(role="user", content="<system-reminder>note</system-reminder>"),
        ChatMessage(role="system", content="background task done"),
    )
    assert parsed.sampling.max_tokens == 5 and not parsed.stream


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}, "content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "bad name!", "input_schema": SCHEMA}]}, "name"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "t", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "u"}}, "tool_choice"),
])
def test_anthropic_invalid_requests_name_the_field(body, message) -> None:
    with pytest.raises(ApiError) as err:
        anthropic_api.parse_request(body)
    assert err.value.status == 400 and message in err.value.message


def test_openai_messages_and_tools_normalise_like_anthropic() -> None:
    parsed = openai_api.parse_request({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "go"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}],
        "tool_choice": "required",
    })
    assert parsed.conversation.messages[2] == ChatMessage(
        role="assistant", tool_calls=(ToolCall(name="bash", arguments={"command": "ls"}),))
    assert parsed.sampling.max_tokens is None and parsed.sampling.forced_tools == ("bash",)
    dropped = openai_api.parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                        "tools": [{"type": "function", "function": {"name": "bash"}}],
                                        "tool_choice": "none"})
    assert dropped.conversation.tools == ()


def test_malformed_tool_calls_stay_visible_in_the_reply_text() -> None:
    reply = reply_message('I will look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
                          '\n<tool_call>\nnot json\n</tool_call>')
    assert reply.tool_calls == (ToolCall(name="bash", arguments={"command": "ls"}),)
    assert reply.content.startswith("I will look.") and "not json" in reply.content


def test_forced_tool_regex_accepts_the_template_format() -> None:
    import re

    regex = tool_call_regex([("bash", SCHEMA), ("read", {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}})], ("read",))
    assert re.fullmatch(regex, '<tool_call>\n{"name": "read", "arguments": {"path": "a.py", "limit": 10}}\n</tool_call>')
    assert not re.fullmatch(regex, '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')


@pytest.mark.parametrize("seed", [-1, 2**63, "7", True, 1.5])
def test_both_apis_check_a_seed_the_same_way(seed) -> None:
    """One range for both endpoints: a seed the engine's sampler cannot take is the request's error (400), never
    a worker failure."""
    user = [{"role": "user", "content": "x"}]
    for parse, body in ((anthropic_api.parse_request, {"model": "m", "max_tokens": 5, "messages": user}),
                        (openai_api.parse_request, {"model": "m", "messages": user})):
        with pytest.raises(ApiError, match=r"seed: expected an integer in \[0, 2\^63\)") as err:
            parse({**body, "seed": seed})
        assert err.value.status == 400
        assert parse({**body, "seed": 2**63 - 1}).sampling.seed == 2**63 - 1


def test_both_apis_check_tools_and_stop_strings_with_the_same_rules() -> None:
    user = [{"role": "user", "content": "x"}]
    anthropic_body = {"model": "m", "max_tokens": 5, "messages": user}
    openai_body = {"model": "m", "messages": user}
    bad_name = "bad name!"
    with pytest.raises(ApiError, match=r"tools\.0\.name: expected a string matching"):
        anthropic_api.parse_request({**anthropic_body, "tools": [{"name": bad_name, "input_schema": SCHEMA}]})
    with pytest.raises(ApiError, match=r"tools\[0\]\.function\.name: expected a string matching"):
        openai_api.parse_request({**openai_body, "tools": [{"type": "function", "function": {
            "name": bad_name, "parameters": SCHEMA}}]})
    # OpenAI lets a schema leave out "type"; the Messages API does not.
    untyped = {"properties": {"a": {"type": "string"}}}
    assert openai_api.parse_request({**openai_body, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": untyped}}]}).conversation.tools[0].parameters == untyped
    with pytest.raises(ApiError, match="input_schema"):
        anthropic_api.parse_request({**anthropic_body, "tools": [{"name": "f", "input_schema": untyped}]})
    assert openai_api.parse_request({**openai_body, "stop": "END"}).sampling.stop == ("END",)
    assert anthropic_api.parse_request({**anthropic_body, "stop_sequences": ["END"]}).sampling.stop == ("END",)
    for parse, body, field in ((anthropic_api.parse_request, anthropic_body, "stop_sequences"),
                               (openai_api.parse_request, openai_body, "stop")):
        with pytest.raises(ApiError, match=f"{field}: expected"):
            parse({**body, field: ["ok", ""]})
