"""compose.yaml is a valid Compose file, and every Gyre service command in it starts as a local process
and passes its health check against real NATS and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from gyre.local import free_port
from tests.conftest import Infra, unique

REPO = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_compose_file_validates_against_the_compose_specification():
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(REPO / "compose.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_every_service_from_one_image_with_health_checks():
    services = compose()["services"]
    gyre = {name: s for name, s in services.items() if s.get("image") == "gyre:latest" and name != "migrate"}
    assert {"relay", "scheduler", "cells", "gateway", "harness", "trajectory", "trainer"} <= set(gyre)
    for name, service in gyre.items():
        assert service["healthcheck"]["test"], name
        for path in service.get("env_file", []):
            assert (REPO / path).is_file(), f"{name}: missing {path}"
    assert services["migrate"]["command"] == ["migrate"]
    assert services["nats"]["healthcheck"] and services["postgres"]["healthcheck"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_service_command_starts_and_passes_its_health_check(store, bus, infra: Infra, tmp_path: Path):
    from gyre.tinymodel import create_tiny_model

    model = create_tiny_model(tmp_path / "model", seed=0, size="tiny")
    services = {n: s for n, s in compose()["services"].items() if s.get("image") == "gyre:latest" and n != "migrate"}
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for name, service in services.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
            for path in service.get("env_file", []):
                env.update(env_file(REPO / path))
            port = free_port()
            env.update({
                "GYRE_NATS_URL": infra.nats_url,
                "GYRE_DATABASE_URL": infra.database_url,
                "GYRE_DB_SCHEMA": store.schema,
                "GYRE_SUBJECT_PREFIX": bus.prefix,
                "GYRE_RUN_ID": unique("compose-"),
                "GYRE_STATE_DIR": str(tmp_path / "state"),
                "GYRE_MODEL_DIR": str(model),
                "GYRE_HEALTH_PORT": str(port),
                "GYRE_ROLLOUT_HOST": "127.0.0.1",
                "GYRE_ROLLOUT_PORT": str(free_port()),
                "GYRE_HARNESS_WORK_DIR": str(tmp_path / "executions"),
                "GYRE_TRAINER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
                # This test checks that every service of compose.yaml starts healthy and stops cleanly; the run
                # trains nothing (TOTAL_STEPS=0), so the cells hold their roles with the placeholder rather than
                # start a vLLM engine and a torch rank each (tests/e2e trains on real ones).
                "GYRE_CELL_ROLLOUT_COMMAND": "hold",
                "GYRE_CELL_TRAIN_COMMAND": "hold",
                "GYRE_CELL_LOG_DIR": str(tmp_path / "cells"),
                "GYRE_SCHEDULER_TOTAL_STEPS": "0",
                "HF_HUB_OFFLINE": "1",
            })
            log = open(tmp_path / f"{name}.log", "wb")
            argv = [sys.executable, "-m", "gyre.cli", *service["command"]]
            procs[name] = (subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), port)
        healthy: set[str] = set()
        deadline = time.monotonic() + 420
        while healthy != set(procs) and time.monotonic() < deadline:
            for name, (proc, port) in procs.items():
                if name in healthy:
                    continue
                assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                        if response.status == 200:
                            healthy.add(name)
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            time.sleep(1)
        assert healthy == set(procs), f"not healthy: {sorted(set(procs) - healthy)}"
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, (proc, _) in procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    # SIGTERM is a graceful stop for every service.
    assert {name: proc.returncode for name, (proc, _) in procs.items()} == {name: 0 for name in procs}
