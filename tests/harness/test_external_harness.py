"""External harnesses in the sandbox: an anthropic-SDK script and Claude Code reach the gateway via the relay."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from services.harness.execution import run_execution
from services.harness.external import find_claude_code
from services.harness.external_harness import ExternalHarness, GatewayAccess, claude_code
from services.harness.process_sandbox import ProcessSandbox
from services.harness.sandbox_spec import SandboxSpec
from services.harness.tasks import load_task

from .conftest import TASKS
from .scripted_server import ScriptedAnthropicServer, text, tool

TOKEN = "exec-token-for-external"
SDK_AGENT = Path(__file__).with_name("sdk_agent.py")


def sdk_harness(*extra: str) -> ExternalHarness:
    return ExternalHarness(
        name="sdk-script",
        command=("python", str(SDK_AGENT), "{instruction}", *extra),
        ro_paths=(str(SDK_AGENT.parent),),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_sdk_script_in_sandbox_completes_and_is_graded(tmp_path: Path, best_backend: str, stream: bool) -> None:
    task = load_task(TASKS / "create-file-1")
    with ScriptedAnthropicServer([text("hello world")], token=TOKEN) as server:
        result = run_execution(
            execution_id="execution-sdk",
            task=task,
            harness=sdk_harness(*(["--stream"] if stream else [])),
            gateway=GatewayAccess(base_url=server.base_url, token=TOKEN, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.external is not None and result.external.exit_code == 0, result.external
    assert result.stopped.status == "finished"
    assert result.grade.score == 1.0
    assert len(server.requests) == 1
    assert server.headers[0]["authorization"] == f"Bearer {TOKEN}"
    assert server.requests[0]["messages"][0]["content"] == task.instruction
    assert server.requests[0]["model"] == "tiny"


def test_gateway_route_reaches_only_the_gateway(tmp_path: Path, best_backend: str) -> None:
    with ScriptedAnthropicServer([]) as server:
        box = ProcessSandbox(tmp_path / "box", SandboxSpec(), backend=best_backend, gateway_url=server.base_url)  # type: ignore[arg-type]
        try:
            probe = (
                "import os, socket, urllib.request\n"
                "print('relay', urllib.request.urlopen(os.environ['BASE'] + '/docs', timeout=5).status)\n"
                "for port in (%d, 5432):\n"
                "    try:\n"
                "        socket.create_connection(('127.0.0.1', port), timeout=2); print('LEAK', port)\n"
                "    except OSError:\n"
                "        print('BLOCKED', port)\n"
            ) % server.port
            inside = box.gateway_url_inside() or ""
            result = box.exec(["python", "-c", probe], timeout_s=60, env={"BASE": inside}, gateway=True)
            assert result.ok, result.stderr
            assert "relay 200" in result.stdout
            assert result.stdout.count("BLOCKED") == 2 and "LEAK" not in result.stdout
            # Without asking for the gateway, the relay is not there either.
            plain = box.exec(["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 8765), timeout=2)"], timeout_s=60)
            assert plain.exit_code != 0
        finally:
            box.close(remove=True)


def claude_code_dir() -> Path | None:
    candidates: list[Path | str] = [os.environ.get("GYRE_CLAUDE_CODE_DIR", ""), Path(__file__).resolve().parents[2], "/opt/claude-code"]
    return find_claude_code([c for c in candidates if c])


def claude_reply(body: dict[str, Any]) -> dict[str, Any]:
    """Run one Bash command on the main chain's first turn, then finish; anything else gets 'done'."""
    tools = {t.get("name") for t in body.get("tools", [])}
    answered = any(
        isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
        for m in body.get("messages", [])
    )
    if "Bash" in tools and not answered:
        return tool("Bash", {"command": "printf 'hello world\\n' > hello.txt", "description": "write the file"})
    return text("done")


@pytest.mark.skipif(claude_code_dir() is None, reason="Claude Code is not installed (set GYRE_CLAUDE_CODE_DIR to the folder holding node_modules/@anthropic-ai/claude-code)")
@pytest.mark.parametrize("tools", [(), ("Bash",)], ids=["default-tools", "bash-only"])
def test_claude_code_in_sandbox_runs_bash_and_is_graded(tmp_path: Path, best_backend: str, tools: tuple[str, ...]) -> None:
    install = claude_code_dir()
    assert install is not None
    task = load_task(TASKS / "create-file-1")
    with ScriptedAnthropicServer([claude_reply] * 40, token=TOKEN) as server:
        result = run_execution(
            execution_id="execution-claude",
            task=task,
            harness=claude_code(install, "tiny", tools=tools),
            gateway=GatewayAccess(base_url=server.base_url, token=TOKEN, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.external is not None and result.external.exit_code == 0, result.external
    assert any(h.get("authorization") == f"Bearer {TOKEN}" for h in server.headers)
    assert result.grade.score == 1.0
    offered = {t["name"] for request in server.requests for t in request.get("tools", [])}
    assert offered == {"Bash"} if tools else len(offered) > 10


def test_the_claude_code_preset_binds_an_absolute_install_folder_only(tmp_path: Path) -> None:
    """The sandbox shows the install folder at the same path, so a relative one (read against whatever the
    harness's working directory is) is refused by name."""
    preset = claude_code(tmp_path, "tiny")
    assert preset.ro_paths == (str(tmp_path),) and preset.command[0].startswith(str(tmp_path))
    with pytest.raises(ValueError, match="expected an absolute Claude Code install folder"):
        claude_code(Path(".cache/claude-code"), "tiny")
    assert "--tools" not in preset.command
    assert claude_code(tmp_path, "tiny", tools=["Bash", "Read"]).command[-2:] == ("--tools", "Bash,Read")
