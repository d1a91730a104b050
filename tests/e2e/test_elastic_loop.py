"""A short `gyre run --mode elastic --cells 3` end to end: every service as its own process, three cells each
with a vLLM worker and a trainer rank kept warm, the elastic policy moving cells between rollout and training
while executions run. Every step trains on the ranks of the cells the scheduler gave to training, the trainer's
world size follows them, cells switch both ways warm, the sessions of a cell leaving rollout move and finish,
and `gyre replay --verify` rebuilds every batch from the log with the live run's digests.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.processes import service_processes, start_all, stop_all
from tests.conftest import Infra, unique
from tests.e2e.helpers import loop_test_environment

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")

STEPS = 4
GROUP = 4
CELLS = 3


async def test_an_elastic_run_on_three_cells_moves_cells_both_ways_and_trains_on_their_ranks(
        store, bus, infra: Infra, tmp_path: Path) -> None:
    run_id = unique("elastic-")
    env = loop_test_environment(
        store, bus, infra, tmp_path, run_id=run_id, steps=STEPS, group_size=GROUP, task_ids=["create-file-1"],
        mode="elastic", cells=CELLS,
        # A short run: cells may leave a role after 3 s (gyre run: 10 s), so a few steps see moves both ways.
        extra={"GYRE_SCHEDULER_QUERIES_PER_STEP": "1", "GYRE_SCHEDULER_ELASTIC_MIN_DWELL_S": "3"},
    )
    procs = service_processes(sys.executable)
    try:
        start_all(procs, env, tmp_path / "logs")
        deadline = time.monotonic() + 1200
        while True:
            done = await store.read_all(types=["step.completed"], run_id=run_id)
            if len(done) >= STEPS:
                break
            dead = [p.name for p in procs if not p.alive()]
            assert not dead, f"{', '.join(dead)} exited before {STEPS} steps"
            assert time.monotonic() < deadline, f"{len(done)} of {STEPS} steps in 1200 s"
            await asyncio.sleep(2.0)
    finally:
        stop_all(procs, run_id)

    events = [s.event for s in await store.read_all(run_id=run_id)]
    of = lambda kind: [e.data for e in events if e.type == kind]  # noqa: E731
    steps = of("step.completed")
    assert sorted(s.step for s in steps) == list(range(STEPS))  # each step once
    groups = of("trainer.group_formed")
    cells = {c for c in (e.cell_id for e in of("cell.registered"))}
    assert len(cells) == CELLS
    # Every step trained on a group of the cells' ranks: its world size is a group's the coordinator formed.
    assert all(g.world_size == len(g.members) and set(g.members) <= cells for g in groups)
    assert {s.world_size for s in steps} <= {g.world_size for g in groups if g.world_size > 0}
    assert len({g.world_size for g in groups}) >= 2, [g.members for g in groups]  # the group re-formed
    # Switches both ways after the first assignments, warm (both processes kept), each with its phases.
    ready = of("cell.ready")
    released = [e for e in of("cell.released") if e.from_role != "idle"]
    assert {r.from_role for r in released} == {"rollout", "train"}, [(r.cell_id, r.from_role) for r in released]
    assert all(r.warm for r in ready), [(r.cell_id, r.role, r.warm, r.phases) for r in ready]
    to_train = [r for r in ready if r.role == "train" and {"drain_s", "sleep_s"} <= r.phases.keys()]
    to_rollout = [r for r in ready if r.role == "rollout" and {"leave_s", "wake_s"} <= r.phases.keys()]
    assert to_train and to_rollout, [(r.cell_id, r.role, r.phases) for r in ready]
    # Every execution ended (none lost to a switch) and each call is recorded once.
    started = {e.execution_id for e in of("execution.started")}
    ended = {e.execution_id for e in of("execution.finished") + of("execution.timed_out")}
    assert started and started == ended
    calls = [(c.execution_id, c.call_index) for c in of("call.completed")]
    assert len(calls) == len(set(calls))

    result = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify"],
        env={**env, "GYRE_DB_SCHEMA": store.schema, "COLUMNS": "250"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " NO " not in result.stdout
