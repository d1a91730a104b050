"""Token-in/token-out (pure core): continuations reuse generated ids, divergence renders afresh."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.call_log import CallLog
from services.rollout.codec import reply_message
from services.rollout.conversation import ChatMessage, Conversation, ToolSpec
from services.rollout.tito import TitoState
from shared.chat import ToolCall, format_tool_call
from tests.rollout.fakes import CharCodec

CODEC = CharCodec()
TOOLS = (
    ToolSpec(
        name="bash",
        description="run a command",
        parameters={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    ),
)

texts = st.text(alphabet="abcdefgh xyz.\n{}\"", min_size=0, max_size=30)
replies = st.one_of(
    texts,
    st.builds(lambda t, c: format_tool_call("bash", {"command": c}, t), texts, texts),
)


def _generate(text: str) -> np.ndarray:
    return np.asarray(CODEC.encode(text) + [CODEC.end_of_turn_id], dtype=np.int32)


def _run_turns(state: TitoState, log: CallLog, conv: Conversation, reply_texts: list[str],
               results: list[str]) -> tuple[list, Conversation]:
    plans = []
    for i, text in enumerate(reply_texts):
        plan = state.plan(conv, CODEC)
        completion = _generate(text)
        placement = log.place(plan.prompt, chain_id=plan.chain_id)
        log.add(placement, plan.prompt, completion)
        reply = reply_message(text)
        state.commit(plan, completion=completion, reply=reply, codec=CODEC)
        plans.append((plan, placement))
        follow = (
            ChatMessage(role="tool", content=results[i]) if reply.tool_calls else ChatMessage(role="user", content=results[i])
        )
        conv = Conversation(messages=conv.messages + (reply, follow), tools=conv.tools)
    return plans, conv


@settings(max_examples=60, deadline=None)
@given(st.lists(replies, min_size=1, max_size=8), st.lists(texts, min_size=8, max_size=8))
def test_continuations_stay_on_one_path_and_equal_fresh_tokenization(reply_texts: list[str], results: list[str]) -> None:
    state, log = TitoState(), CallLog()
    conv = Conversation(
        messages=(ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="start")),
        tools=TOOLS,
    )
    plans, _ = _run_turns(state, log, conv, reply_texts, results)
    for i, (plan, placement) in enumerate(plans):
        if i == 0:
            assert plan.reused is None and placement.branch_hint is None
            continue
        assert plan.reused is not None and plan.reused.kind == "response"
        assert placement.branch_hint == "continuation"
        assert placement.parent_call_index == i - 1
        # The char codec tokenizes canonically, so reuse must give exactly the fresh tokenization whenever the
        # reply re-renders to exactly the text the model wrote (plain, unstripped text).
        fresh = np.asarray(CODEC.encode(plan.prompt_text), dtype=np.int32)
        canonical = [(not reply_message(t).tool_calls and reply_message(t).content == t) for t in reply_texts[:i]]
        if all(canonical):
            assert np.array_equal(plan.prompt, fresh)


def test_generated_ids_are_reused_even_when_retokenizing_would_differ() -> None:
    state = TitoState()
    conv = Conversation(messages=(ChatMessage(role="user", content="hi"),))
    plan = state.plan(conv, CODEC)
    # The model spelled "ok" with an id the tokenizer would never produce (like a non-canonical BPE split).
    odd = np.array([100 + ord("o"), 99, CODEC.end_of_turn_id], dtype=np.int32)
    reply = ChatMessage(role="assistant", content="o")
    state.commit(plan, completion=odd, reply=reply, codec=CODEC)
    nxt = Conversation(messages=conv.messages + (reply, ChatMessage(role="user", content="more")))
    plan2 = state.plan(nxt, CODEC)
    prefix = np.concatenate([plan.prompt, odd])
    assert np.array_equal(plan2.prompt[: len(prefix)], prefix)
    assert plan2.prompt_text.endswith("<|im_start|>assistant\n")


def test_tool_call_reply_reuses_generated_json_spacing() -> None:
    state = TitoState()
    conv = Conversation(messages=(ChatMessage(role="user", content="list files"),), tools=TOOLS)
    plan = state.plan(conv, CODEC)
    # Generated JSON without spaces; the template re-renders it with spaces.
    generated = '<tool_call>\n{"name":"bash","arguments":{"command":"ls"}}\n</tool_call>'
    completion = _generate(generated)
    reply = reply_message(generated)
    assert reply.tool_calls and reply.tool_calls[0].arguments == {"command": "ls"}
    state.commit(plan, completion=completion, reply=reply, codec=CODEC)
    nxt = Conversation(messages=conv.messages + (reply, ChatMessage(role="tool", content="a.txt")), tools=TOOLS)
    plan2 = state.plan(nxt, CODEC)
    prefix = np.concatenate([plan.prompt, completion])
    assert np.array_equal(plan2.prompt[: len(prefix)], prefix)
    assert not np.array_equal(plan2.prompt, np.asarray(CODEC.encode(plan2.prompt_text)))


def test_edited_history_is_rendered_afresh_and_recorded_as_compaction() -> None:
    state, log = TitoState(), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="task one"),))
    plans, conv2 = _run_turns(state, log, conv, ["first", "second"], ["next", "again"])
    # A harness that rewrites the first user message (e.g. compaction into a summary).
    compacted = Conversation(messages=(ChatMessage(role="user", content="summary of work so far"),))
    plan = state.plan(compacted, CODEC)
    assert plan.reused is None
    assert np.array_equal(plan.prompt, np.asarray(CODEC.encode(plan.prompt_text), dtype=np.int32))
    placement = log.place(plan.prompt, chain_id=plan.chain_id)
    # Shorter than the chain's previous call, and leaving it in its context (the first user message).
    assert placement.branch_hint == "compaction" and placement.head_call_index == 1
    assert plan.chain_id == "main"  # same system prompt and tools: the same agent chain


def test_resending_the_same_request_is_a_retry_with_identical_prompt() -> None:
    state, log = TitoState(), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="hello"),))
    plans, _ = _run_turns(state, log, conv, ["a"], ["b"])
    again = state.plan(conv, CODEC)
    assert np.array_equal(again.prompt, plans[0][0].prompt)
    assert log.place(again.prompt, chain_id=again.chain_id).branch_hint == "retry"


def test_echo_with_stripped_whitespace_still_continues() -> None:
    state = TitoState()
    conv = Conversation(messages=(ChatMessage(role="user", content="q"),))
    plan = state.plan(conv, CODEC)
    state.commit(plan, completion=_generate("answer \n"), reply=ChatMessage(role="assistant", content="answer \n"),
                 codec=CODEC)
    echoed = ChatMessage(role="assistant", content="answer")
    plan2 = state.plan(Conversation(messages=conv.messages + (echoed, ChatMessage(role="user", content="q2"))), CODEC)
    assert plan2.reused is not None and plan2.reused.kind == "response"


# Claude Code's own file tools, as its requests define them (recorded: services/harness/fixtures/).
EDIT_TOOLS = (
    ToolSpec(name="Edit", description="edit a file", parameters={
        "type": "object", "required": ["file_path", "old_string", "new_string"],
        "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                       "new_string": {"type": "string"}, "replace_all": {"type": "boolean", "default": False}}}),
    ToolSpec(name="Write", description="write a file", parameters={
        "type": "object", "required": ["file_path", "content"],
        "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}}}),
)


def _echo_continues(generated: str, echoed: ToolCall) -> bool:
    """Whether a request echoing the model's tool call as `echoed` reuses the ids the model generated."""
    state, log = TitoState(), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="fix it"),), tools=EDIT_TOOLS)
    plan = state.plan(conv, CODEC)
    completion = _generate(generated)
    log.add(log.place(plan.prompt, chain_id=plan.chain_id), plan.prompt, completion)
    state.commit(plan, completion=completion, reply=reply_message(generated), codec=CODEC)
    echo = ChatMessage(role="assistant", content="", tool_calls=(echoed,))
    nxt = Conversation(messages=(*conv.messages, echo, ChatMessage(role="tool", content="ok")), tools=EDIT_TOOLS)
    plan2 = state.plan(nxt, CODEC)
    reused = plan2.reused is not None and plan2.reused.kind == "response"
    prefix = np.concatenate([plan.prompt, completion])
    assert reused == np.array_equal(plan2.prompt[: len(prefix)], prefix)
    placement = log.place(plan2.prompt, chain_id=plan2.chain_id)
    assert (placement.branch_hint == "continuation") == reused, placement.branch_hint
    return reused


