"""Claude Code's first request: recorded from the real CLI (never retyped), shipped as a fixture of the pinned
version, and read back with a task's instruction in place of the recorded one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from services.harness.claude_code_request import (
    RECORDED,
    RECORDED_INSTRUCTION,
    NoRecording,
    load_recording,
    record_first_request,
    recorded_first_request,
    recording_for,
    recording_path,
)
from tests.harness.test_external_harness import claude_code_dir


def _tool_names(body: dict) -> list[str]:
    return [t["name"] for t in body["tools"]]


def test_the_fixture_is_the_pinned_versions_first_request() -> None:
    version, body = recorded_first_request()
    pinned = re.search(r"^CLAUDE_CODE_VERSION := (\S+)$", Path("Makefile").read_text(), re.M)
    assert pinned and version == pinned.group(1)
    configs = Path("configs").glob("claude-code*.yaml")
    assert {yaml.safe_load(c.read_text())["harness"]["claude_code_version"] for c in configs} == {version}
    assert {"Bash", "Edit", "Write", "Read", "Agent"} <= set(_tool_names(body))
    assert any(f"cc_version={version}" in block["text"] for block in body["system"])
    # The request after its Bash call: the call echoed as the capture server made it, and its result.
    after = load_recording()["after_bash"]
    parts = [p for m in after["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert [p["type"] for p in parts if p["type"] in ("tool_use", "tool_result")] == ["tool_use", "tool_result"]
    assert after["tools"] == body["tools"]


def test_the_bash_only_recording_is_the_same_claude_code_offering_bash_alone() -> None:
    """`--tools Bash` (configs/claude-code.yaml): the same system prompt blocks and Bash definition as the
    default set's, without the other 23 tools and the agent and skill listings that go with them."""
    assert recording_path() == RECORDED and recording_for(["Bash"]) == recording_path(["Bash"])
    version, body = recorded_first_request(path=recording_for(["Bash"]))
    pinned, default = recorded_first_request()
    assert version == pinned
    assert _tool_names(body) == ["Bash"]
    assert body["tools"][0] == next(t for t in default["tools"] if t["name"] == "Bash")
    assert [b["text"] for b in body["system"][:2]] == [b["text"] for b in default["system"][:2]]
    after = load_recording(recording_for(["Bash"]))["after_bash"]
    parts = [p for m in after["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert [p["type"] for p in parts if p["type"] in ("tool_use", "tool_result")] == ["tool_use", "tool_result"]
    assert len(json.dumps(body)) * 5 < len(json.dumps(default))


def test_a_tool_set_never_recorded_is_named_with_the_command_that_records_it() -> None:
    assert recording_path(["Read", "Bash"]) == recording_path(["Bash", "Read"])
    with pytest.raises(NoRecording, match=r"record-claude-code --tools Read,Bash"):
        recording_for(["Read", "Bash"])


def test_a_tasks_instruction_takes_the_recorded_ones_place() -> None:
    _, recorded = recorded_first_request()
    _, body = recorded_first_request("Count the lines of notes.txt.")
    texts = [p["text"] for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p.get("type") == "text"]
    assert "Count the lines of notes.txt." in texts and RECORDED_INSTRUCTION not in texts
    assert body["tools"] == recorded["tools"] and body["system"] == recorded["system"]


@pytest.mark.skipif(claude_code_dir() is None, reason=(
    "Claude Code is not installed: `make test` fetches the pinned CLI from the npm registry (make claude-code), "
    "which did not provide it on this machine"))
@pytest.mark.parametrize("tools", [(), ("Bash",)], ids=["default-tools", "bash-only"])
def test_recording_the_installed_cli_again_gives_the_shipped_prompt_and_tools(tools: tuple[str, ...]) -> None:
    install = claude_code_dir()
    assert install is not None
    recording = record_first_request(install, tools=tools)
    version, shipped = recorded_first_request(path=recording_for(tools))
    assert recording["version"] == version
    fresh = recording["request"]
    assert _tool_names(fresh) == _tool_names(shipped)
    assert [t["input_schema"] for t in fresh["tools"]] == [t["input_schema"] for t in shipped["tools"]]
    # The system prompt's text is Claude Code's own; only the environment it describes (folder, date) differs.
    assert len(fresh["system"]) == len(shipped["system"])
    assert [m["role"] for m in recording["after_bash"]["messages"]] == [
        m["role"] for m in load_recording(recording_for(tools))["after_bash"]["messages"]]
