"""The shortened RL loop end to end: every service as its own process over real NATS and PostgreSQL,
a real vLLM engine on the tiny model, real sandboxes — one query, G executions, one training step, one
weight reload — and the events it leaves in the log, in a valid order.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.processes import service_processes, start_all, stop_all
from gyre.report import build_report
from tests.conftest import Infra, unique
from tests.e2e.helpers import loop_test_environment

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")

GROUP = 2


async def wait_for(predicate, what: str, timeout: float, procs) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        dead = [p.name for p in procs if not p.alive()]
        if dead:
            raise AssertionError(f"{', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(1.0)


def first(events, type_: str, **match) -> int:
    for i, e in enumerate(events):
        if e.type == type_ and all(getattr(e.data, k) == v for k, v in match.items()):
            return i
    raise AssertionError(f"no {type_} {match} in the log")


async def test_one_step_of_the_loop_runs_through_every_service(store, bus, infra: Infra, tmp_path: Path):
    run_id = unique("e2e-")
    env = loop_test_environment(store, bus, infra, tmp_path, run_id=run_id, steps=1, group_size=GROUP,
                                task_ids=["create-file-1"])
    versions: list[int] = []

    async def on_status(msg) -> None:
        versions.append(json.loads(msg.data).get("policy_version", 0))

    sub = await bus.nc.subscribe(f"{bus.prefix}.rollout.status", cb=on_status)
    procs = service_processes(sys.executable)
    log_dir = tmp_path / "logs"
    try:
        start_all(procs, env, log_dir)

        async def trained() -> bool:
            return any(s.event.type == "weights.published" and s.event.data.version == 1
                       for s in await store.read_all(run_id=run_id))

        await wait_for(trained, "the first training step's weights", 600, procs)

        async def reloaded() -> bool:
            return any(v >= 1 for v in versions)

        await wait_for(reloaded, "the rollout worker to load policy version 1", 120, procs)
    finally:
        stop_all(procs, run_id)
        await sub.unsubscribe()

    events = [s.event for s in await store.read_all(run_id=run_id)]
    types = [e.type for e in events]
    assert types.count("cell.registered") == 2
    assert types.count("execution.started") == GROUP and types.count("execution.scored") == GROUP
    assert types.count("batch.ready") == 1 and types.count("step.completed") == 1
    ends = [(e.type, e.data.model_dump()) for e in events if e.type in ("execution.finished", "execution.timed_out")]
    assert types.count("call.completed") >= GROUP, f"too few calls recorded; the executions ended: {ends}"
    # A valid order: cells up before dispatch; each execution's life in order; the step after its batch.
    assert first(events, "cell.ready", role="rollout") < first(events, "query.dispatched")
    assert first(events, "query.dispatched") < first(events, "execution.started")
    for e in events:
        if e.type == "execution.started":
            eid = e.data.execution_id
            start = first(events, "execution.started", execution_id=eid)
            call = first(events, "call.completed", execution_id=eid)
            end = min(i for i, x in enumerate(events)
                      if x.type in ("execution.finished", "execution.timed_out") and x.data.execution_id == eid)
            scored = first(events, "execution.scored", execution_id=eid)
            assert start < call < end < scored
    batch = first(events, "batch.ready")
    assert max(i for i, e in enumerate(events) if e.type == "execution.scored") < batch
    assert batch < first(events, "step.completed") < first(events, "weights.published", version=1)
    assert events[batch].data.unique_tokens > 0 and events[batch].data.target_tokens > 0
    # Every call was recorded with the policy version that served it.
    assert {e.data.policy_version for e in events if e.type == "call.completed"} == {0}
    # The new version went out as shards and the worker says what loading it cost; the report times it.
    (published,) = [e.data for e in events if e.type == "weights.published" and e.data.version == 1]
    assert published.format == "shards" and published.bytes > 0 and published.publish_s > 0
    loads = [e.data for e in events if e.type == "weights.loaded" and e.data.version == 1]
    assert loads and {"fetch_s", "pause_s", "swap_s"} <= loads[0].phases.keys()
    sync = {s["version"]: s for s in build_report(run_id, events).weight_syncs}[1]
    assert sync["workers"] == 1 and sync["served_s"] is not None and len(sync["pauses"]) == 1

    # `gyre replay --run` rebuilds every batch from the log alone with the digests the live run emitted.
    replay_env = {**env, "GYRE_DB_SCHEMA": store.schema, "COLUMNS": "250"}
    result = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify"],
        env=replay_env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    live = events[batch].data.batch.digest
    assert live[7:23] in result.stdout  # the batch table shows the live and replayed digests, matching
    assert " NO " not in result.stdout
