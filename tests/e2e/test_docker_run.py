"""A run trains on tasks in their own images: `gyre run --config configs/docker.yaml` (the Docker sandbox backend,
docker-tasks/) completes its step with every execution graded in its task's image, and leaves no container or
network behind. While it runs, every process's /metrics (the run's metrics-targets.json) is scraped and holds
the documented metrics with sane values; its step goes to offline W&B and TensorBoard, read back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prometheus_client.parser import text_string_to_metric_families

from services.harness.docker_sandbox import ROOT_LABEL
from tests.conftest import Infra
from tests.gyre.tracker_files import tensorboard_scalars, wandb_run
from tests.harness.conftest import needs_docker

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200), needs_docker]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")


async def test_a_run_trains_on_tasks_in_their_own_images(store, bus, infra: Infra, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "COLUMNS": "200"}
    log = tmp_path / "gyre-run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "gyre.cli", "run", "--config", "configs/docker.yaml",
             "--set", f"logging.runs_dir={runs}", "--set", "scheduling.steps=1",
             "--set", "tasks.train=kv-service-handshake,repo-regression",
             "--set", "logging.trackers=wandb,tensorboard",
             # Both roles' processes on each cell, one standing by (async keeps none unless asked): every process
             # kind of a cell is scraped.
             "--set", "scheduling.warm=true"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        seen = scrape_until_done(run, runs, deadline=time.monotonic() + 1100)
    assert run.returncode == 0, log.read_text()[-4000:]
    check_metrics(seen)
    # The step went to an offline W&B run and to TensorBoard, with the report's names.
    run_dir = next(runs.iterdir())
    rows, config = wandb_run(run_dir)
    assert [row["_step"] for row in rows] == [0] and "mean_reward" in rows[0] and "loss" in rows[0]
    assert config["harness"]["sandbox"] == "docker"
    assert [step for step, _ in tensorboard_scalars(run_dir)["mean_reward"]] == [0]

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


def scrape_until_done(run: subprocess.Popen[bytes], runs: Path, *, deadline: float) -> dict[str, dict[tuple, float]]:
    """Scrape every target of the run's metrics-targets.json twice a second until the run ends; per service, the
    largest value each sample showed."""
    seen: dict[str, dict[tuple, float]] = {}
    while run.poll() is None:
        assert time.monotonic() < deadline, "the run did not end in time"
        for path in runs.glob("*/metrics-targets.json"):
            for target in json.loads(path.read_text()):
                service = target["labels"]["service"] + target["labels"].get("cell", "")
                try:
                    text = urllib.request.urlopen(f"http://{target['targets'][0]}/metrics", timeout=2).read()
                except OSError:
                    continue  # not up yet, or already stopped
                samples = seen.setdefault(service, {})
                for family in text_string_to_metric_families(text.decode()):
                    for sample in family.samples:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        samples[key] = max(samples.get(key, sample.value), sample.value)
        time.sleep(0.5)
    return seen


def check_metrics(seen: dict[str, dict[tuple, float]]) -> None:
    """What docs/metrics.md says each process shows, with values a one-step run must have reached."""

    def value(service: str, metric: str, **labels: str) -> float:
        return seen[service].get((metric, tuple(sorted(labels.items()))), float("nan"))

    def total(service: str, metric: str) -> float:
        return sum(v for (n, _), v in seen[service].items() if n == metric)

    expected = {"relay", "trajectory", "trainer", "gateway", "harness", "cells", "scheduler", "cell-rollout0",
                "cell-rollout1", "cell-train0", "cell-train1"}
    assert expected <= set(seen), sorted(seen)
    for service in ("relay", "trajectory", "trainer", "gateway", "harness", "cells", "scheduler"):
        assert value(service, "gyre_service_healthy") == 1, service
        assert value(service, "gyre_failed_tasks") == 0, service
    assert value("relay", "gyre_relay_published") >= 10 and value("relay", "gyre_relay_position") >= 10
    assert value("relay", "gyre_relay_behind") >= 0
    assert total("trajectory", "gyre_consumer_pending") >= 0 and ("gyre_consumer_pending" in
                                                                  {n for n, _ in seen["trajectory"]})
    assert value("scheduler", "gyre_queries_dispatched_total") >= 1 and total("scheduler", "gyre_cells") == 2
    assert value("harness", "gyre_executions_started_total") >= 2
    assert total("harness", "gyre_executions_scored_total") >= 2
    assert value("harness", "gyre_execution_reward_count") >= 1
    assert value("gateway", "gyre_gateway_calls_total", api="anthropic") >= 2
    assert value("trajectory", "gyre_batches_total") >= 1 and value("trajectory", "gyre_batch_dedup_factor") >= 1
    assert total("trajectory", "gyre_events_handled_total") >= 10
    assert value("trainer", "gyre_trainer_steps_total") >= 1 and value("trainer", "gyre_trainer_world_size") >= 1
    assert math.isfinite(value("trainer", "gyre_trainer_step_metric", name="loss"))
    assert any(value(f"cell-rollout{i}", "gyre_weights_loaded_total") >= 1 for i in (0, 1))
