"""Docker backend, beyond the contract suite every backend runs (test_sandbox.py): task images seeding the work,
side services on a network of their own, and what a dead harness leaves behind."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from services.harness.docker_sandbox import ROOT_LABEL, DockerSandbox
from services.harness.sandbox_spec import DEFAULT_BASE_IMAGE, SandboxSpec, SandboxUnavailableError, SideService, TaskEnvironment
from services.harness.sandboxes import make_sandbox
from services.harness.task_images import BaseImageMap, build_image

from .conftest import needs_docker

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
    from services.harness.docker_sandbox import sweep_orphan_containers

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
    assert calls[2] == f"network ls -q --filter label={ROOT_LABEL}={root.resolve()}"


def test_sweeping_with_nothing_left_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.harness.docker_sandbox import sweep_orphan_containers

    log = tmp_path / "docker.log"
    _fake_docker(tmp_path / "bin", log, "")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert sweep_orphan_containers(tmp_path / "executions") == []
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["ps", "network"]


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


def _labelled(kind: str, root: Path) -> list[str]:
    """Ids of the containers (kind 'ps') or networks ('network') a sandbox under root made, running or not."""
    args = ["ps", "-aq"] if kind == "ps" else ["network", "ls", "-q"]
    listed = subprocess.run(["docker", *args, "--filter", f"label={ROOT_LABEL}={root.resolve()}"],
                            capture_output=True, text=True, check=True)
    return listed.stdout.split()


@pytest.fixture
def prepared_image(tmp_path: Path) -> str:
    """An image whose Dockerfile prepares its working directory, as a task's would."""
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /srv/app\n"
                                        "RUN mkdir sub && echo prepared > sub/ready.txt\n")
    return build_image(context, context / "Dockerfile", BaseImageMap(), label="sandbox-test")


@needs_docker
def test_the_images_working_directory_seeds_a_new_sandbox_and_not_a_reopened_one(tmp_path: Path,
                                                                                  prepared_image: str) -> None:
    spec = SandboxSpec(workdir="/srv/app")
    environment = TaskEnvironment(image=prepared_image)
    box = DockerSandbox(tmp_path / "runs" / "e1", spec, environment=environment)
    try:
        assert (box.work_host / "sub" / "ready.txt").read_text() == "prepared\n"
        assert (box.work_host / "sub").stat().st_uid == box.uid, "the seeded work is the sandbox's to change"
        changed = box.exec("echo changed > sub/ready.txt && cat sub/ready.txt", timeout_s=120)
        assert changed.ok and changed.stdout == "changed\n", changed
    finally:
        box.close()
    # Re-opened over the same state folder (grading after a crash): the preserved work stays as the agent left it.
    again = DockerSandbox(tmp_path / "runs" / "e1", spec, environment=environment)
    try:
        assert again.exec("cat sub/ready.txt", timeout_s=120).stdout == "changed\n"
    finally:
        again.close(remove=True)


@needs_docker
def test_side_services_answer_by_name_on_a_network_that_reaches_nothing_else(tmp_path: Path) -> None:
    web = SideService(name="web", image=DEFAULT_BASE_IMAGE,
                      command=("sh", "-c", "echo $GREETING > /srv/index.html && cd /srv && python3 -m http.server 8000"),
                      environment={"GREETING": "hello-from-web"})
    root = tmp_path / "runs"
    box = DockerSandbox(root / "e2", SandboxSpec(workdir="/app"), environment=TaskEnvironment(image=DEFAULT_BASE_IMAGE, services=(web,)))
    probe = (
        "import socket, time, urllib.request\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        print(urllib.request.urlopen('http://web:8000/index.html', timeout=2).read().decode().strip()); break\n"
        "    except OSError:\n"
        "        time.sleep(0.1)\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=3); print('LEAK')\n"
        "except OSError:\n"
        "    print('BLOCKED')\n"
    )
    try:
        assert len(_labelled("ps", root)) == 1 and len(_labelled("network", root)) == 1
        result = box.exec(["python3", "-c", probe], timeout_s=120)
        assert result.stdout.split() == ["hello-from-web", "BLOCKED"], result
    finally:
        box.close(remove=True)
    assert _labelled("ps", root) == [] and _labelled("network", root) == []


@needs_docker
def test_a_dead_harness_s_side_services_and_network_are_swept(tmp_path: Path) -> None:
    from services.harness.docker_sandbox import sweep_orphan_containers

    root = tmp_path / "runs"
    idle = SideService(name="idle", image=DEFAULT_BASE_IMAGE, command=("sleep", "600"))
    box = DockerSandbox(root / "e3", SandboxSpec(workdir="/app"), environment=TaskEnvironment(image=DEFAULT_BASE_IMAGE, services=(idle,)))
    assert _labelled("ps", root) and _labelled("network", root)
    # The harness dies here: nothing closes the sandbox.
    assert sweep_orphan_containers(root)
    assert _labelled("ps", root) == [] and _labelled("network", root) == []
    box.close(remove=True)  # and the next harness's close of nothing is harmless


@needs_docker
def test_a_task_that_asks_for_a_network_gets_one_and_others_get_none(tmp_path: Path) -> None:
    def interfaces(network: bool) -> list[str]:
        box = DockerSandbox(tmp_path / f"net-{network}", SandboxSpec(workdir="/app"),
                            environment=TaskEnvironment(image=DEFAULT_BASE_IMAGE, network=network))
        try:
            return sorted(box.exec("ls /sys/class/net", timeout_s=120).stdout.split())
        finally:
            box.close(remove=True)

    assert interfaces(False) == ["lo"]
    assert "eth0" in interfaces(True)
