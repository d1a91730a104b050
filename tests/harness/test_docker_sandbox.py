"""Docker backend: the same containment checks as the process sandbox, where a Docker engine exists."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from services.harness.docker_sandbox import DockerSandbox, docker_engine_available
from services.harness.sandbox_spec import SandboxLimits, SandboxSpec, SandboxUnavailableError
from services.harness.sandboxes import make_sandbox

needs_docker = pytest.mark.skipif(not docker_engine_available(), reason="no Docker engine on this machine")


@pytest.fixture
def box(tmp_path: Path):  # type: ignore[no-untyped-def]
    sandbox = DockerSandbox(tmp_path / "docker", SandboxSpec(workdir="/app", limits=SandboxLimits(max_processes=64)))
    yield sandbox
    sandbox.close(remove=True)


@needs_docker
def test_workspace_is_writable_and_root_is_not(box: DockerSandbox) -> None:
    result = box.exec("echo hi > /app/out.txt && echo x > /etc/escape", timeout_s=120)
    assert result.exit_code != 0
    assert (box.work_host / "out.txt").read_text() == "hi\n"


@needs_docker
def test_network_is_off(box: DockerSandbox) -> None:
    probe = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('LEAK')\nexcept OSError:\n    print('BLOCKED')\n"
    assert "BLOCKED" in box.exec(["python3", "-c", probe], timeout_s=120).stdout


@needs_docker
def test_timeout_kills_the_container(box: DockerSandbox) -> None:
    result = box.exec("trap '' TERM; sleep 600", timeout_s=5)
    assert result.timed_out


@needs_docker
def test_make_sandbox_names_docker_backend(tmp_path: Path) -> None:
    box = make_sandbox(tmp_path / "d", backend="docker")
    assert isinstance(box, DockerSandbox)
    box.close(remove=True)


def test_unavailable_engine_is_a_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.harness.docker_sandbox.docker_engine_available", lambda: False)
    with pytest.raises(SandboxUnavailableError, match="no Docker engine"):
        DockerSandbox(tmp_path / "x")


def _fake_docker(bin_dir: Path, log: Path, listed: str) -> None:
    """A `docker` client that records its arguments and lists `listed` for `docker ps`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "docker"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nif [ "$1" = ps ]; then printf "{listed}"; fi\n')
    script.chmod(0o755)


def test_containers_carry_their_root_and_a_restart_removes_them(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from services.harness.docker_sandbox import ROOT_LABEL, sweep_orphan_containers

    log = tmp_path / "docker.log"
    _fake_docker(tmp_path / "bin", log, "c0ffee\\nbadd1e\\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr("services.harness.docker_sandbox.docker_engine_available", lambda: True)
    root = tmp_path / "executions"
    box = DockerSandbox(root / "exec-1", SandboxSpec(workdir="/app"))
    argv = box._full_argv(["true"], {}, "/app", False, [], "t1")
    assert argv[argv.index("--label") + 1] == f"{ROOT_LABEL}={root.resolve()}"

    assert sweep_orphan_containers(root) == ["c0ffee", "badd1e"]
    calls = log.read_text().splitlines()
    assert calls[0] == f"ps -aq --filter label={ROOT_LABEL}={root.resolve()}"
    assert calls[1] == "rm -f c0ffee badd1e"


def test_sweeping_with_nothing_left_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.harness.docker_sandbox import sweep_orphan_containers

    log = tmp_path / "docker.log"
    _fake_docker(tmp_path / "bin", log, "")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert sweep_orphan_containers(tmp_path / "executions") == []
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["ps"]


@needs_docker
def test_a_container_left_running_is_found_and_removed(tmp_path: Path) -> None:
    from services.harness.docker_sandbox import sweep_orphan_containers

    box = DockerSandbox(tmp_path / "executions" / "e1", SandboxSpec(workdir="/app"))
    # A command still running when its harness dies: here it is simply not waited for.
    threading.Thread(target=box.exec, args=("sleep 600",), kwargs={"timeout_s": 900}, daemon=True).start()
    deadline = time.monotonic() + 120
    while not subprocess.run(["docker", "ps", "-q", "--filter", "name=gyre-e1"], capture_output=True,
                             text=True).stdout.strip():
        assert time.monotonic() < deadline, "the container never started"
        time.sleep(0.5)
    assert sweep_orphan_containers(tmp_path / "executions")
    assert not subprocess.run(["docker", "ps", "-aq", "--filter", "name=gyre-e1"], capture_output=True,
                              text=True).stdout.strip()