def test_an_echoed_edit_with_its_schema_default_added_and_keys_reordered_keeps_the_generated_tokens() -> None:
    generated = format_tool_call("Edit", {"file_path": "a.py", "old_string": "x", "new_string": "y"})
    echoed = ToolCall(name="Edit", arguments={"replace_all": False, "new_string": "y", "old_string": "x",
                                              "file_path": "a.py"})
    assert _echo_continues(generated, echoed)


def test_an_echoed_write_with_trailing_spaces_stripped_keeps_the_generated_tokens() -> None:
    generated = format_tool_call("Write", {"file_path": "a.txt", "content": "one  \ntwo\t\n"})
    assert _echo_continues(generated, ToolCall(name="Write", arguments={"file_path": "a.txt",
                                                                        "content": "one\ntwo\n"}))


def test_an_echo_that_changes_what_the_model_asked_for_is_a_fork() -> None:
    generated = format_tool_call("Edit", {"file_path": "a.py", "old_string": "x", "new_string": "y"})
    # replace_all true is not the default: a different call. And 0 is not false as a JSON value.
    for arguments in ({"replace_all": True}, {"replace_all": 0}, {"new_string": "z"}):
        echoed = ToolCall(name="Edit", arguments={"file_path": "a.py", "old_string": "x", "new_string": "y",
                                                  **arguments})
        assert not _echo_continues(generated, echoed), arguments


