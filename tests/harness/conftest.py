"""Fixtures for the harness tests: sandbox backends that work here, and a state folder per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.harness.process_sandbox import ProcessSandbox
from services.harness.sandbox_spec import SandboxSpec
from services.harness.sandboxes import available_backends

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tasks"
_BACKENDS = available_backends()


def backend_params() -> list[object]:
    """bwrap and unshare, each skipped with its reason where it does not work on this machine."""
    params: list[object] = []
    for name in ("bwrap", "unshare"):
        reason = "the process sandbox runs as root" if os.geteuid() != 0 else f"no working {name} on this machine"
        params.append(pytest.param(name, marks=pytest.mark.skipif(name not in _BACKENDS, reason=reason)))
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
def sandbox(tmp_path: Path, backend: str) -> Iterator[ProcessSandbox]:
    box = ProcessSandbox(tmp_path / "sandbox", SandboxSpec(workdir="/app"), backend=backend)  # type: ignore[arg-type]
    yield box
    box.close(remove=True)
