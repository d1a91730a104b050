"""Demonstrations for the warm-start: fresh instances, commands that solve them, and token identity with
what the gateway renders for the same conversation at RL time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.harness import demos
from services.harness.agent_core import SYSTEM_PROMPT, TOOL_SCHEMAS
from services.harness.task_files import write_task
from services.harness.tasks import load_task


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from gyre.tinymodel import create_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny")
    create_tiny_model(model_dir, seed=0)
    return AutoTokenizer.from_pretrained(str(model_dir))


def test_sampling_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    a = demos.sample_instances(seed=3, count=40)
    b = demos.sample_instances(seed=3, count=40)
    c = demos.sample_instances(seed=4, count=40)
    assert a == b
    assert [i.params for i in a] != [i.params for i in c]


def test_fresh_instances_cover_every_family_and_vary_their_parameters() -> None:
    instances = demos.sample_instances(seed=0, count=300)
    assert {i.family for i in instances} == set(demos.FAMILIES)
    create = [json.dumps(i.params, sort_keys=True) for i in instances if i.family == "create-file"]
    assert len(set(create)) > 0.8 * len(create)


def test_shipped_task_parameters_are_held_out() -> None:
    shipped = demos.shipped_params()
    # Draw only from create-file with a huge count so a collision would be likely if exclusion did not work.
    instances = demos.sample_instances(seed=1, count=3000, families=["create-file"], exclude=shipped.values())
    drawn = {json.dumps(i.params, sort_keys=True) for i in instances}
    assert not drawn & {json.dumps(p, sort_keys=True) for p in shipped.values()}


def test_instance_instruction_is_the_one_taskgen_writes() -> None:
    instance = demos.make_instance("create-file", {"name": "memo.md", "text": "blue sky"}, "t")
    assert instance.instruction == "Create a file named memo.md in /app containing exactly this text: blue sky"
    assert instance.command == "echo blue sky > memo.md"


def test_text_that_echo_would_change_is_quoted() -> None:
    assert demos.demo_command("create-file", {"name": "a.txt", "text": "two  spaces"}) == "echo 'two  spaces' > a.txt"
    assert demos.demo_command("create-file", {"name": "a.txt", "text": "$HOME"}) == "echo '$HOME' > a.txt"


def test_unknown_family_is_refused_with_the_known_ones() -> None:
    with pytest.raises(demos.DemoError, match="create-file"):
        demos.sample_instances(seed=0, count=1, families=["bake-cake"])


@given(seed=st.integers(min_value=0, max_value=2**31), count=st.integers(min_value=0, max_value=30))
@settings(deadline=None)
def test_records_are_well_formed_sft_conversations(seed: int, count: int) -> None:
    records = demos.demo_records(demos.sample_instances(seed=seed, count=count), "SYSTEM")
    assert len(records) == count
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        shell, submit = record["messages"][2]["tool_calls"][0], record["messages"][4]["tool_calls"][0]
        assert shell["function"]["name"] == "shell" and shell["function"]["arguments"]["command"]
        assert submit["function"]["name"] == "submit"


def test_written_jsonl_loads_with_the_sft_loader(tmp_path: Path) -> None:
    from services.trainer.sft import load_conversations

    out = tmp_path / "demos.jsonl"
    assert demos.write_demos(out, seed=0, count=25) == 25
    conversations = load_conversations(out)
    assert len(conversations) == 25
    assert conversations[0][0]["content"] == demos.tools_system_text()


@pytest.mark.parametrize("family", demos.FAMILIES)
def test_demonstrated_command_solves_a_fresh_instance_in_the_sandbox(family: str, tmp_path: Path) -> None:
    from services.harness.sandboxes import make_sandbox
    from services.harness.taskrun import prepare, run_tests, sandbox_spec_for

    instance = demos.sample_instances(seed=7, count=1, families=[family])[0]
    task = load_task(write_task(tmp_path / instance.task_id, instance.files()))
    sandbox = make_sandbox(tmp_path / "state", sandbox_spec_for(task))
    try:
        prepare(task, sandbox)
        result = sandbox.exec(instance.command, timeout_s=30)
        # The demonstration shows the tool result the agent would really get.
        assert demos.shell_result(result.stdout, result.exit_code or 0) == demos.shell_result()
        assert result.ok
        graded, _ = run_tests(task, sandbox)
    finally:
        sandbox.close()
    assert graded.score == 1.0, graded


def test_slip_rate_makes_that_share_of_slips_split_between_the_kinds() -> None:
    instances = demos.sample_instances(seed=3, count=600, families=demos.FAMILIES, slip_rate=0.6)
    kinds = [i.slip for i in instances]
    share = sum(k is not None for k in kinds) / len(kinds)
    assert 0.5 < share < 0.7
    assert {"skip", "wrong-command"} <= set(kinds)
    assert all((i.command is None) == (i.slip == "skip") for i in instances)
    skipped = next(i for i in instances if i.slip == "skip")
    roles = [m["role"] for m in demos.demo_messages(skipped, "sys")]
    assert roles == ["system", "user", "assistant"]
    assert demos.demo_messages(skipped, "sys")[-1]["tool_calls"][0]["function"]["name"] == "submit"
    # No slips asked for: the stream of instances is the one a slip-free run draws.
    assert demos.sample_instances(seed=3, count=20) == demos.sample_instances(seed=3, count=20, slip_rate=0.0)


def test_bad_slip_settings_are_refused() -> None:
    with pytest.raises(demos.DemoError, match="slip_rate"):
        demos.sample_instances(seed=0, count=1, slip_rate=1.5)
    with pytest.raises(demos.DemoError, match="slip"):
        demos.make_instance("uppercase", {"text": "a b"}, "t", "typo")


@pytest.mark.parametrize("family", demos.FAMILIES)
def test_slips_earn_less_than_full_credit_in_the_sandbox(family: str, tmp_path: Path) -> None:
    """A wrong command runs cleanly (the demo's `[exit code 0]` is true) and is graded below 1; a skip too."""
    from services.harness.sandboxes import make_sandbox
    from services.harness.taskrun import prepare, run_tests, sandbox_spec_for

    base = demos.sample_instances(seed=5, count=1, families=[family])[0]
    scores = {}
    for slip in demos.SLIPS:
        instance = demos.make_instance(family, base.params, base.task_id, slip)
        task = load_task(write_task(tmp_path / slip / instance.task_id, instance.files()))
        sandbox = make_sandbox(tmp_path / "state" / slip, sandbox_spec_for(task))
        try:
            prepare(task, sandbox)
            if instance.command is not None:
                result = sandbox.exec(instance.command, timeout_s=30)
                assert demos.shell_result(result.stdout, result.exit_code or 0) == demos.shell_result()
            graded, _ = run_tests(task, sandbox)
        finally:
            sandbox.close()
        scores[slip] = graded.score
    assert scores["skip"] < 1.0
    assert 0.0 < scores["wrong-command"] < 1.0, scores


# --- token identity with the gateway (the warm-start must see the tokens RL will) --------------------------


def test_system_text_renders_like_the_template_with_tools(tokenizer: Any) -> None:
    tools = [demos.tool_function(name) for name in demos.AGENT_TOOLS]
    with_tools = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}], tools=tools, tokenize=False
    )
    inline = tokenizer.apply_chat_template([{"role": "system", "content": demos.tools_system_text()}], tokenize=False)
    assert inline == with_tools