def test_a_different_system_prompt_starts_a_new_chain() -> None:
    state, log = TitoState(), CallLog()
    main = Conversation(messages=(ChatMessage(role="system", content="main agent"),
                                  ChatMessage(role="user", content="do it")), tools=TOOLS)
    _run_turns(state, log, main, ["ok"], ["go"])
    sub = Conversation(messages=(ChatMessage(role="system", content="sub agent"),
                                 ChatMessage(role="user", content="part")))
    plan = state.plan(sub, CODEC)
    assert plan.chain_id == "chain-1"
    assert log.place(plan.prompt, chain_id=plan.chain_id).branch_hint == "delegation"


def test_reply_cut_by_max_tokens_is_closed_with_end_of_turn_before_reuse() -> None:
    state = TitoState()
    conv = Conversation(messages=(ChatMessage(role="user", content="q"),))
    plan = state.plan(conv, CODEC)
    truncated = np.asarray(CODEC.encode("partial"), dtype=np.int32)  # no EOS: finish_reason length
    state.commit(plan, completion=truncated, reply=ChatMessage(role="assistant", content="partial"), codec=CODEC)
    nxt = Conversation(messages=conv.messages + (ChatMessage(role="assistant", content="partial"),
                                                 ChatMessage(role="user", content="go on")))
    plan2 = state.plan(nxt, CODEC)
    expected = np.concatenate([plan.prompt, truncated, [CODEC.end_of_turn_id]])
    assert np.array_equal(plan2.prompt[: len(expected)], expected)
    assert np.array_equal(plan2.prompt, np.asarray(CODEC.encode(plan2.prompt_text), dtype=np.int32))


def test_anchor_memory_is_bounded() -> None:
    state, log = TitoState(max_anchors=4), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="x"),))
    _run_turns(state, log, conv, [f"r{i}" for i in range(6)], [f"u{i}" for i in range(6)])
    assert len(state.anchors) == 4


def test_a_long_conversation_holds_its_ids_once_not_once_a_call() -> None:
    state, log = TitoState(), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="start"),))
    plans, _ = _run_turns(state, log, conv, [" ".join([f"reply {i}"] * 5) for i in range(30)],
                           [" ".join([f"result {i}"] * 20) for i in range(30)])
    # Every anchor and every logged sequence is a view of one buffer per side (the prompt resent in full by
    # every call is stored once), and each still shows exactly what it stood for.
    assert len({id(a.buffer) for a in state.anchors.values()}) == 1
    assert len({id(b) for b in log.buffers}) == 1
    for i, (plan, _) in enumerate(plans):
        assert np.array_equal(log.sequences[i][: len(plan.prompt)], plan.prompt)
    last = plans[-1][0]
    assert np.array_equal(last.prompt, np.asarray(CODEC.encode(last.prompt_text), dtype=np.int32))


