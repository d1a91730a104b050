"""A run trains on tasks in their own images: `gyre run --config configs/docker.yaml` (the Docker sandbox backend,
docker-tasks/) completes its step with every execution graded in its task's image, and leaves no container or
network behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.harness.docker_sandbox import ROOT_LABEL
from tests.conftest import Infra
from tests.harness.conftest import needs_docker

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200), needs_docker]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")


async def test_a_run_trains_on_tasks_in_their_own_images(store, bus, infra: Infra, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "COLUMNS": "200"}
    log = tmp_path / "gyre-run.log"
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "gyre.cli", "run", "--config", "configs/docker.yaml",
             "--set", f"logging.runs_dir={runs}", "--set", "scheduling.steps=1",
             "--set", "tasks.train=kv-service-handshake,repo-regression"],
            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1100,
        )
    assert done.returncode == 0, log.read_text()[-4000:]

    events = [s.event for s in await store.read_all()]
    assert [e.data.step for e in events if e.type == "step.completed"] == [0]
    started = {e.data.execution_id: e.data.task_id for e in events if e.type == "execution.started"}
    scored = [e.data for e in events if e.type == "execution.scored"]
    assert scored and {s.execution_id for s in scored} <= set(started)
    # Graded, not failed: the image was built, the side service ran, the tests ran in a fresh container.
    assert [s.infra_failure for s in scored] == [None] * len(scored), scored
    assert all(s.tests_total > 0 for s in scored), scored
    for task_id in set(started.values()):
        images = subprocess.run(["docker", "images", "-q", f"gyre-task:{task_id}-*"], capture_output=True,
                                text=True, check=True).stdout.split()
        assert images, f"no image was built for {task_id}"
    run_dir = next(runs.iterdir())
    label = f"label={ROOT_LABEL}={(run_dir / 'executions').resolve()}"
    left = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True, check=True)
    networks = subprocess.run(["docker", "network", "ls", "-q", "--filter", label], capture_output=True, text=True,
                              check=True)
    assert left.stdout.split() == [] and networks.stdout.split() == []
