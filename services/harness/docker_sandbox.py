"""Docker backend of the sandbox: one `docker run --rm` per command over the same state folder, no network.

Used where a Docker engine answers; the process sandbox (process_sandbox.py) is the default everywhere else.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.harness.sandbox import Sandbox
from services.harness.sandbox_argv import docker_run_argv
from services.harness.sandbox_spec import Bind, SandboxSpec, SandboxUnavailableError

DEFAULT_IMAGE = "python:3.11-slim"
# Every container carries the folder its sandbox's state lives in (the harness's work folder), so a restarted
# harness finds the containers its crashed predecessor left running and removes them before it grades.
ROOT_LABEL = "gyre.sandbox-root"


def docker_engine_available(timeout_s: float = 10.0) -> bool:
    """True when a Docker client is installed and its engine answers."""
    if shutil.which("docker") is None:
        return False
    try:
        probe = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and bool(probe.stdout.strip())


def sweep_orphan_containers(root: Path | str, timeout_s: float = 60.0) -> list[str]:
    """Remove every container of a sandbox under `root` (running or not); returns their ids.

    Killing a harness does not stop the containers of the commands it was running: they go on writing into
    the executions' state folders, which the restarted harness grades, and they keep the names its next
    commands would take. Call it before anything under `root` runs again.
    """
    if shutil.which("docker") is None:
        return []
    label = f"label={ROOT_LABEL}={Path(root).resolve()}"
    try:
        listed = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True,
                                timeout=timeout_s)
        ids = listed.stdout.split() if listed.returncode == 0 else []
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ids


class DockerSandbox(Sandbox):
    """Same layout and API as ProcessSandbox; each command is a fresh container from `image`."""

    def __init__(
        self,
        state_dir: Path | str,
        spec: SandboxSpec | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        gateway_url: str | None = None,
    ) -> None:
        self.image = image
        self.backend = "docker"
        super().__init__(state_dir, spec, gateway_url=gateway_url)

    def _check_available(self) -> None:
        if not docker_engine_available():
            raise SandboxUnavailableError("no Docker engine on this machine")

    def _container(self, tag: str) -> str:
        return f"gyre-{self.state_dir.name}-{tag}".replace("/", "-")[:120]

    def _full_argv(self, argv: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind],
                   tag: str) -> list[str]:
        return docker_run_argv(
            argv, image=self.image, container=self._container(tag),
            labels={ROOT_LABEL: str(self.state_dir.resolve().parent)}, uid=self.uid, limits=self.spec.limits,
            state_dir=self.state_dir, workdir=self.workdir, binds=binds, gateway=gateway, env=env, cwd=cwd,
        )

    def _kill(self, pgid: int, exited: threading.Event, tag: str) -> None:
        # Killing the client does not stop the container; the engine does.
        subprocess.run(["docker", "kill", "--signal", "KILL", self._container(tag)], capture_output=True, timeout=60)

    def _sweep(self, tag: str) -> None:
        subprocess.run(["docker", "rm", "-f", self._container(tag)], capture_output=True, timeout=60)
