"""The warm start in Claude Code's format: demonstrations built on Claude Code's recorded requests render, for
SFT, to the very tokens the gateway puts in front of the model when Claude Code sends those requests."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gyre.claude_code_demos import FINAL_TEXT, demo_record, demo_request, write_claude_code_demos
from gyre.run_plan import LEARNABLE_FAMILIES
from services.harness.claude_code_request import load_recording, recording_for
from services.harness.demos import make_instance, sample_instances
from services.rollout.anthropic_api import parse_request
from services.rollout.codec import TokenizerCodec
from services.trainer.sft import load_records, render_conversation


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from gyre.tinymodel import create_tiny_model

    return AutoTokenizer.from_pretrained(str(create_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0)))


def test_a_demonstration_is_claude_codes_own_request_with_a_bash_call_and_a_final_text() -> None:
    recording = load_recording()
    instance = make_instance("uppercase", {"text": "red sky"}, "demo-uppercase-0")
    body = demo_request(instance, recording)
    assert body["system"] == recording["after_bash"]["system"] and body["tools"] == recording["after_bash"]["tools"]
    texts = [p.get("text") for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert instance.instruction in texts and recording["instruction"] not in texts
    (bash,) = [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
               if p.get("type") == "tool_use"]
    assert bash["name"] == "Bash" and bash["input"]["command"] == instance.command
    assert body["messages"][-1] == {"role": "assistant", "content": [{"type": "text", "text": FINAL_TEXT}]}
    skipped = demo_request(instance.model_copy(update={"command": None, "slip": "skip"}), recording)
    assert not [p for m in skipped["messages"] if isinstance(m["content"], list) for p in m["content"]
                if p.get("type") == "tool_use"]


@pytest.mark.parametrize(("tools", "shortest"), [((), 20_000), (("Bash",), 3_000)],
                         ids=["default-tools", "bash-only"])
def test_sft_renders_each_demonstrated_turn_after_the_prompt_the_gateway_would_build(tokenizer, tools,
                                                                                      shortest) -> None:
    """For each assistant turn: the SFT ids up to it are the gateway's prompt for the request Claude Code sends
    there (rendered from the same parsed request, with its tools), and the turn's tokens are the targets."""
    recording = load_recording(recording_for(tools))
    codec = TokenizerCodec(tokenizer)
    for instance in sample_instances(seed=1, count=3, families=LEARNABLE_FAMILIES, slip_rate=0.5):
        body = demo_request(instance, recording)
        record = demo_record(instance, recording)
        rendered = render_conversation(tokenizer, record["messages"], record["tools"])
        turns = [i for i, m in enumerate(body["messages"]) if m["role"] == "assistant"]
        for turn in turns:
            request = copy.deepcopy(body)
            request["messages"] = body["messages"][:turn]
            conversation = parse_request(request, count_only=True).conversation
            prompt = codec.encode(codec.render(conversation, add_generation_prompt=True))
            assert rendered.ids[: len(prompt)] == prompt
            assert rendered.target[len(prompt)] and not rendered.target[len(prompt) - 1]
        assert len(prompt) > shortest  # Claude Code's own system prompt and tools, not a summary of them


def test_written_demonstrations_load_with_their_tools(tmp_path: Path, tokenizer) -> None:
    out = tmp_path / "demos.jsonl"
    assert write_claude_code_demos(out, seed=0, count=4, families=LEARNABLE_FAMILIES) == 4
    records = load_records(out)
    assert len(records) == 4 and all(tools and any(t["function"]["name"] == "Bash" for t in tools)
                                     for _, tools in records)
    messages, tools = records[0]
    with_tools = render_conversation(tokenizer, messages, tools)
    assert len(with_tools.ids) > len(render_conversation(tokenizer, messages).ids)
    assert write_claude_code_demos(out, seed=0, count=2, families=LEARNABLE_FAMILIES, tools=["Bash"]) == 2
    assert all([t["function"]["name"] for t in tools] == ["Bash"] for _, tools in load_records(out))
