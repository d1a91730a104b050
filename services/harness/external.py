"""Running an external harness: its home files written into the sandbox, its command run with the gateway
reachable and the variables both API families' SDKs read. The harness itself is data (external_harness.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from services.harness.external_harness import (
    CLAUDE_CODE_EXE,
    ExternalHarness,
    ExternalOutcome,
    GatewayAccess,
    command_line,
)
from services.harness.sandbox import Sandbox
from services.harness.sandbox_spec import HOME_DIR, SandboxError


def gateway_env(sandbox: Sandbox, gateway: GatewayAccess) -> dict[str, str]:
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
    harness: ExternalHarness, sandbox: Sandbox, gateway: GatewayAccess, instruction: str, *, timeout_s: float
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
    env = {**gateway_env(sandbox, gateway), "GYRE_INSTRUCTION": instruction, **harness.env}
    started = time.monotonic()
    result = sandbox.exec(command_line(harness, instruction), timeout_s=timeout_s, env=env, gateway=True)
    return ExternalOutcome(
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        elapsed_s=time.monotonic() - started,
        stdout_tail=result.stdout[-8000:],
        stderr_tail=result.stderr[-8000:],
    )


def find_claude_code(search: list[Path | str]) -> Path | None:
    """The first folder of `search` that holds an installed Claude Code binary, as an absolute path."""
    for folder in search:
        if (Path(folder) / CLAUDE_CODE_EXE).is_file():
            return Path(folder).resolve()
    return None
