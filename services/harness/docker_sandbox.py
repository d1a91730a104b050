"""Docker backend of the sandbox: each command a fresh `docker run --rm` of the task's image over the same state
folder (its working directory, /tmp and home bound in, the image's root read-only), on no network or on the
sandbox's own network that reaches only the task's side services.

The image's working directory seeds the state folder's work/ when the sandbox is new, so a Dockerfile that
prepares a repository hands it to the agent; side services run for the sandbox's life. Used where a Docker
engine answers (deploy/docker-engine.sh starts one); the process sandbox (process_sandbox.py) is the default.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.harness.sandbox import Sandbox
from services.harness.sandbox_argv import docker_run_argv
from services.harness.sandbox_spec import (
    DEFAULT_BASE_IMAGE,
    Bind,
    SandboxError,
    SandboxSpec,
    SandboxUnavailableError,
    TaskEnvironment,
)

DEFAULT_IMAGE = DEFAULT_BASE_IMAGE
# Every container and network carries the folder its sandbox's state lives in (the harness's work folder), so a
# restarted harness finds what its crashed predecessor left running and removes it before it grades.
ROOT_LABEL = "gyre.sandbox-root"
_DOCKER_TIMEOUT_S = 120


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
    """Remove every container (running or not) and network of a sandbox under `root`; returns the containers' ids.

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
        # Then the networks of their side services, which no container holds any more.
        networks = subprocess.run(["docker", "network", "ls", "-q", "--filter", label], capture_output=True,
                                  text=True, timeout=timeout_s)
        if networks.returncode == 0 and networks.stdout.split():
            subprocess.run(["docker", "network", "rm", *networks.stdout.split()], capture_output=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ids


class DockerSandbox(Sandbox):
    """Same layout and API as ProcessSandbox; each command is a fresh container from the environment's image."""

    def __init__(
        self,
        state_dir: Path | str,
        spec: SandboxSpec | None = None,
        *,
        environment: TaskEnvironment | None = None,
        image: str | None = None,
        gateway_url: str | None = None,
    ) -> None:
        self.environment = environment or TaskEnvironment(image=image or DEFAULT_IMAGE)
        self.image = self.environment.image
        self.backend = "docker"
        self._network: str | None = None
        self._services: list[str] = []
        resolved = str(Path(state_dir).resolve())
        self._prefix = "gyre-{}-{}".format(re.sub(r"[^a-zA-Z0-9_.-]", "-", Path(resolved).name)[:48],
                                           hashlib.sha1(resolved.encode()).hexdigest()[:8])
        super().__init__(state_dir, spec, gateway_url=gateway_url)

    def _check_available(self) -> None:
        if not docker_engine_available():
            raise SandboxUnavailableError("no Docker engine on this machine")

    def _container(self, tag: str) -> str:
        return f"{self._prefix}-{tag}"

    def _labels(self) -> dict[str, str]:
        return {ROOT_LABEL: str(self.state_dir.parent)}

    def _create_layout(self) -> None:
        fresh = not (self.state_dir / "work").exists()
        super()._create_layout()
        if fresh and self.image != DEFAULT_IMAGE:
            self._seed_workdir()
        self._start_services()

    def _seed_workdir(self) -> None:
        """Copy what the image holds at the working directory into work/ (a prepared repository, say)."""
        seed = self._container("seed")
        _docker("create", "--name", seed, *_label_args(self._labels()), self.image, "true")
        try:
            # A missing working directory in the image is no error: the agent starts in an empty one.
            subprocess.run(["docker", "cp", f"{seed}:{self.workdir}/.", str(self.work_host)], capture_output=True,
                           timeout=_DOCKER_TIMEOUT_S)
        finally:
            subprocess.run(["docker", "rm", "-f", seed], capture_output=True, timeout=_DOCKER_TIMEOUT_S)
        self.give_to_sandbox()

    def _start_services(self) -> None:
        """The sandbox's network (internal unless the task asked for one) with each side service on it."""
        if not self.environment.services:
            self._network = "bridge" if self.environment.network else None
            return
        self._network = self._container("net")
        internal = [] if self.environment.network else ["--internal"]
        _docker("network", "create", *internal, *_label_args(self._labels()), self._network)
        limits = self.spec.limits
        for service in self.environment.services:
            name = self._container(f"svc-{service.name}")
            args = ["run", "-d", "--name", name, "--network", self._network, "--network-alias", service.name,
                    *_label_args(self._labels()), "--security-opt", "no-new-privileges"]
            if limits.max_processes is not None:
                args += ["--pids-limit", str(limits.max_processes)]
            if limits.memory_bytes is not None:
                args += ["--memory", str(limits.memory_bytes)]
            for key, value in service.environment.items():
                args += ["-e", f"{key}={value}"]
            self._services.append(name)
            _docker(*args, service.image, *service.command)

    def _full_argv(self, argv: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind],
                   tag: str) -> list[str]:
        return docker_run_argv(
            argv, image=self.image, container=self._container(tag), labels=self._labels(), uid=self.uid,
            limits=self.spec.limits, state_dir=self.state_dir, workdir=self.workdir, binds=binds, gateway=gateway,
            env=env, cwd=cwd, network=self._network or "none",
        )

    def _kill(self, pgid: int, exited: threading.Event, tag: str) -> None:
        # Killing the client does not stop the container; the engine does.
        subprocess.run(["docker", "kill", "--signal", "KILL", self._container(tag)], capture_output=True,
                       timeout=_DOCKER_TIMEOUT_S)

    def _sweep(self, tag: str) -> None:
        subprocess.run(["docker", "rm", "-f", self._container(tag)], capture_output=True, timeout=_DOCKER_TIMEOUT_S)

    def close(self, *, remove: bool = False) -> None:
        """Stop the side services and remove the sandbox's network, then close as every sandbox does."""
        if not self._closed:
            if self._services:
                subprocess.run(["docker", "rm", "-f", *self._services], capture_output=True,
                               timeout=_DOCKER_TIMEOUT_S)
                self._services = []
            if self._network is not None and self._network != "bridge":
                subprocess.run(["docker", "network", "rm", self._network], capture_output=True,
                               timeout=_DOCKER_TIMEOUT_S)
            self._network = None
        super().close(remove=remove)


def _label_args(labels: Mapping[str, str]) -> list[str]:
    return [part for key, value in labels.items() for part in ("--label", f"{key}={value}")]


def _docker(*args: str) -> None:
    try:
        done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=_DOCKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"docker {args[0]} did not answer in {_DOCKER_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise SandboxError(f"docker {' '.join(args[:2])} failed: {' '.join(done.stderr.split())[:500]}")