def test_counting_tokens_and_an_uncommitted_plan_leave_the_next_prompt_unchanged() -> None:
    state, log = TitoState(), CallLog()
    conv = Conversation(messages=(ChatMessage(role="user", content="start"),))
    _, conv = _run_turns(state, log, conv, ["one", "two"], ["r1", "r2"])
    expected = np.asarray(CODEC.encode(CODEC.render(conv, add_generation_prompt=True)), dtype=np.int32)
    assert state.prompt_len(conv, CODEC) == len(expected)
    abandoned = state.plan(conv, CODEC)  # its call failed: never committed
    assert np.array_equal(abandoned.prompt, expected)
    retried = state.plan(conv, CODEC)  # appended past the abandoned plan's ids, so it gets a buffer of its own
    assert np.array_equal(retried.prompt, expected) and np.array_equal(abandoned.prompt, expected)
    completion = _generate("three")
    state.commit(retried, completion=completion, reply=reply_message("three"), codec=CODEC)
    nxt = Conversation(messages=conv.messages + (reply_message("three"), ChatMessage(role="user", content="r3")))
    plan = state.plan(nxt, CODEC)
    assert np.array_equal(plan.prompt[: len(expected) + len(completion)], np.concatenate([expected, completion]))
    assert np.array_equal(plan.prompt, np.asarray(CODEC.encode(plan.prompt_text), dtype=np.int32))


def test_the_long_context_benchmark_runs_and_shares_memory() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "bench/gateway_context.py", "--at", "3,6", "--user-words", "200"],
                         cwd=root, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gateway_context" and [p["turn"] for p in result["points"]] == [3, 6]
    assert result["points"][0]["prompt_tokens"] < result["prompt_tokens"]
    # Six calls over one buffer per side hold less than the six copies the old layout kept.
    assert 0 < result["held_mb"] < result["as_copies_mb"]


def test_copies_of_messages_and_conversations_do_not_keep_stale_keys() -> None:
    hello = ChatMessage(role="user", content="hello")
    conv = Conversation(messages=(hello,))
    assert len(conv.prefix_keys()) == 2 and hello.digest  # computed and cached
    bye = hello.model_copy(update={"content": "bye"})
    assert bye.digest == ChatMessage(role="user", content="bye").digest != hello.digest
    longer = conv.model_copy(update={"messages": (hello, bye)})
    assert longer.prefix_keys() == Conversation(messages=(hello, bye)).prefix_keys()
    assert len(longer.prefix_keys()) == 3
    # Surrounding whitespace is not part of a message's identity; a lone surrogate (valid JSON) hashes too.
    assert ChatMessage(role="user", content=" hello\n").digest == hello.digest
    assert ChatMessage(role="user", content="\ud800").digest != hello.digest


class _CountingCodec(CharCodec):
    """The char codec, counting its renders; with `varying`, a template whose generation prompt depends on the
    conversation (a hint after a tool result), as some templates do."""

    def __init__(self, *, varying: bool = False) -> None:
        super().__init__()
        self.renders = 0
        self.varying = varying

    def render(self, conversation: Conversation, *, add_generation_prompt: bool) -> str:
        self.renders += 1
        text = super().render(conversation, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt and self.varying and conversation.messages[-1].role == "tool":
            text += "(after a tool) "
        return text


def test_after_the_first_call_a_prompt_is_rendered_once_and_a_varying_generation_prompt_stays_exact() -> None:
    for varying in (False, True):
        codec = _CountingCodec(varying=varying)
        state = TitoState()
        conv = Conversation(messages=(ChatMessage(role="user", content="start"),), tools=TOOLS)
        for i in range(4):
            before = codec.renders
            plan = state.plan(conv, codec)
            rendered = codec.renders - before
            # Every prompt is the template's own rendering with its generation prompt, whatever the shortcut.
            assert plan.prompt_text == codec.render(conv, add_generation_prompt=True)
            assert codec.decode(list(plan.prompt)) == codec.decode(codec.encode(plan.prompt_text))
            assert plan.conversation_text == plan.prompt_text[: len(plan.conversation_text)]
            if i > 0 and not varying:
                assert rendered == 1  # the generation prompt learned at the first call
            text = format_tool_call("bash", {"command": f"ls {i}"}, "")
            completion = np.asarray(codec.encode(text) + [codec.end_of_turn_id], dtype=np.int32)
            reply = reply_message(text)
            state.commit(plan, completion=completion, reply=reply, codec=codec)
            conv = Conversation(messages=conv.messages + (reply, ChatMessage(role="tool", content=f"out {i}")),
                                tools=TOOLS)
        assert state.generation_prompt == "<|im_start|>assistant\n"
