"""One run of the loop on servers of its own, with or without a chaos plan (gyre/chaos.py): the untrained tiny
model on the shipped tasks, every process started as `gyre run` starts them, faults injected, then the checks.
The chaos slow test and `bench/chaos.py` both run it; the bench also runs it with no faults for the baseline.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.chaos import Chaos, FaultRecord, check_run, fault_costs, fault_plan, fault_targets, summary
from gyre.launcher import loop_environment
from gyre.local import EmbeddedNats, EmbeddedPostgres
from gyre.processes import serve_metrics, service_processes, start_all, stop_all
from gyre.tinymodel import tiny_model
from shared.events import Event
from shared.ports import free_port
from shared.store import EventStore

TASKS = ["uppercase-1", "sort-lines-1"]


@dataclass
class ChaosOutcome:
    run_id: str
    steps: int
    wall_s: float
    events: list[Event]
    problems: list[str]  # check_run's findings: empty when nothing was lost or repeated
    replay_ok: bool
    replay_output: str
    faults: dict[str, Any] = field(default_factory=dict)  # chaos.summary(): counts and costs by kind
    unplanned: list[tuple[str, int | None]] = field(default_factory=list)  # processes that died on their own

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self.faults.get("records", []))


async def run_chaos(work: Path, *, seed: int, faults: int | None, cells: int = 2, group_size: int = 2,
                    every_steps: int = 3, extra_steps: int = 4, steps: int | None = None,
                    log: Any = print) -> ChaosOutcome:
    """A run under `faults` faults of a seeded plan (every target once when None; 0: no faults, the baseline),
    on fresh NATS and PostgreSQL servers under `work`. Steps: enough that the run outlasts the plan."""
    state = Path(tempfile.mkdtemp(prefix="gyre-chaos-"))  # the servers' (not under work: see tests/conftest.py)
    nats, postgres = EmbeddedNats(state), EmbeddedPostgres(state)
    nats.start()
    postgres.start()
    try:
        store = await EventStore.connect(postgres.url, migrate=True)
        await store.close()
        cell_ids = [f"vm-cell{i}" for i in range(cells)]
        plan = fault_plan(seed, len(fault_targets(cell_ids)) if faults is None else faults, cell_ids)
        total = steps or (every_steps + 1) * len(plan) + extra_steps
        run_id = f"chaos-{seed}-{int(time.time())}"
        model_dir = tiny_model(work / "model", seed=0, size="tiny")
        env = loop_environment(
            run_id=run_id, nats_url=nats.url, database_url=postgres.url, model_dir=model_dir, run_dir=work,
            mode="async", steps=total, group_size=group_size, max_staleness=1, seed=seed, task_ids=TASKS,
            gateway_port=free_port(), cells=cells,
            extra={
                "GYRE_CELL_NODE_ID": "vm",
                "GYRE_CELL_WARM": "true",  # each cell's standing-by worker and rank are targets of the plan too
                "GYRE_DROP_ZERO_VARIANCE": "false",  # the untrained model scores 0: train on every batch anyway
                "GYRE_HARNESS_WALL_BUDGET_S": "300",
                "GYRE_HARNESS_CALL_BUDGET": "3",
                "GYRE_HARNESS_MAX_TOKENS": "48",
                "GYRE_ROLLOUT_MAX_MODEL_LEN": "8192",
                "GYRE_ACK_WAIT_S": "5",  # what a killed service held comes back within seconds
            },
        )
        procs = service_processes(sys.executable)
        serve_metrics(procs, env, [free_port() for _ in procs])
        chaos = Chaos(run_id=run_id, procs=procs, env=env, log_dir=work / "logs", nats=nats, postgres=postgres,
                      schema="public", steps=total)
        started = time.monotonic()
        try:
            start_all(procs, env, work / "logs")
            await chaos.until_steps(1, timeout_s=900)  # the loop runs before the first fault
            await chaos.run_plan(plan, every_steps=every_steps,
                                 log=lambda r: log(_line(r, time.monotonic() - started), flush=True))
            await chaos.until_cells_ready()  # a standby a fault restarted has warmed up again
            await chaos.until_steps(total, timeout_s=900)
        finally:
            wall = time.monotonic() - started
            stop_all(procs, run_id)
        store = await EventStore.connect(postgres.url)
        try:
            events = [s.event for s in await store.read_all(run_id=run_id)]
        finally:
            await store.close()
        fault_costs(events, chaos.records)
        replay = subprocess.run(
            [sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify", "--quiet"],
            env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=900,
        )
        return ChaosOutcome(
            run_id=run_id, steps=total, wall_s=round(wall, 1), events=events,
            problems=check_run(events, steps=total, group_size=group_size), replay_ok=replay.returncode == 0,
            replay_output=(replay.stdout + replay.stderr)[-4000:], faults=summary(chaos.records),
            unplanned=chaos.unplanned,
        )
    finally:
        nats.stop()
        postgres.stop(mode="immediate")
        shutil.rmtree(state, ignore_errors=True)


def _line(r: FaultRecord, elapsed: float) -> str:
    return (f"{elapsed:7.1f} s  step {r.step}  {r.target:18} back {r.back_s} s, a step {r.progress_s} s later  "
            f"({r.detail})")
