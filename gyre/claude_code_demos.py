"""The warm start in Claude Code's own format: demonstrations of the learnable shell-task family built on Claude
Code's recorded requests (its system prompt and tool definitions as the CLI sends them, never retyped) and
rendered exactly as the gateway renders Claude Code's requests: parsed by the gateway's Anthropic adapter, then
handed to the chat template with their tools. The model learns to answer with a `Bash` tool call that Claude
Code runs, then to end its turn.

Every demonstration shares the same long prefix (~30,000 tokens with Claude Code's default 24 tools, ~3,500 with
Bash alone); SFT's tree packing trains it once per step.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.harness.claude_code_request import load_recording, put_instruction, recording_for
from services.harness.demos import DemoInstance, sample_instances, shipped_params
from services.rollout.anthropic_api import parse_request

BASH_DESCRIPTION = "Run the command"
FINAL_TEXT = "Done."


def demo_request(instance: DemoInstance, recording: dict[str, Any]) -> dict[str, Any]:
    """The Messages request Claude Code would send with the demonstrated turns: its first request, then (unless
    the demonstrator skipped the work) its Bash call and the result Claude Code reports, then the final text."""
    body: dict[str, Any] = copy.deepcopy(recording["request" if instance.command is None else "after_bash"])
    if instance.command is not None:
        for message in body["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part.get("type") == "tool_use" and part.get("name") == "Bash":
                    part["input"] = {"command": instance.command, "description": BASH_DESCRIPTION}
    put_instruction(body, recording, instance.instruction)
    body["messages"].append({"role": "assistant", "content": [{"type": "text", "text": FINAL_TEXT}]})
    return body


def demo_record(instance: DemoInstance, recording: dict[str, Any]) -> dict[str, Any]:
    """One JSONL record for `gyre train sft`: the messages and tools as the gateway hands them to the template."""
    conversation = parse_request(demo_request(instance, recording), count_only=True).conversation
    return {
        "messages": [m.template_dict() for m in conversation.messages],
        "tools": [t.template_dict() for t in conversation.tools],
        "demo": {"family": instance.family, "task_id": instance.task_id, "params": instance.params,
                 "slip": instance.slip, "format": "claude-code"},
    }


def write_claude_code_demos(out: Path, *, seed: int, count: int, families: Sequence[str],
                            slip_rate: float = 0.0, tools: Sequence[str] = ()) -> int:
    """Write `count` demonstrations in Claude Code's format to `out` (JSONL), built on its recorded requests with
    `tools` (empty: its default set); the shipped tasks are held out."""
    recording = load_recording(recording_for(tools))
    instances = sample_instances(seed=seed, count=count, families=families,
                                 exclude=list(shipped_params().values()), slip_rate=slip_rate)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as sink:
        for instance in instances:
            sink.write(json.dumps(demo_record(instance, recording), ensure_ascii=False) + "\n")
    return len(instances)


__all__ = ["demo_record", "demo_request", "write_claude_code_demos"]
