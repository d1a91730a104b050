"""The gateway with the real anthropic/openai SDKs over a scripted engine: protocol, recording, refusals, take-up."""

from __future__ import annotations

import asyncio
import json

import anthropic
import numpy as np
import openai
import pytest

from services.rollout.errors import ApiError
from shared.calls import (
    CALL_INDEX_HEADER,
    CallRecord,
    ExecutionSequences,
    call_record,
    call_seed,
)
from shared.chat import format_tool_call
from shared.events import ExecutionBranched, ExecutionFinished
from tests.rollout.fakes import CharCodec, ScriptedEngine, build_stack

CODEC = CharCodec()
BASH = {
    "name": "bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}


def tool_then_text(prompt: list[int]) -> str:
    """Odd calls ask for a tool; the reply after a tool result is text."""
    text = CODEC.decode(prompt)
    if text.rstrip().endswith("</tool_response>\nassistant") or "</tool_response>" in text[-200:]:
        return "done: " + str(len(prompt))
    return format_tool_call("bash", {"command": f"echo {len(prompt)}"}, "Let me run it.")


@pytest.fixture
def stack():
    return build_stack([ScriptedEngine(CODEC, tool_then_text)], CODEC)


def records(stack, execution_id: str) -> list[CallRecord]:
    return [call_record(call, stack.recorder.blobs[call.record.digest]) for call in stack.recorder.calls(execution_id)]


def stream_types(stack, execution_id: str) -> list[str]:
    return [e.type for e in stack.recorder.events if e.stream_id == f"execution-{execution_id}"]


async def test_plain_message_is_answered_and_recorded_before_return(stack) -> None:
    token = stack.token("exec-1")
    client = stack.anthropic(token)
    msg = await client.messages.create(model="tiny", max_tokens=200,
                                       messages=[{"role": "user", "content": "hello"}], tools=[BASH])
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[1].name == "bash" and msg.content[1].input["command"].startswith("echo ")
    calls = stack.recorder.calls("exec-1")
    assert len(calls) == 1
    assert calls[0].prompt_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert calls[0].completion_tokens == msg.usage.output_tokens
    assert calls[0].api == "anthropic" and calls[0].policy_version == 0 and calls[0].cell_id == "cell-0"
    # The recorded logprobs are the engine's, token for token.
    engine = stack.engines[0]
    rec = records(stack, "exec-1")[0]
    expected = [-((sum(engine.prompts[0]) + 7 * k) % 97) / 10.0 for k in range(len(rec.tokens.completion))]
    assert np.allclose(rec.tokens.logprobs, expected)


async def test_streaming_follows_the_standard_event_sequence(stack) -> None:
    token = stack.token("exec-s")
    client = stack.anthropic(token)
    kinds = []
    async with client.messages.stream(model="tiny", max_tokens=200, tools=[BASH],
                                      messages=[{"role": "user", "content": "hi"}]) as s:
        async for event in s:
            kinds.append(event.type)
        final = await s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[1].type == "tool_use" and final.content[1].input["command"].startswith("echo ")
    assert final.stop_reason == "tool_use"
    assert len(stack.recorder.calls("exec-s")) == 1


async def test_every_answer_names_the_index_its_call_was_recorded_under(stack) -> None:
    """Anthropic and OpenAI, plain and streamed: the header matches the log's call index, call by call."""
    token = stack.token("exec-ix")
    user = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 200, "messages": user, "tools": [BASH]}
    headers = {"x-api-key": token}
    seen = []
    async with stack.http() as http:
        for stream in (False, True):
            r = await http.post("/v1/messages", json={**body, "stream": stream}, headers=headers)
            assert r.status_code == 200
            seen.append(r.headers[CALL_INDEX_HEADER])
            r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                                json={"model": "tiny", "max_tokens": 200, "messages": user, "stream": stream})
            assert r.status_code == 200
            seen.append(r.headers[CALL_INDEX_HEADER])
        # A refused call was not recorded and names no index.
        r = await http.post("/v1/messages", json={"model": "tiny", "messages": user}, headers=headers)
        assert r.status_code == 400 and CALL_INDEX_HEADER not in r.headers
    assert seen == ["0", "1", "2", "3"]
    assert [c.call_index for c in stack.recorder.calls("exec-ix")] == [0, 1, 2, 3]


