"""Choosing a sandbox backend: `make_sandbox` builds one by name, `available_backends` says which process
backends work on this machine. The one module that knows every backend; no backend imports it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.harness.docker_sandbox import DockerSandbox
from services.harness.process_sandbox import ProcessSandbox
from services.harness.sandbox import Sandbox
from services.harness.sandbox_spec import Backend, SandboxSpec, SandboxUnavailableError, TaskEnvironment

BACKEND_NAMES = ("auto", "bwrap", "unshare", "docker")


def make_sandbox(
    state_dir: Path | str,
    spec: SandboxSpec | None = None,
    *,
    backend: str = "auto",
    gateway_url: str | None = None,
    environment: TaskEnvironment | None = None,
) -> Sandbox:
    """Create a sandbox with the named backend; 'auto' takes bubblewrap when present, else unshare. Docker runs
    in `environment` (the task's image and side services); process backends run over the host's system."""
    match backend:
        case "bwrap" | "unshare":
            return ProcessSandbox(state_dir, spec, backend=backend, gateway_url=gateway_url)
        case "auto":
            chosen: Backend = "bwrap" if shutil.which("bwrap") else "unshare"
            return ProcessSandbox(state_dir, spec, backend=chosen, gateway_url=gateway_url)
        case "docker":
            return DockerSandbox(state_dir, spec, environment=environment, gateway_url=gateway_url)
        case other:
            raise ValueError(f"unknown sandbox backend {other!r}: expected auto, bwrap, unshare or docker")


def available_backends() -> list[Backend]:
    """The process-sandbox backends that work here, best first (checked by running `true` in each)."""
    found: list[Backend] = []
    if os.geteuid() != 0:
        return found
    candidates: tuple[Backend, ...] = ("bwrap", "unshare")
    for backend in candidates:
        try:
            probe = ProcessSandbox(Path(f"/tmp/gyre-probe-{os.getpid()}-{backend}"), backend=backend)
        except SandboxUnavailableError:
            continue
        try:
            if probe.exec("true", timeout_s=20).ok:
                found.append(backend)
        finally:
            probe.close(remove=True)
    return found
