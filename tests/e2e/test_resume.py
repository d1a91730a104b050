"""`gyre run --resume`: a run stopped mid-way (every process, as a closed terminal stops it) continues from its
log and checkpoints with its own config and token secret, and no step is lost or trained twice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import Infra

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")

# Stopping takes seconds (each process in turn) and the untrained model's steps are short: steps whose queries
# were dispatched may still complete meanwhile, so the run is long enough to be stopped part-way whatever the load.
STEPS = 5


def _gyre_run(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gyre.cli", "run", *args], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


async def test_a_stopped_run_resumes_from_its_log_and_checkpoints(store, bus, infra: Infra, tmp_path: Path):
    runs = tmp_path / "runs"
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "GYRE_ACK_WAIT_S": "5",
           "COLUMNS": "200"}
    sets = ["--set", f"logging.runs_dir={runs}", "--set", f"scheduling.steps={STEPS}",
            "--set", "tasks.train=uppercase-1,sort-lines-1", "--set", "scheduling.group_size=2"]
    log = tmp_path / "gyre-run.log"
    first = _gyre_run(["--config", "configs/quick.toml", *sets], env, log)
    try:
        deadline = time.monotonic() + 900
        while not (done := [s.event for s in await store.read_all(types=["step.completed"])]):
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step completed in 900 s"
            await asyncio.sleep(1)
        first.send_signal(signal.SIGTERM)  # as a closed terminal or `kill` stops it
        assert first.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    run_id = done[0].run_id
    stopped_at = len([s for s in await store.read_all(run_id=run_id, types=["step.completed"])])
    assert 1 <= stopped_at < STEPS, f"{stopped_at} of {STEPS} steps when stopped: nothing to resume"
    assert f"gyre run --resume {run_id}" in log.read_text()
    assert "Traceback" not in log.read_text()  # the watch stopped cleanly, its store closed

    resumed = _gyre_run(["--resume", run_id, "--set", f"logging.runs_dir={runs}"], env, log)
    try:
        assert resumed.wait(timeout=1200) == 0, log.read_text()[-4000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    assert "(resumed)" in log.read_text()

    events = [s.event for s in await store.read_all(run_id=run_id)]
    completed = [e.data.step for e in events if e.type == "step.completed"]
    assert completed == list(range(STEPS)), completed  # none lost, none repeated
    trained = [q for e in events if e.type == "batch.ready" for q in e.data.query_ids]
    assert len(trained) == len(set(trained)), "a query was trained in two batches"
    scored = Counter(e.data.execution_id for e in events if e.type == "execution.scored")
    assert set(scored.values()) == {1}
    assert (runs / run_id / "report.json").is_file()
    replay = subprocess.run([sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and " NO " not in replay.stdout, replay.stdout[-3000:] + replay.stderr[-2000:]
