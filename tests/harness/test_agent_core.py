"""Pure core of the agent loop: reply validation, context accounting, compaction decision, restarts."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from services.harness.agent_core import (
    SUMMARY_PROMPT,
    MalformedReply,
    ValidReply,
    context_tokens,
    format_shell_result,
    restart_messages,
    should_compact,
    validate_reply,
)

TOOLS = ("shell", "delegate", "submit")


def test_tool_use_with_valid_input_is_accepted() -> None:
    content = [{"type": "text", "text": "let me look"}, {"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "ls"}}]
    verdict = validate_reply(content, "tool_use", TOOLS)
    assert isinstance(verdict, ValidReply)
    assert verdict.text == "let me look" and [c.name for c in verdict.tool_calls] == ["shell"]


def test_delegate_is_malformed_where_it_is_not_offered() -> None:
    content = [{"type": "tool_use", "id": "t1", "name": "delegate", "input": {"task": "x"}}]
    assert isinstance(validate_reply(content, "tool_use", ("shell", "submit")), MalformedReply)


def test_submit_needs_no_answer() -> None:
    content = [{"type": "tool_use", "id": "t1", "name": "submit", "input": {}}]
    assert isinstance(validate_reply(content, "tool_use", TOOLS), ValidReply)


def test_bool_is_not_a_number_for_timeouts() -> None:
    content = [{"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "ls", "timeout_sec": True}}]
    assert isinstance(validate_reply(content, "tool_use", TOOLS), MalformedReply)


blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(min_size=1, max_size=5),
            "name": st.sampled_from(["shell", "submit", "delegate", "bash", ""]),
            "input": st.one_of(
                st.dictionaries(st.sampled_from(["command", "task", "answer", "cmd"]), st.one_of(st.text(max_size=10), st.integers()), max_size=3),
                st.text(max_size=5),
            ),
        }
    ),
)


@given(st.lists(blocks, max_size=5), st.sampled_from(["end_turn", "tool_use", "max_tokens", None]))
def test_validation_is_total_and_valid_replies_are_actionable(content: list[dict[str, Any]], stop: str | None) -> None:
    verdict = validate_reply(content, stop, TOOLS)
    assert isinstance(verdict, ValidReply | MalformedReply)
    if isinstance(verdict, ValidReply):
        assert verdict.tool_calls or verdict.text.strip()
        for call in verdict.tool_calls:
            assert call.name in TOOLS
            if call.name == "shell":
                assert isinstance(call.input["command"], str) and call.input["command"].strip()
            if call.name == "delegate":
                assert isinstance(call.input["task"], str)
        if stop == "max_tokens":
            assert verdict.tool_calls
    # Deterministic: the same reply always gets the same verdict.
    assert validate_reply(content, stop, TOOLS) == verdict


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**5))
def test_context_counts_cached_prompt_and_output(inp: int, cached: int, out: int, pending: int) -> None:
    usage = {"input_tokens": inp, "cache_read_input_tokens": cached, "output_tokens": out}
    assert context_tokens(usage, pending) == inp + cached + out + pending // 4


@given(st.integers(0, 10**6), st.one_of(st.none(), st.integers(1, 10**6)), st.integers(1, 50))
def test_compaction_only_past_the_budget_and_never_on_a_fresh_context(tokens: int, budget: int | None, messages: int) -> None:
    decision = should_compact(tokens, budget, messages)
    assert decision == (budget is not None and tokens > budget and messages > 1)


def test_restart_keeps_task_and_summary_in_one_user_turn() -> None:
    messages = restart_messages("Do X", "did half of X")
    assert len(messages) == 1 and messages[0]["role"] == "user"
    assert messages[0]["content"].startswith("Do X") and "did half of X" in messages[0]["content"]
    assert SUMMARY_PROMPT not in messages[0]["content"]


@given(st.text(max_size=3000), st.text(max_size=3000), st.integers(200, 2000))
def test_shell_result_fits_its_limit_and_keeps_the_status(stdout: str, stderr: str, limit: int) -> None:
    result = format_shell_result(3, stdout, stderr, False, limit)
    assert result.startswith("[exit code 3]")
    assert len(result) <= limit + 60
