"""Docker backend: the same containment checks as the process sandbox, where a Docker engine exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.harness.docker_sandbox import DockerSandbox, docker_engine_available
from services.harness.sandbox import SandboxLimits, SandboxSpec, SandboxUnavailableError, make_sandbox

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
