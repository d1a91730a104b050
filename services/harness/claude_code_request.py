"""Claude Code's requests as it really sends them: recorded from the installed CLI against a local capture
server (its system prompt and tool definitions, never retyped; its first request, and the one after a Bash call
with the call echoed and its result), shipped as a fixture, and read back with a task's instruction in place of
the recorded one. The run plan sizes the model's context from the first; the warm start's demonstrations are
built on the second. One recording per set of tools Claude Code is given (`--tools`): its default set, and any
other a config names (`gyre harness record-claude-code --tools Bash`).
"""

from __future__ import annotations

import copy
import gzip
import http.server
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from services.harness.external_harness import claude_code, command_line

RECORDED = Path(__file__).parent / "fixtures" / "claude_code_first_request.json.gz"  # its default set of tools
RECORDED_INSTRUCTION = "Create a file hello.txt containing hi."


class ClaudeCodeNotRecorded(RuntimeError):
    """The CLI ended without sending a model request the capture server could read."""


class NoRecording(LookupError):
    """No recording was made of Claude Code's requests with this set of tools."""


def recording_path(tools: Sequence[str] = ()) -> Path:
    """Where the recording of Claude Code's requests with `tools` (empty: its default set) is kept."""
    if not tools:
        return RECORDED
    return RECORDED.with_name(f"claude_code_first_request.{'+'.join(sorted(tools))}.json.gz")


def recording_for(tools: Sequence[str] = ()) -> Path:
    """The recording with `tools`; NoRecording, naming the command that makes it, when there is none."""
    path = recording_path(tools)
    if not path.is_file():
        raise NoRecording(f"no recording of Claude Code's requests with tools {','.join(tools)} "
                          f"(make it with `gyre harness record-claude-code --tools {','.join(tools)}`)")
    return path


def installed_version(install_dir: Path) -> str | None:
    """The Claude Code version installed under `install_dir` (its package.json), None when there is none."""
    package = install_dir / "node_modules" / "@anthropic-ai" / "claude-code" / "package.json"
    try:
        return str(json.loads(package.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


RECORDED_COMMAND = "echo hi > hello.txt"  # the Bash call the capture server's first reply makes


def _capture_server(bodies: list[dict[str, Any]]) -> http.server.ThreadingHTTPServer:
    """Answers the first Messages request with a Bash tool call and every later one with a final text reply,
    keeping each request body (a request re-sent after a lost reply counts once)."""

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
                if not bodies or bodies[-1]["messages"] != body["messages"]:
                    bodies.append(body)
            content: list[dict[str, Any]] = [{"type": "text", "text": "Done."}]
            if len(bodies) == 1:
                content = [{"type": "tool_use", "id": "toolu_recorded_0", "name": "Bash",
                            "input": {"command": RECORDED_COMMAND, "description": "Write the file"}}]
            reply = {"id": "msg_recorded", "type": "message", "role": "assistant", "model": body.get("model", ""),
                     "content": content, "stop_reason": "tool_use" if len(bodies) == 1 else "end_turn",
                     "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)


def record_first_request(install_dir: Path, *, tools: Sequence[str] = (), model: str = "gyre-tiny",
                         timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the installed Claude Code (as the harness's preset runs it: the same flags, variables and home files,
    offering `tools`) once against a capture server, and return the recording: its first model request, and the
    request it sent after running the Bash call the server answered with."""
    preset = claude_code(install_dir.resolve(), model, tools=tools)
    bodies: list[dict[str, Any]] = []
    server = _capture_server(bodies)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with tempfile.TemporaryDirectory(prefix="gyre-claude-record-") as scratch:
            home, work = Path(scratch) / "home", Path(scratch) / "app"
            work.mkdir()
            for relative, content in preset.home_files.items():
                (home / relative).parent.mkdir(parents=True, exist_ok=True)
                (home / relative).write_text(content)
            base = f"http://127.0.0.1:{server.server_address[1]}"
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "ANTHROPIC_BASE_URL": base,
                   "ANTHROPIC_AUTH_TOKEN": "recording", **preset.env}
            done = subprocess.run(command_line(preset, RECORDED_INSTRUCTION), cwd=work, env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
    finally:
        server.shutdown()
        server.server_close()
    if len(bodies) < 2:
        raise ClaudeCodeNotRecorded(f"Claude Code exited {done.returncode} after {len(bodies)} model requests, "
                                    f"expected 2: {(done.stderr or done.stdout).strip()[-300:]}")
    return {"version": installed_version(install_dir), "tools": list(tools), "instruction": RECORDED_INSTRUCTION,
            "command": RECORDED_COMMAND, "request": bodies[0], "after_bash": bodies[1]}


def save_recording(recording: dict[str, Any], path: Path = RECORDED) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0: the same recording gives the same bytes.
    path.write_bytes(gzip.compress(json.dumps(recording, indent=1).encode(), mtime=0))


def load_recording(path: Path = RECORDED) -> dict[str, Any]:
    """The shipped recording: version, instruction, command, `request` (the first) and `after_bash`."""
    return dict(json.loads(gzip.decompress(path.read_bytes())))


def recorded_first_request(instruction: str | None = None, path: Path = RECORDED) -> tuple[str, dict[str, Any]]:
    """(the Claude Code version it was recorded from, its first request body), with `instruction` in place of
    the recorded task text when given."""
    recording = load_recording(path)
    body = copy.deepcopy(recording["request"])
    if instruction is not None:
        put_instruction(body, recording, instruction)
    return str(recording["version"]), body


def put_instruction(body: dict[str, Any], recording: dict[str, Any], instruction: str) -> None:
    """Replace, in a copy of one of the recording's requests, the recorded task text with `instruction`."""
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == "text" and part.get("text") == recording["instruction"]:
                part["text"] = instruction


__all__ = ["RECORDED", "ClaudeCodeNotRecorded", "NoRecording", "installed_version", "load_recording",
           "put_instruction", "record_first_request", "recorded_first_request", "recording_for", "recording_path",
           "save_recording"]
