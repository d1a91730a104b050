"""The loop survives its services being killed: the trajectory, harness and trainer services are each
SIGKILLed at a point where they hold work in flight and started again, and the run still completes every
step exactly once — checked from the event log alone, then by replaying every batch from it.
"""

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

from gyre.processes import Proc, service_processes, start_all, stop_all
from tests.conftest import Infra, unique
from tests.e2e.helpers import loop_test_environment

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")

GROUP = 2
STEPS = 3


def kill(proc: Proc) -> None:
    assert proc.popen is not None and proc.alive(), f"{proc.name} is not running"
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait()


async def test_killing_trajectory_harness_and_trainer_mid_run_loses_and_repeats_no_step(
    store, bus, infra: Infra, tmp_path: Path
):
    run_id = unique("faults-")
    env = loop_test_environment(store, bus, infra, tmp_path, run_id=run_id, steps=STEPS, group_size=GROUP,
                                task_ids=["uppercase-1", "sort-lines-1"])
    procs = service_processes(sys.executable)
    by_name = {p.name: p for p in procs}
    log_dir = tmp_path / "logs"
    events: list = []

    async def refresh() -> list:
        events[:] = [s.event for s in await store.read_all(run_id=run_id)]
        return events

    async def until(predicate, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(await refresh()):
            dead = [p.name for p in procs if not p.alive()]
            if dead:
                raise AssertionError(f"{', '.join(dead)} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            await asyncio.sleep(0.2)

    def count(type_: str, **match) -> int:
        return sum(1 for e in events if e.type == type_ and all(getattr(e.data, k) == v for k, v in match.items()))

    kills: list[tuple[str, str]] = []

    def crash_and_restart(name: str, moment: str) -> None:
        kill(by_name[name])
        kills.append((name, moment))
        by_name[name].start(env, log_dir)

    try:
        start_all(procs, env, log_dir)
        # Trajectory: executions of step 0 are being scored, its batch is not built yet.
        await until(lambda ev: count("execution.scored") >= 1, "the first scored execution")
        crash_and_restart("trajectory", f"after {count('execution.scored')} scored, batch 0 not built: "
                                        f"{count('batch.ready') == 0}")
        # Harness: executions of a later query are running in its sandboxes.
        await until(lambda ev: any(e.type == "execution.started" and e.data.step >= 1 for e in ev),
                    "an execution of step 1")
        crash_and_restart("harness", f"{count('execution.started') - count('execution.scored')} executions unscored")
        # Trainer: the batch of step 1 is on the bus; kill it before or while it trains that step.
        await until(lambda ev: count("batch.ready", step=1) == 1, "the batch of step 1")
        crash_and_restart("trainer", f"step 1 completed already: {count('step.completed', step=1) == 1}")
        await until(lambda ev: count("step.completed") >= STEPS and count("weights.published") >= STEPS,
                    f"{STEPS} steps and their weights", timeout=900)
    finally:
        stop_all(procs)
    print("kills:", kills)
    await refresh()

    # No step lost or repeated: one batch, one step and one weight version per step, in order.
    completed = [e.data.step for e in events if e.type == "step.completed"]
    assert completed == list(range(STEPS)), completed
    assert sorted(e.data.step for e in events if e.type == "batch.ready") == list(range(STEPS))
    versions = [e.data.version for e in events if e.type == "weights.published"]
    assert len(versions) == len(set(versions)) and sorted(versions)[-1] == STEPS
    # No execution lost or scored twice: every dispatched query ran its G executions, each scored once.
    queries = [e.data.query_id for e in events if e.type == "query.dispatched"]
    started = Counter(e.data.query_id for e in events if e.type == "execution.started")
    assert all(started[q] == GROUP for q in queries), (queries, started)
    scored = Counter(e.data.execution_id for e in events if e.type == "execution.scored")
    assert set(scored.values()) == {1}
    # The executions the harness was running when killed were resumed by its successor, not lost to the crash.
    print("resumed:", [(e.data.execution_id, e.data.replayed_calls) for e in events if e.type == "execution.resumed"])
    assert not [e.data for e in events if e.type == "execution.scored" and e.data.infra_failure
                and "harness stopped" in e.data.infra_failure]
    assert not [e for e in events if e.type == "execution.timed_out" and e.data.budget == "crash"]
    trained_queries = [q for e in events if e.type == "batch.ready" for q in e.data.query_ids]
    assert len(trained_queries) == len(set(trained_queries)), "a query was trained in two batches"

    # The log alone rebuilds every batch with the digests the run emitted, crashes included.
    result = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify"],
        env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " NO " not in result.stdout
