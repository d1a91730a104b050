"""External harnesses: any command run in the sandbox with the gateway's address and the execution's token.

`claude_code()` is the ready preset for Claude Code (config home, model-name variables, headless flags).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.harness.sandbox import HOME_DIR, ProcessSandbox, SandboxError, SandboxLimits

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
    model_config = ConfigDict(frozen=True)

    exit_code: int | None
    timed_out: bool
    elapsed_s: float
    stdout_tail: str
    stderr_tail: str


def gateway_env(sandbox: ProcessSandbox, gateway: GatewayAccess) -> dict[str, str]:
    """The variables both API families' SDKs read, pointing at the relay inside the sandbox."""
    inside = sandbox.gateway_url_inside()
    if inside is None:
        raise SandboxError("the sandbox was created without a gateway route; pass gateway_url to make_sandbox")
    base = inside.rstrip("/")
    return {
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_AUTH_TOKEN": gateway.token,
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_KEY": gateway.token,
        "GYRE_MODEL": gateway.model,
    }


def run_external(
    harness: ExternalHarness, sandbox: ProcessSandbox, gateway: GatewayAccess, instruction: str, *, timeout_s: float
) -> ExternalOutcome:
    """Write the harness's home files, then run its command inside with the gateway reachable."""
    home = sandbox.host_path(HOME_DIR)
    for relative, content in harness.home_files.items():
        path = sandbox.host_path(f"{HOME_DIR}/{relative}")
        # Written as root into a folder the sandbox owns: refuse any link planted on the way.
        for part in [*reversed(path.relative_to(home).parents), path.relative_to(home)]:
            if (home / part).is_symlink():
                raise SandboxError(f"{home / part}: expected no symbolic link in a harness home file's path")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    sandbox.give_to_sandbox()
    argv = [part.replace(INSTRUCTION_PLACEHOLDER, instruction) for part in harness.command]
    env = {**gateway_env(sandbox, gateway), "GYRE_INSTRUCTION": instruction, **harness.env}
    started = time.monotonic()
    result = sandbox.exec(argv, timeout_s=timeout_s, env=env, gateway=True)
    return ExternalOutcome(
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        elapsed_s=time.monotonic() - started,
        stdout_tail=result.stdout[-8000:],
        stderr_tail=result.stderr[-8000:],
    )


def claude_code(install_dir: Path | str, model: str, *, extra_args: tuple[str, ...] = ()) -> ExternalHarness:
    """Claude Code, headless, against the gateway: install_dir holds node_modules/@anthropic-ai/claude-code."""
    install_dir = Path(install_dir).resolve()
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


def find_claude_code(search: list[Path | str]) -> Path | None:
    """The first folder of `search` that holds an installed Claude Code binary."""
    for folder in search:
        if (Path(folder) / CLAUDE_CODE_EXE).is_file():
            return Path(folder)
    return None