async def test_a_seed_in_an_anthropic_request_reaches_the_engine(stack) -> None:
    client = stack.anthropic(stack.token("exec-seed"))
    user = [{"role": "user", "content": "hi"}]
    await client.messages.create(model="tiny", max_tokens=50, messages=user, extra_body={"seed": 1_200_036})
    await client.messages.create(model="tiny", max_tokens=50, messages=user)
    assert [s.seed for s in stack.engines[0].samplings] == [1_200_036, None]
    for bad in (-1, 2**63, "7", True):
        with pytest.raises(anthropic.BadRequestError, match="seed"):
            await client.messages.create(model="tiny", max_tokens=50, messages=user, extra_body={"seed": bad})


async def test_twenty_tool_rounds_stay_on_one_path(stack) -> None:
    token = stack.token("exec-20")
    client = stack.anthropic(token)
    messages: list[dict] = [{"role": "user", "content": "work on the task"}]
    system = [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
    for turn in range(20):
        msg = await client.messages.create(model="tiny", max_tokens=300, system=system, tools=[BASH],
                                           messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        uses = [b for b in msg.content if b.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"out {turn}",
                 "cache_control": {"type": "ephemeral"}} for u in uses]})
        else:
            messages.append({"role": "user", "content": f"continue {turn}"})
    calls = stack.recorder.calls("exec-20")
    assert len(calls) == 20
    assert [c.branch_hint for c in calls] == [None] + ["continuation"] * 19
    assert [c.parent_call_index for c in calls] == [None] + list(range(19))
    assert not [e for e in stack.recorder.events if isinstance(e.data, ExecutionBranched)]
    # Deltas: each call stores only what is new, and the log rebuilds every full prompt exactly.
    seqs = ExecutionSequences()
    for rec in records(stack, "exec-20"):
        full = seqs.add(rec)
        assert np.array_equal(full[: rec.prompt_len], stack.engines[0].prompts[rec.call_index])
    assert sum(c.new_prompt_tokens for c in calls) < sum(c.prompt_tokens for c in calls) / 4


async def test_a_compaction_style_restart_is_recorded_as_a_compaction(stack) -> None:
    """The chain's previous call is left in its context (the first user message is replaced by a shorter summary):
    a compaction by the one classifier, which the harness announces itself, so no `execution.branched` is added."""
    client = stack.anthropic(stack.token("exec-c"))
    first = [{"role": "user", "content": "a long task"}]
    msg = await client.messages.create(model="tiny", max_tokens=300, messages=first)
    second = first + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                      {"role": "user", "content": "keep going"}]
    await client.messages.create(model="tiny", max_tokens=300, messages=second)
    await client.messages.create(model="tiny", max_tokens=300,
                                 messages=[{"role": "user", "content": "Summary: the task is half done."}])
    calls = stack.recorder.calls("exec-c")
    assert [c.branch_hint for c in calls] == [None, "continuation", "compaction"]
    assert not [e for e in stack.recorder.events if isinstance(e.data, ExecutionBranched)]


