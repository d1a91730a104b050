"""Fixtures for the harness tests: sandbox backends that work here, and a state folder per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.harness.docker_sandbox import docker_engine_available
from services.harness.sandbox import Sandbox
from services.harness.sandbox_spec import DEFAULT_BASE_IMAGE, SandboxSpec
from services.harness.sandboxes import available_backends, make_sandbox

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tasks"
DOCKER_TASKS = REPO / "docker-tasks"
_BACKENDS = available_backends()


def docker_ready() -> bool:
    """An engine answers and holds the base image (`make test` runs deploy/docker-engine.sh for both)."""
    if not docker_engine_available():
        return False
    import subprocess

    return subprocess.run(["docker", "image", "inspect", DEFAULT_BASE_IMAGE], capture_output=True).returncode == 0


DOCKER_READY = docker_ready()
needs_docker = pytest.mark.skipif(
    not DOCKER_READY, reason="no Docker engine with the base image here (deploy/docker-engine.sh makes both, as root)")


def backend_params() -> list[object]:
    """bwrap, unshare and docker: the one sandbox contract, each skipped with its reason where it cannot run."""
    params: list[object] = []
    for name in ("bwrap", "unshare"):
        reason = "the process sandbox runs as root" if os.geteuid() != 0 else f"no working {name} on this machine"
        params.append(pytest.param(name, marks=pytest.mark.skipif(name not in _BACKENDS, reason=reason)))
    params.append(pytest.param("docker", marks=needs_docker))
    return params


@pytest.fixture(params=backend_params())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def best_backend() -> str:
    if not _BACKENDS:
        pytest.skip("no process sandbox backend works on this machine (needs root and bwrap or unshare)")
    return _BACKENDS[0]


@pytest.fixture
def sandbox(tmp_path: Path, backend: str) -> Iterator[Sandbox]:
    box = make_sandbox(tmp_path / "sandbox", SandboxSpec(workdir="/app"), backend=backend)
    yield box
    box.close(remove=True)
