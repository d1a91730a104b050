"""`docker compose up` for real: compose.yaml with compose.local.yaml (every image built here) trains a short run to
a written report, and a `down` then `up` in the middle of the run resumes it: every step completes once, no
execution is scored twice, and the run's model and token secret are the ones `prepare` made the first time.

Everything runs in containers and a network this test's compose project creates; `down -v` removes them and the
volumes at the end. The images stay (deploy/build-images.sh rebuilds only what changed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.harness.conftest import needs_docker

REPO = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
STEPS = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400), needs_docker]


class Project:
    """One compose project of this test: its own name, so its containers, network and volumes are its own."""

    def __init__(self, tmp: Path) -> None:
        self.name = f"gyre-test-{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, "GYRE_DEPLOY_SET": f"scheduling.steps={STEPS}",
                    "GYRE_GATEWAY_PORT": "127.0.0.1:0"}  # the gateway's published port: loopback, any free one
        self.tmp = tmp

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [COMPOSE, "-f", "compose.yaml", "-f", "compose.local.yaml", "-p", self.name, *args]
        result = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}\n"
                                 f"{self.logs()}")
        return result

    def sql(self, query: str) -> str:
        return self("exec", "-T", "postgres", "psql", "-U", "postgres", "-d", "gyre", "-tAc", query).stdout.strip()

    def step_events(self) -> list[int]:
        out = self.sql("select data->>'step' from events where type = 'step.completed' order by position")
        return [int(line) for line in out.splitlines() if line.strip()]

    def logs(self) -> str:
        result = subprocess.run([COMPOSE, "-f", "compose.yaml", "-f", "compose.local.yaml", "-p", self.name, "logs",
                                 "--no-color", "--tail", "40"], cwd=REPO, env=self.env, capture_output=True,
                                text=True, timeout=120)
        return result.stdout[-12000:]

    def wait_for(self, what: str, ready: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            time.sleep(5)
        raise AssertionError(f"{what} within {timeout:.0f} s:\n{self.logs()}")


@pytest.fixture(scope="module")
def images() -> None:
    """The images, built here or by `make docker` in the background (the script waits for that build's lock and
    then finds every layer cached)."""
    result = subprocess.run([str(REPO / "deploy" / "build-images.sh")], cwd=REPO, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_up_trains_a_run_to_its_report_and_resumes_it_after_down_and_up(images: None, tmp_path: Path) -> None:
    project = Project(tmp_path)
    try:
        project("up", "-d", "--no-build", timeout=900)
        # The first step done: the run is under way when it is taken down.
        project.wait_for("a first step", lambda: len(project.step_events()) >= 1, timeout=900)
        prepared = project("exec", "-T", "scheduler", "cat", "/var/lib/gyre/runs/compose/run.env").stdout
        project("down", timeout=300)  # volumes kept: the log, the checkpoints, the run's settings

        project("up", "-d", "--no-build", timeout=900)
        report_box = project("ps", "-a", "-q", "report").stdout.strip()
        code = subprocess.run(["docker", "wait", report_box], capture_output=True, text=True, timeout=1200)
        assert code.stdout.strip() == "0", f"report exited {code.stdout.strip()}:\n{project.logs()}"

        # The second `up` resumed the run prepare made first: same settings (model, tasks, token secret).
        assert "is prepared" in project("logs", "--no-color", "prepare").stdout
        again = project("exec", "-T", "scheduler", "cat", "/var/lib/gyre/runs/compose/run.env").stdout
        assert again == prepared
        # Every step completed once, in order, across the two `up`s; no execution scored twice.
        assert project.step_events() == list(range(STEPS))
        scored = project.sql("select data->>'execution_id' from events where type = 'execution.scored'").split()
        assert scored and not [e for e, n in Counter(scored).items() if n > 1]
        # Only cells trained: every step's trainer group ran on the cells' ranks.
        subprocess.run(["docker", "cp", f"{report_box}:/var/lib/gyre/runs/compose/report.json", str(tmp_path)],
                       check=True, timeout=60)
        report = json.loads((tmp_path / "report.json").read_text())
        assert [row["step"] for row in report["steps"]] == list(range(STEPS))
        assert all(row["world_size"] and row["world_size"] >= 1 for row in report["steps"])
        assert report["executions"] >= STEPS
    finally:
        project("down", "-v", "--remove-orphans", timeout=300, check=False)