async def test_claude_code_request_shape_is_accepted_and_max_tokens_clamped(stack) -> None:
    token = stack.token("exec-cc")
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "system": [{"type": "text", "text": "You are Claude Code."},
                   {"type": "text", "text": "Env info", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "<system-reminder>todo list is empty</system-reminder>"},
        ],
        "tools": [BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "stream": True,
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    async with stack.http() as http:
        r = await http.post("/v1/messages?beta=true", json=body, headers={
            "authorization": f"Bearer {token}", "anthropic-version": "2023-06-01",
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
            "x-claude-code-session-id": "s-1"})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    usage = events[-2]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == stack.recorder.calls("exec-cc")[0].prompt_tokens
    # count_tokens agrees with what the call used.
    async with stack.http() as http:
        r = await http.post("/v1/messages/count_tokens?beta=true",
                            json={k: body[k] for k in ("model", "system", "messages", "tools")},
                            headers={"x-api-key": token})
    assert r.json()["input_tokens"] == stack.recorder.calls("exec-cc")[0].prompt_tokens


async def test_the_runs_reply_budget_caps_what_a_request_asks() -> None:
    """Claude Code asks for 32,000 tokens a reply; the gateway gives at most the run's budget, and a smaller ask
    as it is."""
    stack = build_stack([ScriptedEngine(CODEC, tool_then_text)], CODEC, max_reply_tokens=96)
    client = stack.anthropic(stack.token("exec-cap"))
    for asked in (16000, 40):
        await client.messages.create(model="tiny", max_tokens=asked, messages=[{"role": "user", "content": "hi"}])
    assert [s.max_tokens for s in stack.engines[0].samplings] == [96, 40]


async def test_openai_client_gets_tool_calls_and_streams(stack) -> None:
    token = stack.token("exec-oa")
    client = stack.openai(token)
    tools = [{"type": "function", "function": {"name": "bash", "description": "run",
                                               "parameters": BASH["input_schema"]}}]
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "list"}]
    r = await client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "bash" and json.loads(call.function.arguments)["command"].startswith("echo ")
    assert r.usage.prompt_tokens == stack.recorder.calls("exec-oa")[0].prompt_tokens
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
    chunks = [c async for c in await client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("done:")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == stack.recorder.calls("exec-oa")[1].completion_tokens
    assert [c.branch_hint for c in stack.recorder.calls("exec-oa")] == [None, "continuation"]


async def test_bad_requests_raise_sdk_errors_record_no_call_and_each_refusal() -> None:
    stack = build_stack([ScriptedEngine(CODEC, max_model_len=300)], CODEC, max_body_bytes=20_000)
    token = stack.token("exec-bad")
    client = stack.anthropic(token)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError, match="execution"):
        await stack.anthropic("gyre-not-a-token").messages.create(model="tiny", max_tokens=10, messages=user)
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        await client.messages.create(model="tiny", max_tokens=10, messages=user,
                                     tools=[{"name": "bash", "input_schema": {"type": "string"}}])
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        await client.messages.create(model="tiny", max_tokens=10,
                                     messages=[{"role": "user", "content": "x" * 400}])
    with pytest.raises(anthropic.BadRequestError, match="at least one message"):
        await client.messages.create(model="tiny", max_tokens=10, messages=[])
    with pytest.raises(anthropic.APIStatusError) as too_large:
        await client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "y" * 30_000}])
    assert too_large.value.status_code == 413
    async with stack.http() as http:
        r = await http.post("/v1/messages", content=b"{not json", headers={"x-api-key": token})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post("/v1/messages", json={"model": "tiny", "messages": user}, headers={"x-api-key": token})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    oa = stack.openai(token)
    with pytest.raises(openai.AuthenticationError):
        await stack.openai("nope").chat.completions.create(model="tiny", messages=user)
    with pytest.raises(openai.BadRequestError, match="parameters"):
        await oa.chat.completions.create(model="tiny", messages=user, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        await oa.chat.completions.create(model="tiny", messages=[])
    assert stack.recorder.calls() == [] and stack.engines[0].prompts == []
    # Every refusal the agent saw is in its execution's log; a token that names no execution (401) has none.
    refusals = stack.recorder.refusals()
    assert [r.execution_id for r in refusals] == ["exec-bad"] * 8
    assert [r.status for r in refusals] == [400, 400, 400, 413, 400, 400, 400, 400]
    assert [r.api for r in refusals] == ["anthropic"] * 6 + ["openai"] * 2
    assert not any(r.infra or r.budget_spent for r in refusals) and "input_schema" in refusals[0].reason


_USER = [{"role": "user", "content": "hi"}]
_FN = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/chat/completions", {"model": "tiny", "messages": _USER, "tools": [{"type": "function", "function": _FN}],
                              "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": _USER, "tool_choice": 7}, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [*_USER, {"role": "assistant", "tool_calls": 5}]},
     "tool_calls"),
    ("/v1/chat/completions", {"model": "tiny", "messages": _USER,
                              "tools": [{"type": "function", "function": {**_FN, "description": 5}}]}, "description"),
    ("/v1/chat/completions", {"model": "tiny", "messages": _USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["a"]}}}]},
     "properties"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": _USER, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {"a": "string"}}}]}, "properties"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": _USER, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {}, "required": 5}}]}, "required"),
    ("/v1/messages", "[" * 100_000 + "]" * 100_000, "nests deeper than 100 levels"),
], ids=["oa-choice-fn", "oa-choice-kind", "oa-tool-calls", "oa-description", "oa-properties",
        "an-property-schema", "an-required", "deep-json"])
