"""The scheduler and a cell agent as their own processes (`python -m services.scheduler serve|cell`), configured
only by environment, running one colocate step end to end against real NATS and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import httpx

from shared.events import ExecutionFinished, StepCompleted, execution_id_for, new_event
from shared.relay import OutboxRelay
from shared.runtime import utcnow
from tests.conftest import Infra, unique

REPO = Path(__file__).resolve().parents[2]
SLEEPER = "import time; time.sleep(600)"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def wait_types(store, run_id: str, etype: str, count: int, timeout: float = 90) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = [s.event for s in await store.read_all(types=[etype], run_id=run_id)]
        if len(found) >= count:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"expected {count} {etype}, have {len(found)}")
        await asyncio.sleep(0.1)


async def healthy(port: int) -> dict:
    async with httpx.AsyncClient(timeout=2) as http:
        for _ in range(300):
            try:
                response = await http.get(f"http://127.0.0.1:{port}/")
                if response.status_code == 200:
                    return response.json()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"nothing healthy on port {port}")


async def test_scheduler_and_cell_agent_processes_run_a_colocate_step(store, bus, infra: Infra, tmp_path):
    run_id = unique("run-")
    ports = {"serve": free_port(), "cell": free_port()}
    env = {
        **os.environ,
        "GYRE_DATABASE_URL": infra.database_url, "GYRE_NATS_URL": infra.nats_url, "GYRE_DB_SCHEMA": store.schema,
        "GYRE_SUBJECT_PREFIX": bus.prefix, "GYRE_RUN_ID": run_id, "GYRE_STATE_DIR": str(tmp_path),
        "GYRE_MODE": "colocate", "GYRE_MAX_STALENESS": "0", "GYRE_GROUP_SIZE": "2",
        "GYRE_SCHEDULER_TASK_IDS": "task-a,task-b", "GYRE_SCHEDULER_TOTAL_STEPS": "1",
        "GYRE_SCHEDULER_TICK_S": "0.1",
        "GYRE_CELL_COUNT": "2", "GYRE_CELL_NODE_ID": "n1", "GYRE_CELL_ROLLOUT_READY": "started",
        "GYRE_CELL_TRAIN_READY": "started", "GYRE_CELL_START_GRACE_S": "0.2", "GYRE_CELL_HEALTH_PORT_BASE": "0",
        "GYRE_CELL_ROLLOUT_COMMAND": f"{{python}} -c '{SLEEPER}'", "GYRE_CELL_TRAIN_COMMAND": f"{{python}} -c '{SLEEPER}'",
    }
    stop = asyncio.Event()
    relay = asyncio.create_task(OutboxRelay(store, bus, dsn=infra.database_url, idle_wait_s=0.05).run(stop))
    procs = {
        role: await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.scheduler", role, cwd=REPO,
            env={**env, "GYRE_HEALTH_PORT": str(port)},
            stdout=open(tmp_path / f"{role}.log", "wb"), stderr=asyncio.subprocess.STDOUT,
        )
        for role, port in ports.items()
    }
    try:
        assert (await healthy(ports["serve"]))["mode"] == "colocate"
        assert (await healthy(ports["cell"]))["service"] == "cell-agent"
        dispatched = await wait_types(store, run_id, "query.dispatched", 1)
        query = dispatched[0].data
        assert (query.query_id, query.task_id, query.step) == (f"{run_id}-step0-q0", "task-a", 0)
        for i in range(2):  # the harness's part, played by the test
            await store.append([new_event(ExecutionFinished(execution_id=execution_id_for(query.query_id, i), elapsed_s=1, calls=1),
                                          run_id=run_id, stream_id=f"execution-{i}", version=1, occurred_at=utcnow())])
        await wait_types(store, run_id, "cell.ready", 4)  # both cells trained: rollout -> train
        await store.append([new_event(StepCompleted(step=0, policy_version=1, world_size=2, seconds=1, metrics={}),
                                      run_id=run_id, stream_id="step-0", version=1, occurred_at=utcnow())])
        for _ in range(100):
            if (await healthy(ports["serve"]))["done"]:
                break
            await asyncio.sleep(0.1)
        assert (await healthy(ports["serve"]))["done"]
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        codes = {role: await asyncio.wait_for(p.wait(), 60) for role, p in procs.items()}
        stop.set()
        await relay
    assert codes == {"serve": 0, "cell": 0}, (tmp_path / "cell.log").read_text()[-2000:]
    for cell in ("n1-cell0", "n1-cell1"):
        kinds = [(s.event.type, getattr(s.event.data, "role", None)) for s in await store.read_stream(f"cell-{cell}")]
        assert kinds == [
            # Warm, both processes stand by from registration: the release from idle gives the first role.
            ("cell.registered", None), ("cell.assigned", "rollout"), ("cell.released", None), ("cell.ready", "rollout"),
            ("cell.assigned", "train"), ("cell.draining", None), ("cell.released", None), ("cell.ready", "train"),
        ]
