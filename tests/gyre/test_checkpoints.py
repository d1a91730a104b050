"""Any local Hugging Face checkpoint: models of two families (a Qwen3-style one in bf16, a Llama-style one with its
own chat template, in two tool-call formats: Hermes-style `<tool_call>` blocks and Llama 3.1's own JSON calls),
created here with random weights and saved and loaded through transformers, plan cleanly, render with their own
template at the gateway (token-in/token-out extends their prompts, replies are read in the template's tool-call
format), and train a step; a template whose calls no format reads is refused by the plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gyre.config import RunConfig
from gyre.run_plan import plan_run
from gyre.tinymodel import create_tiny_model

# How each template below writes one assistant tool call.
HERMES_CALL = ("{{- '<tool_call>\\n{\"name\": ' + (c.function.name | tojson) + ', \"arguments\": ' "
               "+ (c.function.arguments | tojson) + '}\\n</tool_call>' -}}")
LLAMA_JSON_CALL = ("{{- '<|python_tag|>{\"name\": ' + (c.function.name | tojson) + ', \"parameters\": ' "
                   "+ (c.function.arguments | tojson) + '}' -}}")  # Llama 3.1's own JSON tool calling
XML_CALL = "{{- '<function=' + c.function.name + '></function>' -}}"  # a format Gyre does not read


def llama_template(call: str) -> str:
    """A Llama-3-style template (header tokens, the system turn first, tools as JSON in it) whose turns end with the
    tokenizer's own end-of-turn token, writing tool calls as `call` does."""
    return (
        "{{- '<|begin_of_text|>' -}}"
        "{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:\\n' -}}"
        "{%- for t in tools %}{{ (t.function if t.function is defined else t) | tojson }}\n{% endfor -%}"
        "{{- '<|im_end|>' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' -}}"
        "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}"
        "{% endif -%}"
        "{%- for c in m.tool_calls or [] -%}" + call + "{%- endfor -%}"
        "{{- '<|im_end|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif -%}"
    )


LLAMA_TEMPLATE = llama_template(HERMES_CALL)  # tool calls as <tool_call> JSON, as Hermes-style fine-tunes write


def _llama_checkpoint(folder: Path, tokenizer_from: Path, template: str = LLAMA_TEMPLATE) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    eos = json.loads((tokenizer_from / "config.json").read_text())["eos_token_id"]
    config_json = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "eos_token_id": eos, "bos_token_id": None}))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    qwen = create_tiny_model(root / "qwen3-bf16", seed=1, dtype="bfloat16")
    return {"qwen3-bf16": qwen, "llama": _llama_checkpoint(root / "llama", qwen),
            "llama-json": _llama_checkpoint(root / "llama-json", qwen, llama_template(LLAMA_JSON_CALL)),
            "xml-calls": _llama_checkpoint(root / "xml-calls", qwen, llama_template(XML_CALL))}


FORMAT = {"qwen3-bf16": "hermes", "llama": "hermes", "llama-json": "llama3_json"}


@pytest.mark.parametrize("family", ["qwen3-bf16", "llama", "llama-json"])
def test_a_checkpoint_plans_with_its_own_template(checkpoints: dict[str, Path], family: str) -> None:
    path = checkpoints[family]
    plan = plan_run(RunConfig.model_validate({"model": {"path": str(path), "max_model_len": 4096},
                                              "warm_start": {"steps": 0}}))
    assert plan.errors == [], plan.errors
    assert ("LlamaForCausalLM" if family.startswith("llama") else "bfloat16") in plan.model
    assert plan.first_prompt_tokens and plan.first_prompt_tokens < 4096
    assert f"tool calls written as {FORMAT[family]}" in plan.model


def test_a_template_whose_calls_no_format_reads_is_refused(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["xml-calls"]
    config = {"model": {"path": str(path), "max_model_len": 4096}, "warm_start": {"steps": 0}}
    plan = plan_run(RunConfig.model_validate(config))
    assert len(plan.errors) == 1 and "<function=gyre_probe>" in plan.errors[0], plan.errors
    assert "set model.tool_call_format" in plan.errors[0]
    given = plan_run(RunConfig.model_validate({**config, "model": {**config["model"], "tool_call_format": "hermes"}}))
    assert given.errors == [] and "tool calls written as hermes" in given.model


@pytest.mark.parametrize("family", ["qwen3-bf16", "llama", "llama-json"])
def test_the_gateway_extends_prompts_with_the_checkpoints_own_template(checkpoints: dict[str, Path],
                                                                       family: str) -> None:
    from services.rollout.codec import TokenizerCodec, reply_message
    from services.rollout.conversation import ChatMessage, Conversation, ToolSpec
    from services.rollout.tito import TitoState
    codec = TokenizerCodec.from_model_dir(checkpoints[family])
    tools = (ToolSpec(name="bash", description="run", parameters={
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),)
    state = TitoState()
    conv = Conversation(messages=(ChatMessage(role="user", content="list the files"),), tools=tools)
    plan = state.plan(conv, codec)
    assert ("<|start_header_id|>" in plan.prompt_text) == family.startswith("llama")
    assert codec.tool_format.name == FORMAT[family]
    generated = codec.tool_format.format("bash", {"command": "ls"})
    completion = np.asarray(codec.encode(generated) + [codec.end_of_turn_id], dtype=np.int32)
    reply = reply_message(generated, codec.tool_format)
    assert reply.tool_calls and reply.tool_calls[0].arguments == {"command": "ls"}
    state.commit(plan, completion=completion, reply=reply, codec=codec)
    nxt = Conversation(messages=(*conv.messages, reply, ChatMessage(role="user", content="a.txt")), tools=tools)
    plan2 = state.plan(nxt, codec)
    assert plan2.reused is not None and plan2.reused.kind == "response"  # the generated ids are kept
    assert np.array_equal(plan2.prompt[: len(plan.prompt) + len(completion)],
                          np.concatenate([plan.prompt, completion]))


@pytest.mark.parametrize("family", ["qwen3-bf16", "llama"])
def test_a_checkpoint_trains_a_step(checkpoints: dict[str, Path], family: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from services.trainer.cli import train_app
    from services.trainer.distributed import free_port

    data = tmp_path / "convs.jsonl"
    tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}}]
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"say {i}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": f"echo {i}"}}}]},
    ], "tools": tools}) for i in range(4)) + "\n")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "sft"
    result = CliRunner().invoke(train_app, ["sft", "--model", str(checkpoints[family]), "--data", str(data),
                                            "--out", str(out), "--epochs", "2", "--conversations-per-step", "4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 2
    AutoModelForCausalLM.from_pretrained(str(out))