def _gateway_tokens(tokenizer: Any, instance: demos.DemoInstance) -> tuple[list[int], list[bool]]:
    """Replay the agent's two calls through the gateway's Anthropic adapter and token-in/token-out, with the
    model 'generating' exactly the demonstrated replies; returns the trajectory's ids and which are generated."""
    from services.rollout.anthropic_api import parse_request
    from services.rollout.codec import TokenizerCodec, reply_message
    from services.rollout.tito import TitoState

    codec = TokenizerCodec(tokenizer)
    state = TitoState()
    turns = demos.anthropic_turns(instance)
    tools = [TOOL_SCHEMAS[name] for name in demos.AGENT_TOOLS]
    ids: list[int] = []
    generated: list[bool] = []
    calls = ((1, 1), (3, 3)) if len(turns) == 4 else ((1, 1),)
    for n_messages, reply_index in calls:
        body = {"model": "m", "max_tokens": 64, "system": SYSTEM_PROMPT, "tools": tools, "messages": turns[:n_messages]}
        plan = state.plan(parse_request(body).conversation, codec)
        assert list(plan.prompt[: len(ids)]) == ids, "the second call must extend the first call's tokens"
        # What the model emits for the demonstrated reply: the template's text of that turn up to end of turn.
        reply_conv = parse_request(body | {"messages": turns[: reply_index + 1]}).conversation
        reply_text = codec.render(reply_conv, add_generation_prompt=False)[len(plan.prompt_text) :]
        reply_text = reply_text[: reply_text.index(codec.end_of_turn) + len(codec.end_of_turn)]
        completion = np.asarray(codec.encode(reply_text), dtype=np.int32)
        reply = reply_message(codec.decode(list(completion)))
        assert reply == reply_conv.messages[-1]
        state.commit(plan, completion=completion, reply=reply, codec=codec)
        generated += [False] * (len(plan.prompt) - len(ids)) + [True] * len(completion)
        ids = [*plan.prompt.tolist(), *completion.tolist()]
    return ids, generated


@pytest.mark.parametrize("family", demos.FAMILIES)
def test_sft_rendering_equals_the_gateway_tokens_at_rl_time(tokenizer: Any, family: str) -> None:
    from services.trainer.sft import render_conversation

    system_text = demos.tools_system_text()
    # Both slips too: a skip is a one-call conversation, a wrong command the same shape as a good one.
    instances = demos.sample_instances(seed=11, count=3, families=[family]) + [
        demos.make_instance(family, i.params, i.task_id, slip)
        for i in demos.sample_instances(seed=12, count=1, families=[family])
        for slip in demos.SLIPS
    ]
    for instance in instances:
        sft = render_conversation(tokenizer, demos.demo_messages(instance, system_text))
        rl_ids, rl_generated = _gateway_tokens(tokenizer, instance)
        # The SFT rendering ends with the template's newline after the last end of turn; RL stops at the EOS.
        assert sft.ids[: len(rl_ids)] == rl_ids
        assert sft.ids[len(rl_ids) :] == tokenizer.encode("\n", add_special_tokens=False)
        assert sft.target[: len(rl_ids)] == rl_generated
