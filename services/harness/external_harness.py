"""External harnesses as data: any command run in the sandbox with the gateway's address and the execution's
token, what it ended with, and the ready preset for Claude Code (config home, model-name variables, headless
flags). Pure: no I/O; external.py runs them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.harness.sandbox_spec import SandboxLimits

INSTRUCTION_PLACEHOLDER = "{instruction}"
CLAUDE_CODE_EXE = Path("node_modules/@anthropic-ai/claude-code/bin/claude.exe")


class GatewayAccess(BaseModel):
    """How an execution reaches the model: the gateway's host URL, its own token, the served model's name."""

    model_config = ConfigDict(frozen=True)

    base_url: str
    token: str = Field(repr=False)
    model: str


class ExternalHarness(BaseModel):
    """A command line (with `{instruction}` standing for the task text as one argument) and its setup."""

    model_config = ConfigDict(frozen=True)

    name: str
    command: tuple[str, ...]
    env: Mapping[str, str] = Field(default_factory=dict)
    # Host paths the command needs to see (read-only), e.g. its install folder.
    ro_paths: tuple[str, ...] = ()
    # Files written under the sandbox's HOME before the run (relative path -> text).
    home_files: Mapping[str, str] = Field(default_factory=dict)
    # Overrides the task's sandbox limits, e.g. for runtimes that need many threads.
    limits: SandboxLimits | None = None


class ExternalOutcome(BaseModel):
    """How an external harness's command ended (it cannot say why: see outcomes.external_stopped)."""

    model_config = ConfigDict(frozen=True)

    exit_code: int | None
    timed_out: bool
    elapsed_s: float
    stdout_tail: str
    stderr_tail: str


def command_line(harness: ExternalHarness, instruction: str) -> list[str]:
    """The harness's command with the task text in place of every `{instruction}`."""
    return [part.replace(INSTRUCTION_PLACEHOLDER, instruction) for part in harness.command]


def claude_code(install_dir: Path, model: str, *, tools: Sequence[str] = (),
                extra_args: tuple[str, ...] = ()) -> ExternalHarness:
    """Claude Code, headless, against the gateway: install_dir (absolute, since the sandbox binds it at the same
    path) holds node_modules/@anthropic-ai/claude-code. `tools` names the built-in tools it offers the model
    (its `--tools`); empty, its default set."""
    if not install_dir.is_absolute():
        raise ValueError(f"expected an absolute Claude Code install folder, got {str(install_dir)!r}")
    exe = install_dir / CLAUDE_CODE_EXE
    models = {
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
    }
    return ExternalHarness(
        name="claude-code",
        command=(
            str(exe),
            "-p",
            INSTRUCTION_PLACEHOLDER,
            "--permission-mode",
            "bypassPermissions",
            "--output-format",
            "json",
            *(("--tools", ",".join(tools)) if tools else ()),
            *extra_args,
        ),
        env={
            **models,
            # No telemetry, update checks or other calls beyond the gateway: the sandbox has no network anyway.
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1",
        },
        ro_paths=(str(install_dir),),
        home_files={
            ".claude.json": json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}),
            ".claude/settings.json": "{}",
        },
        # Its runtime starts many threads (RLIMIT_NPROC counts threads) and reserves large heaps.
        limits=SandboxLimits(max_processes=2048, memory_bytes=16 * 1024**3),
    )