async def test_malformed_bodies_are_400_naming_the_field(path: str, body: object, fragment: str) -> None:
    """Shapes a schema-trusting code path would trip on (a 500 that the harness would blame on the
    infrastructure) are the client's error: 400 invalid_request_error, nothing generated or recorded."""
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    token = stack.token("exec-400")
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    async with stack.http() as http:
        r = await http.post(path, content=content, headers={"x-api-key": token, "authorization": f"Bearer {token}",
                                                            "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and fragment in r.json()["error"]["message"]
    assert stack.recorder.calls() == [] and stack.engines[0].prompts == []
    assert [(e.status, e.kind) for e in stack.recorder.refusals("exec-400")] == [(400, "invalid_request_error")]


async def test_an_execution_taken_up_from_its_start_samples_with_its_seed_and_keeps_to_its_call_budget() -> None:
    """`execution.started` reaches the gateway before the agent's first call: its log is being read and its cell
    preferred. A call without its own seed samples with `call_seed(seed, index)`; one that brings a seed keeps it;
    once the budget's calls are answered the next is refused (400), and its `call.refused` says so."""
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    stack.start("exec-s", seed=7, call_budget=2, cell_id="cell-x")
    assert stack.core.router.preferred == {"exec-s": "cell-x"}  # the router starts it there if it can
    assert stack.recorder._lines["exec-s"].prefetch is not None  # its log is being read before its first call
    client = stack.anthropic(stack.token("exec-s"))
    user = [{"role": "user", "content": "hi"}]
    await client.messages.create(model="tiny", max_tokens=5, messages=user)
    await client.messages.create(model="tiny", max_tokens=5, messages=user, extra_body={"seed": 99})
    assert [sp.seed for sp in stack.engines[0].samplings] == [call_seed(7, 0), 99]
    assert stack.recorder.refusals("exec-s") == []
    with pytest.raises(anthropic.BadRequestError, match="call budget"):
        await client.messages.create(model="tiny", max_tokens=5, messages=user)
    (spent,) = stack.recorder.refusals("exec-s")
    assert spent.budget_spent and not spent.infra and spent.answered == 2 and spent.status == 400
    assert len(stack.engines[0].samplings) == 2 and len(stack.recorder.calls("exec-s")) == 2


async def test_a_restarted_gateway_takes_seed_budget_and_end_from_the_log() -> None:
    """A gateway that restarts loses what it held. The first call of an execution it did not see start recalls
    the execution's seed, call budget, calls so far and latest cell from its log, so sampling and the budget go
    on where they were; and a derived token (which a restart still verifies) of an execution whose log holds its
    end is refused."""
    engines = [ScriptedEngine(CODEC), ScriptedEngine(CODEC)]
    stack = build_stack(engines, CODEC)
    stack.start("exec-r", seed=7, call_budget=3, cell_id="cell-1")
    user = [{"role": "user", "content": "hi"}]
    token = stack.token("exec-r")
    await stack.anthropic(token).messages.create(model="tiny", max_tokens=5, messages=user)
    assert [sp.seed for sp in engines[1].samplings] == [call_seed(7, 0)] and engines[0].samplings == []

    # The restart: a new gateway over the same log and workers, nothing taken up.
    restarted = build_stack(engines, CODEC, recorder=stack.recorder.restarted())
    client = restarted.anthropic(token)
    await client.messages.create(model="tiny", max_tokens=5, messages=user)
    await client.messages.create(model="tiny", max_tokens=5, messages=user)
    assert [sp.seed for sp in engines[1].samplings] == [call_seed(7, i) for i in range(3)]  # on the same cell
    assert engines[0].samplings == []
    with pytest.raises(anthropic.BadRequestError, match="call budget is spent: 3 of 3"):
        await client.messages.create(model="tiny", max_tokens=5, messages=user)
    assert [c.call_index for c in stack.recorder.calls("exec-r")] == [0, 1, 2]

    stack.log(ExecutionFinished(execution_id="exec-r", elapsed_s=1.0, calls=3))
    again = build_stack(engines, CODEC, recorder=stack.recorder.restarted())
    with pytest.raises(anthropic.AuthenticationError, match="has ended"):
        await again.anthropic(token).messages.create(model="tiny", max_tokens=5, messages=user)
    assert "exec-r" not in again.core.executions and len(engines[1].samplings) == 3
    assert again.core.tokens.revoked("exec-r")  # its next call is refused at once, without reading the log


async def test_a_stop_sequence_ends_the_reply_text_but_its_tokens_are_recorded() -> None:
    """The engine keeps the tokens that spell the stop string (they were generated and are trained); the reply's
    text ends before it, as both APIs define, and says which one matched."""
    stack = build_stack([ScriptedEngine(CODEC, lambda prompt: "helloEND world")], CODEC)
    token = stack.token("exec-stop")
    reply = await stack.anthropic(token).messages.create(model="tiny", max_tokens=50, stop_sequences=["END"],
                                                         messages=[{"role": "user", "content": "hi"}])
    assert [b.text for b in reply.content] == ["hello"]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "END")
    oa = await stack.openai(token).chat.completions.create(model="tiny", stop=["END"],
                                                           messages=[{"role": "user", "content": "hi"}])
    assert oa.choices[0].message.content == "hello" and oa.choices[0].finish_reason == "stop"
    (first, _) = stack.recorder.calls("exec-stop")
    assert first.completion_tokens == len("helloEND")


async def test_a_failed_record_fails_the_request_and_the_refusal_is_recorded() -> None:
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    token = stack.token("exec-f")
    stack.recorder.fail_next = ConnectionError("postgres went away")
    with pytest.raises(anthropic.InternalServerError, match="not returned"):
        await stack.anthropic(token).messages.create(model="tiny", max_tokens=50,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert stack.recorder.calls() == []
    (refused,) = stack.recorder.refusals("exec-f")
    assert refused.status == 500 and refused.infra and "postgres went away" in refused.reason
    # The execution continues normally afterwards, from call index 0.
    await stack.anthropic(token).messages.create(model="tiny", max_tokens=50,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert [c.call_index for c in stack.recorder.calls("exec-f")] == [0]


async def test_no_capacity_is_429_with_retry_after() -> None:
    stack = build_stack([ScriptedEngine(CODEC)], CODEC, capacity=1)
    user = [{"role": "user", "content": "hi"}]
    await stack.anthropic(stack.token("exec-a")).messages.create(model="tiny", max_tokens=20,
                                                                           messages=user)
    with pytest.raises(anthropic.RateLimitError) as err:
        await stack.anthropic(stack.token("exec-b")).messages.create(model="tiny", max_tokens=20,
                                                                               messages=user)
    assert int(err.value.response.headers["retry-after"]) >= 1


async def test_only_a_token_derived_from_the_runs_secret_names_an_execution(stack) -> None:
    from shared.execution_tokens import derive_execution_token

    await stack.anthropic(stack.token("exec-derived")).messages.create(
        model="tiny", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert len(stack.recorder.calls("exec-derived")) == 1
    with pytest.raises(anthropic.AuthenticationError):
        await stack.anthropic(derive_execution_token(b"other-secret", "exec-derived")).messages.create(
            model="tiny", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert stack.recorder.refusals() == []  # a token that names no execution has no log to write to


async def test_an_ended_executions_token_is_refused_and_the_internal_api_is_gone(stack) -> None:
    """Services meet through events: no HTTP control API is left for an agent in a sandbox to reach."""
    token = stack.token("exec-end")
    await stack.anthropic(token).messages.create(model="tiny", max_tokens=20,
                                                 messages=[{"role": "user", "content": "hi"}])
    stack.core.end_execution("exec-end")  # what its execution.finished does
    with pytest.raises(anthropic.AuthenticationError):
        await stack.anthropic(token).messages.create(model="tiny", max_tokens=20,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert stack.recorder.refusals("exec-end") == []
    async with stack.http() as http:
        assert (await http.post("/internal/executions", json={"execution_id": "x"})).status_code == 404
        assert (await http.get("/internal/executions/exec-end")).status_code == 404
        assert (await http.delete("/internal/executions/exec-end")).status_code == 404


async def test_an_echo_that_drops_the_tool_call_is_a_fork_not_a_silent_splice(stack) -> None:
    client = stack.anthropic(stack.token("exec-drop"))
    first = [{"role": "user", "content": "task"}]
    msg = await client.messages.create(model="tiny", max_tokens=300, tools=[BASH], messages=first)
    assert msg.stop_reason == "tool_use"
    # The harness keeps only the text block of the reply.
    await client.messages.create(model="tiny", max_tokens=300, tools=[BASH], messages=first + [
        {"role": "assistant", "content": msg.content[0].text}, {"role": "user", "content": "go on"}])
    calls = stack.recorder.calls("exec-drop")
    assert calls[1].branch_hint == "fork"
    (branched,) = [e.data for e in stack.recorder.events if isinstance(e.data, ExecutionBranched)]
    assert (branched.kind, branched.at_call_index, branched.from_call_index) == ("fork", 1, 0)
    assert branched.cause == "reply_rewritten"
    # The shared prefix ends inside the first reply: the generated text is kept, the dropped call is not.
    assert calls[0].prompt_tokens < calls[1].parent_prefix_len < calls[0].prompt_tokens + calls[0].completion_tokens


async def test_every_refused_call_of_an_execution_is_in_its_log_in_order() -> None:
    """The harness folds these after an external agent exits: a refusal that was the infrastructure's (5xx,
    429) is marked `infra`, a refusal of the request itself is not, and answered calls sit between them in
    stream order, whichever API the call came through."""
    stack = build_stack([ScriptedEngine(CODEC, max_model_len=300)], CODEC, capacity=1)
    token = stack.token("exec-s")
    client = stack.anthropic(token)
    user = [{"role": "user", "content": "hi"}]
    stack.recorder.fail_next = ConnectionError("postgres went away")
    with pytest.raises(anthropic.InternalServerError):
        await client.messages.create(model="tiny", max_tokens=20, messages=user)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):  # the request's own fault
        await client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "x" * 400}])
    stack.recorder.fail_next = ConnectionError("again")
    with pytest.raises(openai.InternalServerError):
        await stack.openai(token).chat.completions.create(model="tiny", messages=user)
    await client.messages.create(model="tiny", max_tokens=20, messages=user)
    assert stream_types(stack, "exec-s") == ["call.refused"] * 3 + ["call.completed"]
    refusals = stack.recorder.refusals("exec-s")
    assert [(r.status, r.kind, r.infra, r.api) for r in refusals] == [
        (500, "api_error", True, "anthropic"), (400, "invalid_request_error", False, "anthropic"),
        (500, "api_error", True, "openai")]
    assert "postgres went away" in refusals[0].reason and "again" in refusals[2].reason
    # No capacity: exec-s holds the worker's only slot, so another execution is refused with 429.
    with pytest.raises(anthropic.RateLimitError):
        await stack.anthropic(stack.token("exec-c")).messages.create(model="tiny", max_tokens=20, messages=user)
    (busy,) = stack.recorder.refusals("exec-c")
    assert busy.status == 429 and busy.infra and busy.answered == 0
    # Only what the agent was told: no token, header or body in the event.
    assert token not in json.dumps([r.model_dump() for r in stack.recorder.refusals()])


async def test_a_refusal_is_written_before_its_error_is_answered() -> None:
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    storage = stack.recorder.storage
    entered, release = asyncio.Event(), asyncio.Event()
    append = storage.append_events

    async def gated(events):
        entered.set()
        await release.wait()
        await append(events)

    storage.append_events = gated  # type: ignore[method-assign]
    call = asyncio.create_task(stack.anthropic(stack.token("exec-o")).messages.create(
        model="tiny", max_tokens=10, messages=[]))
    await asyncio.wait_for(entered.wait(), 10)
    await asyncio.sleep(0.05)
    assert not call.done()  # the agent has no answer while its refusal is being written
    release.set()
    with pytest.raises(anthropic.BadRequestError):
        await call
    assert [r.status for r in stack.recorder.refusals("exec-o")] == [400]


async def test_a_refusal_that_cannot_be_written_is_answered_all_the_same() -> None:
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)

    async def down(events):
        raise ConnectionError("postgres went away")

    stack.recorder.storage.append_events = down  # type: ignore[method-assign]
    with pytest.raises(anthropic.BadRequestError, match="at least one message"):
        await stack.anthropic(stack.token("exec-d")).messages.create(model="tiny", max_tokens=10, messages=[])
    assert stack.recorder.events == []


async def test_a_started_event_is_taken_up_once_and_never_over_a_first_call() -> None:
    """`execution.started` may arrive after the agent's first call (the event bus lags): the execution that call
    settled is left as it is. A second delivery changes nothing, and an ended execution is not taken up again."""
    stack = build_stack([ScriptedEngine(CODEC), ScriptedEngine(CODEC)], CODEC)
    storage = stack.recorder.storage
    reads: list[str] = []
    read = storage.read_execution

    async def counted(execution_id):
        reads.append(execution_id)
        return await read(execution_id)

    storage.read_execution = counted  # type: ignore[method-assign]
    started = stack.start("exec-t", seed=3, call_budget=5, cell_id="cell-1")
    stack.core.take_up(started)  # delivered twice
    await asyncio.sleep(0.05)
    assert reads == ["exec-t"]  # one read, started by the take-up
    client = stack.anthropic(stack.token("exec-t"))
    user = [{"role": "user", "content": "hi"}]
    await client.messages.create(model="tiny", max_tokens=5, messages=user)
    assert reads == ["exec-t"]  # the first call found the log read
    assert stack.core.router.worker_of("exec-t") == "w1"

    # A first call settles an execution whose start has not arrived; the late start changes nothing.
    late = stack.log(started.model_copy(update={"execution_id": "exec-late", "cell_id": "cell-1"}))
    await stack.anthropic(stack.token("exec-late")).messages.create(model="tiny", max_tokens=5, messages=user)
    placed, answered = stack.core.router.worker_of("exec-late"), stack.core.executions["exec-late"].answered
    stack.core.take_up(late.data)
    assert stack.core.router.worker_of("exec-late") == placed and "exec-late" not in stack.core.router.preferred
    assert stack.core.executions["exec-late"].answered == answered == 1
    stack.core.end_execution("exec-late")
    stack.core.take_up(late.data)  # redelivered after its end
    assert "exec-late" not in stack.core.executions and "exec-late" not in stack.recorder._lines


async def test_a_refusal_after_an_execution_ended_does_not_bring_its_state_back() -> None:
    """A call still in flight when the execution's end event arrives may fail afterwards; nothing is kept for it
    and nothing is written to the closed log."""
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    token = stack.token("exec-end")
    await stack.anthropic(token).messages.create(model="tiny", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert "exec-end" in stack.core.executions
    stack.core.end_execution("exec-end")
    await stack.core.refuse("exec-end", ApiError("rate_limit_error", "late"), api="anthropic")
    assert "exec-end" not in stack.core.executions and stack.recorder.refusals() == []
    async with stack.http() as http:  # every endpoint authenticates before it reads a body
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
            r = await http.post(path, content=b"{not json", headers={"x-api-key": "gyre-not-a-token"})
            assert r.status_code == 401, path


async def test_a_call_generating_when_its_execution_ends_leaves_nothing_behind() -> None:
    """A timeout usually lands while a call is generating. The call still finishes (recorded after the end,
    which the trajectory service leaves out), but what it set up again for the execution in the router and
    the recorder is dropped with it, not kept for the life of the process."""

    class GatedEngine(ScriptedEngine):
        gate = asyncio.Event()

        async def generate(self, prompt, sampling, request_id):
            await self.gate.wait()
            return await super().generate(prompt, sampling, request_id)

    stack = build_stack([GatedEngine(CODEC)], CODEC)
    token = stack.token("exec-late")
    stack.start("exec-late", seed=1)
    call = asyncio.create_task(stack.anthropic(token).messages.create(
        model="tiny", max_tokens=20, messages=[{"role": "user", "content": "hi"}]))
    for _ in range(200):
        if stack.core.router.worker_of("exec-late") is not None:
            break
        await asyncio.sleep(0.01)
    stack.core.end_execution("exec-late")  # the end event arrives while the call generates
    GatedEngine.gate.set()
    await call
    assert len(stack.recorder.calls("exec-late")) == 1
    assert "exec-late" not in stack.core.executions and stack.core.router.worker_of("exec-late") is None
    assert stack.recorder._lines == {} and stack.recorder._ending == {}


async def test_metrics_count_answered_and_refused_calls_tokens_and_live_executions(stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client = stack.anthropic(stack.token("exec-m"))
    for text in ("one", "two"):
        await client.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user", "content": text}],
                                     tools=[BASH])
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model="tiny", max_tokens=10, messages=[])
    with pytest.raises(anthropic.AuthenticationError):
        await stack.anthropic("not-a-token").messages.create(model="tiny", max_tokens=10,
                                                           messages=[{"role": "user", "content": "x"}])
    async with stack.http() as http:
        r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(r.text) for s in family.samples}
    calls = stack.recorder.calls("exec-m")
    assert samples[("gyre_gateway_calls_total", (("api", "anthropic"),))] == 2
    assert samples[("gyre_gateway_call_seconds_count", (("api", "anthropic"),))] == 2
    assert samples[("gyre_gateway_prompt_tokens_total", ())] == sum(c.prompt_tokens for c in calls)
    assert samples[("gyre_gateway_completion_tokens_total", ())] == sum(c.completion_tokens for c in calls)
    refused = {k[1]: v for k, v in samples.items() if k[0] == "gyre_gateway_refusals_total"}
    assert refused == {(("api", "anthropic"), ("kind", "invalid_request_error"), ("status", "400")): 1,
                       (("api", "anthropic"), ("kind", "authentication_error"), ("status", "401")): 1}
    assert samples[("gyre_gateway_live_executions", ())] == 1
    assert samples[("gyre_gateway_live_workers", ())] == 1


