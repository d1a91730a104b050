"""Tests for shared.chat: the tool-call parser, its writer, the guided-decoding regex, and the round trip through
the chat template a tiny model's tokenizer carries."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.tinymodel import create_tiny_model
from shared.chat import ToolCall, format_tool_call, parse_tool_calls, tool_call_regex
from shared.tool_formats import has_tool_call_marker


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=7)))


# ---------------------------------------------------------------------------------------------------
# Tool-call parsing


def test_parse_tool_calls_separates_content_calls_and_malformed_blocks() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        "\n<tool_call>\nnot json\n</tool_call>"
        '\n<tool_call>\n{"name": "Read", "arguments": "{\\"path\\": \\"a\\"}"}\n</tool_call>'
        '\n<tool_call>\n{"name": "bash", "arguments": {"comm'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me look."
    assert parsed.tool_calls == (
        ToolCall(name="bash", arguments={"command": "ls"}),
        ToolCall(name="Read", arguments={"path": "a"}),
    )
    assert parsed.malformed == (
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "bash", "arguments": {"comm',
    )


@pytest.mark.parametrize(
    "body",
    ['["bash"]', '{"arguments": {}}', '{"name": 3, "arguments": {}}', '{"name": "x", "arguments": [1]}'],
)
def test_parse_tool_calls_rejects_blocks_without_a_name_and_argument_object(body: str) -> None:
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed.tool_calls == () and parsed.malformed == (f"<tool_call>{body}</tool_call>",)


def test_parse_tool_calls_of_plain_text_is_just_content() -> None:
    assert parse_tool_calls("  just words \n").model_dump() == {"content": "just words", "tool_calls": (), "malformed": ()}


_json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12)
_arguments = st.dictionaries(
    st.text(min_size=1, max_size=8), st.recursive(_json_scalars, lambda c: st.lists(c, max_size=3), max_leaves=5),
    max_size=4,
)
_calls = st.lists(
    st.builds(ToolCall, name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True), arguments=_arguments),
    min_size=1,
    max_size=3,
)


@settings(max_examples=60, deadline=None)
@given(content=st.text(max_size=30).filter(lambda s: "<tool_call>" not in s), calls=_calls)
def test_rendered_tool_calls_parse_back_to_the_same_calls(tokenizer: Any, content: str, calls: list[ToolCall]) -> None:
    # The gateway renders history with the template and parses generations with parse_tool_calls;
    # an assistant turn rendered by one must read back identically through the other.
    message = {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]}
    rendered = tokenizer.apply_chat_template([message], tokenize=False)
    body = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(body)
    assert parsed.tool_calls == tuple(calls)
    assert parsed.content == content.strip() and parsed.malformed == ()


@settings(max_examples=60, deadline=None)
@given(content=st.text(max_size=30).filter(lambda s: "<tool_call>" not in s), calls=_calls)
def test_a_written_tool_call_parses_back_to_the_same_call(content: str, calls: list[ToolCall]) -> None:
    call = calls[0]
    parsed = parse_tool_calls(format_tool_call(call.name, call.arguments, content))
    assert parsed.tool_calls == (call,) and parsed.content == content.strip() and parsed.malformed == ()


def test_the_markers_are_recognised_even_in_a_malformed_reply() -> None:
    assert has_tool_call_marker("oops </tool_call>") and has_tool_call_marker("<tool_call>{")
    assert not has_tool_call_marker("just text")


def test_the_guided_regex_matches_a_well_formed_call_to_a_named_tool_only() -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["command"]}
    pattern = re.compile(tool_call_regex([("bash", schema), ("submit", {"type": "object"})], ["bash"]))
    assert pattern.fullmatch(format_tool_call("bash", {"command": "ls -la"}))
    assert not pattern.fullmatch(format_tool_call("submit", {}))
    with pytest.raises(ValueError, match="no tool named"):
        tool_call_regex([("bash", schema)], ["missing"])
