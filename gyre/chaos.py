"""Whole-loop chaos: a run driven while a seeded schedule kills, one at a time, every process of it (each
service, each cell's rollout worker and trainer rank) and restarts NATS and PostgreSQL under it; then the checks
that the run lost and repeated nothing, and what each fault cost.

A killed service is started again at once, as compose's restart policy or `gyre run` would; a killed worker or
rank is restarted by its cell agent; the servers come back on the same port and data. Between faults the driver
waits until what it hit is back (the process healthy again, the server answering and every service healthy)
and then until a step completes, so each fault lands on a loop that works end to end: a run of S steps takes
at most S - 2 or so faults. A cell's standing-by process is off the loop's path: it counts as back once its
successor is starting, and the driver waits for every cell's processes to be healthy after the last fault
(a vLLM engine's warm-up on a loaded 2-core machine took 6.5 minutes, long enough for the run to finish).

Used by the chaos slow test (tests/e2e/test_chaos.py) and `bench/chaos.py` (a longer schedule).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg

from gyre.local import EmbeddedNats, EmbeddedPostgres
from gyre.processes import Proc
from shared.events import (
    BatchReady,
    CallRefused,
    Event,
    ExecutionResumed,
    ExecutionScored,
    ExecutionStarted,
    KvMigrated,
    QueryDispatched,
    StepCompleted,
    WeightsPublished,
)

SERVICES = ("relay", "trajectory", "trainer", "gateway", "harness", "cells", "scheduler")
SERVERS = ("nats", "postgres")


class ChaosError(Exception):
    pass


def fault_targets(cells: Sequence[str]) -> list[str]:
    """Everything a fault may hit: each service, each cell's rollout worker and trainer rank, the servers."""
    return [*SERVICES, *(f"worker:{c}" for c in cells), *(f"rank:{c}" for c in cells), *SERVERS]


def fault_plan(seed: int, count: int, cells: Sequence[str]) -> list[str]:
    """`count` faults: every target once in a seeded order, then seeded draws (never one target twice in a row)."""
    rng = random.Random(seed)
    targets = fault_targets(cells)
    plan = rng.sample(targets, len(targets))[:count]
    while len(plan) < count:
        choice = rng.choice(targets)
        if choice != plan[-1]:
            plan.append(choice)
    return plan


@dataclass
class FaultRecord:
    """One fault: what was hit and when, how long until it was back and until the run moved on again."""

    target: str
    at: datetime
    detail: str = ""
    step: int | None = None  # the run's completed steps when it was hit
    back_s: float | None = None  # until the process or server was back (healthy)
    progress_s: float | None = None  # until a step completed after that: the whole loop working again
    costs: dict[str, int] = field(default_factory=dict)  # filled from the log after the run (`fault_costs`)


