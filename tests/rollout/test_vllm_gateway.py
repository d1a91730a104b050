"""The gateway on a real vLLM engine (tiny model) with the real anthropic/openai SDKs: one engine per module."""

from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest
import pytest_asyncio

from gyre.tinymodel import create_tiny_model
from services.rollout.codec import TokenizerCodec
from services.rollout.protocol import SamplingSpec
from shared.calls import CallTokens
from shared.events import ExecutionBranched
from tests.rollout.fakes import build_stack

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]
# The current Messages API has no sampling fields; the gateway still reads `temperature` from the body.
GREEDY = {"temperature": 0.0}

BASH = {
    "name": "bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
MAX_LEN = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory):
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import prepare_cpu_environment

    prepare_cpu_environment(tmp_path_factory.mktemp("vllm"))
    eng = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=MAX_LEN))
    yield eng
    await eng.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(engine, model_dir):
    return build_stack([engine], TokenizerCodec.from_model_dir(model_dir))


def _blob(stack, call) -> CallTokens:
    return CallTokens.decode(stack.recorder.blobs[call.record.digest])


async def test_plain_and_streamed_calls_record_the_engines_tokens_and_logprobs(stack, engine) -> None:
    client = stack.anthropic(stack.token("v-plain"))
    user = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
    msg = await client.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, messages=user)
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    call = stack.recorder.calls("v-plain")[0]
    assert call.completion_tokens == msg.usage.output_tokens > 0
    assert call.prompt_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    tokens = _blob(stack, call)
    # Recorded tokens and logprobs are exactly what the engine gives for that prompt.
    direct = await engine.generate([int(t) for t in tokens.new_prompt], SamplingSpec(max_tokens=24, temperature=0.0),
                                   "direct-1")
    assert direct.token_ids == [int(t) for t in tokens.completion]
    assert np.allclose(direct.logprobs, tokens.logprobs, atol=1e-5)

    streamed = stack.anthropic(stack.token("v-stream"))
    async with streamed.messages.stream(model="tiny", max_tokens=24, extra_body=GREEDY, messages=user) as s:
        kinds = [event.type async for event in s]
        final = await s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == msg.content[0].text  # greedy: the same reply


async def test_the_same_seed_samples_the_same_reply(stack) -> None:
    # Re-samples of one prompt in one execution (one worker session: the module's engine has few slots).
    client = stack.anthropic(stack.token("v-seed"))
    user = [{"role": "user", "content": "Name three colours."}]
    for seed in (42, 42, 43):
        await client.messages.create(model="tiny", max_tokens=24, messages=user,
                                     extra_body={"temperature": 1.0, "seed": seed})
    replies = [[int(t) for t in _blob(stack, call).completion] for call in stack.recorder.calls("v-seed")]
    assert replies[0] == replies[1]
    assert replies[0] != replies[2]  # the seed is what fixed it (a random tiny model samples freely at 1.0)


async def test_twenty_tool_rounds_stay_on_one_path(stack) -> None:
    client = stack.anthropic(stack.token("v-tools"))
    system = [{"type": "text", "text": "You are a shell agent.", "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = [{"role": "user", "content": "Find the failing test."}]
    tool_uses = 0
    for turn in range(20):
        forced = turn % 2 == 0
        msg = await client.messages.create(
            model="tiny", max_tokens=96 if forced else 24, system=system, tools=[BASH], messages=messages,
            tool_choice={"type": "any"} if forced else {"type": "auto"})
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        uses = [b for b in msg.content if b.type == "tool_use"]
        if forced:
            assert msg.stop_reason == "tool_use" and uses and uses[0].name == "bash"
            assert isinstance(uses[0].input["command"], str)
        if uses:
            tool_uses += 1
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"exit 0, turn {turn}"} for u in uses]})
        else:
            messages.append({"role": "user", "content": f"Keep going ({turn})."})
    calls = stack.recorder.calls("v-tools")
    assert tool_uses >= 10
    assert [c.branch_hint for c in calls] == [None] + ["continuation"] * 19
    assert [c.parent_call_index for c in calls] == [None] + list(range(19))
    assert not [e for e in stack.recorder.events
                if isinstance(e.data, ExecutionBranched) and e.data.execution_id == "v-tools"]
    # Only new tokens are stored, and the engine reused its prefix cache for most of each prompt.
    assert sum(c.new_prompt_tokens for c in calls) < sum(c.prompt_tokens for c in calls) / 3


async def test_compaction_style_restart_is_a_compaction(stack) -> None:
    client = stack.anthropic(stack.token("v-compact"))
    first = [{"role": "user", "content": "Build the project."}]
    msg = await client.messages.create(model="tiny", max_tokens=16, messages=first)
    await client.messages.create(model="tiny", max_tokens=16, messages=first + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": "And test it."}])
    await client.messages.create(model="tiny", max_tokens=16, messages=[
        {"role": "user", "content": "Summary of earlier work: built. Now test it."}])
    # The chain's previous call is left in its context by a shorter prompt (shared.branching.classify_branch).
    assert [c.branch_hint for c in stack.recorder.calls("v-compact")] == [None, "continuation", "compaction"]


async def test_openai_client_plain_tools_and_streaming(stack) -> None:
    client = stack.openai(stack.token("v-openai"))
    tools = [{"type": "function", "function": {"name": "bash", "description": "run",
                                               "parameters": BASH["input_schema"]}}]
    messages = [{"role": "user", "content": "List the files."}]
    r = await client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required",
                                             max_tokens=96)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "bash"
    assert "command" in json.loads(call.function.arguments)
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "a.py b.py"}]
    chunks = [c async for c in await client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=16, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[-1].usage.completion_tokens > 0
    assert [c.branch_hint for c in stack.recorder.calls("v-openai")] == [None, "continuation"]


async def test_bad_inputs_raise_sdk_errors_and_record_only_their_refusals(stack) -> None:
    before = len(stack.recorder.calls())
    client = stack.anthropic(stack.token("v-bad"))
    with pytest.raises(anthropic.AuthenticationError):
        await stack.anthropic("wrong").messages.create(model="tiny", max_tokens=8,
                                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        await client.messages.create(model="tiny", max_tokens=8,
                                     messages=[{"role": "user", "content": "word " * 9000}])
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        await client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                     tools=[{"name": "x", "description": "no schema"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        await stack.openai(stack.token("v-bad2")).chat.completions.create(
            model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    assert len(stack.recorder.calls()) == before
    assert [r.status for r in stack.recorder.refusals("v-bad")] == [400, 400]
    assert [r.status for r in stack.recorder.refusals("v-bad2")] == [400]


async def test_weight_reload_changes_outputs_and_policy_version(stack, model_dir) -> None:
    import torch
    from safetensors.torch import load_file

    user = [{"role": "user", "content": "Say something about files."}]
    before = await stack.anthropic(stack.token("v-w0")).messages.create(
        model="tiny", max_tokens=16, extra_body=GREEDY, messages=user)
    state = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    await stack.local.workers["w0"].apply_weights(1, perturbed)
    after = await stack.anthropic(stack.token("v-w1")).messages.create(
        model="tiny", max_tokens=16, extra_body=GREEDY, messages=user)
    assert before.content[0].text != after.content[0].text
    assert stack.recorder.calls("v-w0")[0].policy_version == 0
    assert stack.recorder.calls("v-w1")[0].policy_version == 1