async def test_a_replayed_call_is_answered_from_the_log_and_a_bad_or_unknown_one_is_not(stack) -> None:
    """REPLAY_HEADER: the same call made again (a resumed agent) gets the recorded reply with no generation and
    nothing recorded; an index the log does not hold is served live; a malformed index is a 400, refused."""
    from shared.calls import REPLAY_HEADER

    client = stack.anthropic(stack.token("exec-replay"))
    request = {"model": "tiny", "max_tokens": 200, "tools": [BASH], "messages": [{"role": "user", "content": "hi"}]}
    first = await client.messages.with_raw_response.create(**request)
    again = await client.messages.with_raw_response.create(**request, extra_headers={REPLAY_HEADER: "0"})
    assert again.headers[CALL_INDEX_HEADER] == first.headers[CALL_INDEX_HEADER] == "0"
    original, replayed = await first.parse(), await again.parse()
    assert [b.model_dump() for b in replayed.content] == [b.model_dump() for b in original.content]
    assert replayed.usage.output_tokens == original.usage.output_tokens
    assert len(stack.engines[0].prompts) == 1 and len(stack.recorder.calls("exec-replay")) == 1
    # Not in the log: generated and recorded as the next call.
    unknown = await client.messages.with_raw_response.create(**request, extra_headers={REPLAY_HEADER: "7"})
    assert unknown.headers[CALL_INDEX_HEADER] == "1" and len(stack.recorder.calls("exec-replay")) == 2
    with pytest.raises(anthropic.BadRequestError, match=REPLAY_HEADER):
        await client.messages.create(**request, extra_headers={REPLAY_HEADER: "-1"})
    assert stream_types(stack, "exec-replay")[-1] == "call.refused"