@dataclass
class Chaos:
    """Injects faults into one run: its service processes (each with a health port), its cell agent's
    processes, and the run's own NATS and PostgreSQL servers."""

    run_id: str
    procs: list[Proc]
    env: dict[str, str]
    log_dir: Any
    nats: EmbeddedNats
    postgres: EmbeddedPostgres
    schema: str
    steps: int  # the run's
    # A vLLM worker's restart on a loaded 2-core machine took 4 minutes (2026-12-06): give it room.
    recover_timeout_s: float = 600.0
    records: list[FaultRecord] = field(default_factory=list)
    # Service processes that exited without being hit (started again, as a supervisor would): name, exit code.
    unplanned: list[tuple[str, int | None]] = field(default_factory=list)

    @property
    def by_name(self) -> dict[str, Proc]:
        return {p.name: p for p in self.procs}

    # ---- looking ----

    def _health_port(self, proc: Proc) -> int:
        return int(proc.env["GYRE_HEALTH_PORT"])

    async def _healthy(self, http: httpx.AsyncClient, port: int) -> bool:
        try:
            return (await http.get(f"http://127.0.0.1:{port}/")).status_code == 200
        except httpx.HTTPError:
            return False

    async def all_healthy(self, http: httpx.AsyncClient) -> bool:
        return all([await self._healthy(http, self._health_port(p)) for p in self.procs])

    async def cells(self, http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """The cell agent's view of its cells: role, and the pids of the serving and standing-by processes."""
        reply = await http.get(f"http://127.0.0.1:{self._health_port(self.by_name['cells'])}/")
        cells: dict[str, dict[str, Any]] = reply.json()["cells"]
        return cells

    def _steps_done(self) -> int:
        """The run's completed steps (a fresh connection: the server may have restarted since)."""
        url = self.postgres.url
        with psycopg.connect(url, connect_timeout=5, options=f"-csearch_path={self.schema}") as conn:
            row = conn.execute("SELECT count(*) FROM events WHERE run_id = %s AND type = 'step.completed'",
                               (self.run_id,)).fetchone()
        return int(row[0]) if row else 0

    async def steps_done(self) -> int | None:
        try:
            return await asyncio.to_thread(self._steps_done)
        except psycopg.Error:
            return None

    def _cell_health_port(self, cell: str, role: str) -> int:
        """A cell's process health port (as the cell agent gives them): rollout at base + index, train at
        base + cells + index."""
        base, count = int(self.env["GYRE_CELL_HEALTH_PORT_BASE"]), int(self.env["GYRE_CELL_COUNT"])
        index = int(cell.rsplit("cell", 1)[1])
        return base + index + (count if role == "train" else 0)

    async def _cell_process(self, http: httpx.AsyncClient, cell: str, role: str) -> int | None:
        """The pid of `cell`'s process for `role` (rollout: its worker, train: its trainer rank), serving or
        standing by."""
        info = (await self.cells(http)).get(cell, {})
        if not info:
            return None
        serving = info.get("role")
        pid = info.get("pid") if serving == role else info.get("standby_pid")
        return int(pid) if pid else None

    def revive(self) -> None:
        """Start again any service process that exited on its own, and note it: the run's supervisor would."""
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is not None:
                self.unplanned.append((proc.name, proc.popen.returncode))
                proc.start(self.env, self.log_dir)

    async def until_steps(self, steps: int, *, timeout_s: float) -> None:
        """Until the run has completed `steps` steps (reviving what exits on its own meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while (await self.steps_done() or 0) < steps:
            self.revive()
            if time.monotonic() > deadline:
                raise ChaosError(f"{await self.steps_done()} of {steps} steps within {timeout_s:.0f} s")
            await asyncio.sleep(1.0)

    # ---- hitting ----

    async def run_plan(self, plan: Sequence[str], *, every_steps: int = 2,
                       log: Callable[[FaultRecord], None] | None = None) -> None:
        """Inject the plan's faults in order, the i-th once the run has completed `every_steps` × i + 1 steps
        (so faults spread over the run and each lands on a loop that trains) and the one before is over; fails
        if the run ends first."""
        for i, target in enumerate(plan):
            await self.until_steps(every_steps * i + 1, timeout_s=self.recover_timeout_s * 3)
            done = await self.steps_done()
            if done is not None and done >= self.steps:
                raise ChaosError(f"the run finished its {self.steps} steps before fault {i + 1} of {len(plan)}: "
                                 "give it more steps")
            record = await self.inject(target)
            if log is not None:
                log(record)

    async def until_cells_ready(self) -> float:
        """Until every cell's processes, serving and standing by, answer healthy (a standby restarted by a
        fault warms up while the run goes on); seconds it took."""
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=3.0) as http:
            async def ready() -> bool:
                cells = await self.cells(http)
                wanted = [(cell, role) for cell, info in cells.items() for role in ("rollout", "train")
                          if info.get("pid" if info.get("role") == role else "standby_pid")]
                return bool(cells) and all([await self._healthy(http, self._cell_health_port(cell, role))
                                            for cell, role in wanted])

            return await self._until(ready, started, "every cell's processes healthy")

    async def inject(self, target: str) -> FaultRecord:
        record = FaultRecord(target, datetime.now(UTC), step=await self.steps_done())
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=3.0) as http:
            if target in SERVICES:
                proc = self.by_name[target]
                record.detail = f"SIGKILL pid {proc.popen.pid if proc.popen else '?'}; started again"
                _kill_group(proc)
                proc.restarts += 1
                proc.start(self.env, self.log_dir)
                back = lambda: self._healthy(http, self._health_port(proc))  # noqa: E731
            elif target.startswith(("worker:", "rank:")):
                kind, cell = target.split(":", 1)
                role = "rollout" if kind == "worker" else "train"
                serving = (await self.cells(http)).get(cell, {}).get("role") == role
                pid = await self._cell_process(http, cell, role)
                if pid is None:
                    raise ChaosError(f"{target}: the cell agent reports no {role} process on {cell}")
                record.detail = (f"SIGKILL pid {pid} ({'serving' if serving else 'standing by'}); "
                                 "its cell agent restarts it")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

                async def back() -> bool:
                    now = await self._cell_process(http, cell, role)
                    if now is None or now == pid or not await self.all_healthy(http):
                        return False
                    # A standby is off the loop's path: it is back once its successor is starting (its
                    # warm-up, minutes for a vLLM engine on a loaded 2-core machine, goes on while the loop
                    # runs and would use up the run's steps; `until_cells_ready` waits for it at the end).
                    return not serving or await self._healthy(http, self._cell_health_port(cell, role))
            elif target == "nats":
                record.detail = "SIGKILL nats-server; started again on its port and data"
                self.nats.kill()
                self.nats.start()
                back = lambda: self.all_healthy(http)  # noqa: E731
            elif target == "postgres":
                record.detail = "immediate shutdown (a crash: WAL recovery on start); started again"
                self.postgres.stop(mode="immediate")
                self.postgres.start()
                back = lambda: self.all_healthy(http)  # noqa: E731
            else:
                raise ChaosError(f"unknown fault target {target!r}")
            record.back_s = await self._until(back, started, f"{target} back")
            record.progress_s = await self._until_progress(started)
        self.records.append(record)
        return record

    async def _until(self, check: Callable[[], Any], started: float, what: str) -> float:
        deadline = started + self.recover_timeout_s
        while True:
            self.revive()
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                if await check():
                    return round(time.monotonic() - started, 2)
            if time.monotonic() > deadline:
                raise ChaosError(f"{what}: not within {self.recover_timeout_s:.0f} s")
            await asyncio.sleep(0.25)

    async def _until_progress(self, started: float) -> float | None:
        """Until a step completes after the fault's target is back: the whole loop works again (None when the
        run has no step left to complete)."""
        before = await self._until_value(self.steps_done, started, "the log")
        if before >= self.steps:
            return None

        async def moved() -> bool:
            done = await self.steps_done()
            return done is not None and done > before

        return await self._until(moved, started, "a step after it")

    async def _until_value(self, get: Callable[[], Any], started: float, what: str) -> Any:
        value: list[Any] = []

        async def got() -> bool:
            value[:] = [await get()]
            return value[0] is not None

        await self._until(got, started, what)
        return value[0]


def _kill_group(proc: Proc) -> None:
    if proc.popen is None or proc.popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait()


# ---- after the run ----------------------------------------------------------------------------------


def check_run(events: Sequence[Event], *, steps: int, group_size: int) -> list[str]:
    """What the log says went wrong: a step lost or trained twice, an execution lost (started, never scored)
    or duplicated, a query short of its group or trained in two batches. Empty when nothing did."""
    problems: list[str] = []
    data = [e.data for e in events]
    completed = sorted(d.step for d in data if isinstance(d, StepCompleted))
    if completed != list(range(steps)):
        problems.append(f"steps completed {completed}, expected each of 0..{steps - 1} once")
    batches = Counter(d.step for d in data if isinstance(d, BatchReady))
    if any(n > 1 for n in batches.values()):
        problems.append(f"a step's batch built twice: {dict(batches)}")
    versions = Counter(d.version for d in data if isinstance(d, WeightsPublished))
    if any(n > 1 for n in versions.values()):
        problems.append(f"a weight version published twice: {dict(versions)}")
    started = Counter(d.execution_id for d in data if isinstance(d, ExecutionStarted))
    scored = Counter(d.execution_id for d in data if isinstance(d, ExecutionScored))
    if twice := sorted(x for x in set(started) | set(scored) if max(started[x], scored[x]) > 1):
        problems.append(f"executions started or scored twice: {twice[:5]}")
    if lost := sorted(set(started) - set(scored)):
        problems.append(f"executions started and never scored: {lost[:5]} ({len(lost)})")
    per_query = Counter(d.query_id for d in data if isinstance(d, ExecutionStarted))
    if short := [d.query_id for d in data if isinstance(d, QueryDispatched) and per_query[d.query_id] != group_size]:
        problems.append(f"queries without their {group_size} executions: {short[:5]}")
    trained = Counter(q for d in data if isinstance(d, BatchReady) for q in d.query_ids)
    if again := [q for q, n in trained.items() if n > 1]:
        problems.append(f"queries trained in two batches: {again[:5]}")
    return problems


def fault_costs(events: Sequence[Event], records: list[FaultRecord]) -> None:
    """Attribute what the log shows between one fault and the next to the first: executions a harness resumed
    and the calls it answered again from the log, executions that ended as infrastructure failures (scored, not
    trained), sessions moved by recomputing their prompt and the tokens recomputed, calls refused for want of
    the infrastructure. Fills each record's `costs`."""
    ordered = sorted(records, key=lambda r: r.at)
    for i, record in enumerate(ordered):
        end = ordered[i + 1].at if i + 1 < len(ordered) else None
        window = [e for e in events if e.occurred_at >= record.at and (end is None or e.occurred_at < end)]
        costs: Counter[str] = Counter()
        for e in window:
            d = e.data
            if isinstance(d, ExecutionResumed):
                costs["executions_resumed"] += 1
                costs["calls_replayed"] += d.replayed_calls
            elif isinstance(d, ExecutionScored) and d.infra_failure:
                costs["infra_failures"] += 1
            elif isinstance(d, KvMigrated) and d.method == "recompute":
                costs["sessions_recomputed"] += 1
                costs["tokens_recomputed"] += d.tokens
            elif isinstance(d, CallRefused) and d.infra:
                costs["calls_refused"] += 1
        record.costs = dict(costs)


def summary(records: list[FaultRecord]) -> dict[str, Any]:
    """Counts and costs of all faults, by target kind (a worker or rank of any cell counts as one kind)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for r in records:
        kind = r.target.split(":")[0]
        row = by_kind.setdefault(kind, {"faults": 0, "back_s": [], "progress_s": [], "costs": Counter()})
        row["faults"] += 1
        row["back_s"].append(r.back_s)
        row["progress_s"].append(r.progress_s)
        row["costs"].update(r.costs)
    total: Counter[str] = Counter()
    for row in by_kind.values():
        total.update(row["costs"])
        row["costs"] = dict(row["costs"])
        row["back_s_max"] = max((x for x in row.pop("back_s") if x is not None), default=None)
        row["progress_s_max"] = max((x for x in row.pop("progress_s") if x is not None), default=None)
    return {"faults": len(records), "by_kind": by_kind, "costs": dict(total),
            "records": [{**asdict(r), "at": r.at.isoformat()} for r in records]}
