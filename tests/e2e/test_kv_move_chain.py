"""The whole KV move on real processes: the outbox relay, the rollout gateway and two rollout worker processes
(real vLLM CPU engines, each with its own KV folder: nothing shared but NATS and PostgreSQL). An execution makes
a call on cell 0; the scheduler's order (`kv.migration_ordered`, as the scheduler appends it) makes worker 0
move it: its KV is saved, carried through the bus's Object Store and loaded by worker 1, which reports
`kv.migrated`; the next calls run on cell 1 from the moved prefix (cached tokens), the scheduler's fold of
sessions places the execution on cell 1, and its calls and tree are those of an unmoved run with the same seed.
Then worker 1 is killed mid-execution: the next call resumes on worker 0 by recompute, and `gyre replay
--verify` rebuilds every tree from the log."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from gyre.processes import Proc, start_all, stop_all
from shared.calls import CallTokens
from shared.events import (
    CallCompleted,
    ExecutionFinished,
    ExecutionStarted,
    KvMigrated,
    KvMigrationOrdered,
    QueryDispatched,
    WeightsLoaded,
    execution_id_for,
    new_event,
    stream_id_for,
)
from shared.execution_tokens import derive_execution_token
from tests.e2e.agent import Agent, until_the_gateway_routes_to
from tests.e2e.helpers import loop_test_environment

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
pytest.importorskip("vllm", reason="the move needs vLLM workers (install the cpu or gpu extra)")

CELLS = ("kv-cell0", "kv-cell1")


def _event(data: Any, run_id: str, stream: str) -> Any:
    return new_event(data, run_id=run_id, stream_id=stream, version=1, occurred_at=datetime.now(UTC))


async def _events(store: Any, run_id: str) -> list[Any]:
    return [s.event for s in await store.read_all(run_id=run_id)]


async def _wait(store: Any, run_id: str, found: Any, what: str, procs: list[Proc], timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = found(await _events(store, run_id))
        if result:
            return result
        dead = [p.name for p in procs if p.popen is not None and p.popen.poll() is not None]
        assert not dead, f"processes exited while waiting for {what}: {dead}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


async def test_an_ordered_move_carries_the_kv_between_worker_processes_and_a_dead_worker_loses_nothing(
        store, bus, infra, tmp_path) -> None:
    run_id = f"kv-chain-{os.getpid()}-{int(time.time())}"
    env = loop_test_environment(store, bus, infra, tmp_path, run_id=run_id, steps=1, group_size=1,
                                task_ids=["none"], cells=len(CELLS))
    python = sys.executable
    workers = {cell: Proc(f"worker-{cell}", [python, "-m", "services.rollout", "worker"],
                          env={"GYRE_ROLLOUT_CELL_ID": cell, "GYRE_STATE_DIR": str(tmp_path / "state" / cell)})
               for cell in CELLS}
    procs = [Proc("relay", [python, "-m", "gyre", "relay"]),
             Proc("gateway", [python, "-m", "services.rollout", "gateway"]), *workers.values()]
    url = f"http://127.0.0.1:{env['GYRE_ROLLOUT_PORT']}"
    secret = env["GYRE_ROLLOUT_TOKEN_SECRET"].encode()
    try:
        start_all(procs, env, tmp_path / "logs")
        await _wait(store, run_id, lambda evs: {e.data.cell_id for e in evs if isinstance(e.data, WeightsLoaded)}
                    >= set(CELLS), "both workers serving", procs, timeout_s=600)
        await until_the_gateway_routes_to(url, set(CELLS))

        async def start(query_id: str) -> Agent:
            dispatched = QueryDispatched(query_id=query_id, task_id="none", group_size=1, seeds=[7], step=0,
                                         policy_version=0, placements=[CELLS[0]])
            execution_id = execution_id_for(query_id, 0)
            started = ExecutionStarted(execution_id=execution_id, query_id=query_id, task_id="none", group_size=1,
                                       sample_index=0, seed=7, call_budget=100, cell_id=CELLS[0])
            await store.append([_event(dispatched, run_id, f"query-{query_id}")], expected_version="any")
            await store.append([_event(started, run_id, stream_id_for("execution", execution_id))],
                               expected_version="any")
            return Agent(url, derive_execution_token(secret, execution_id))

        # The unmoved run first, alone on cell 0: three calls.
        still = await start("q-still")
        for _ in range(3):
            await still.call_when_taken_up()
        # The same seed again; after its first call the scheduler orders it to cell 1.
        moved = await start("q-moved")
        await moved.call_when_taken_up()
        moved_id = execution_id_for("q-moved", 0)
        order = KvMigrationOrdered(execution_id=moved_id, from_cell=CELLS[0], to_cell=CELLS[1], policy="elastic",
                                   reason="test")
        await store.append([_event(order, run_id, stream_id_for("cell", CELLS[0]))], expected_version="any")
        migrated = await _wait(store, run_id, lambda evs: next(
            (e.data for e in evs if isinstance(e.data, KvMigrated) and e.data.execution_id == moved_id), None),
            "kv.migrated from worker 0", procs)
        assert (migrated.from_cell, migrated.to_cell, migrated.method, migrated.fallback) == (
            CELLS[0], CELLS[1], "kv", ""), migrated
        assert migrated.tokens >= 256 and migrated.bytes > 0 and {"save_s", "send_s", "receive_s", "load_s"} <= \
            set(migrated.phases)
        for _ in range(2):
            await moved.call()
        # The next call on the target took the moved prefix from cache instead of prefilling it again.
        assert moved.usages[1]["cache_read_input_tokens"] >= migrated.tokens - 128

        events = await _events(store, run_id)
        calls = {eid: sorted((e.data for e in events if isinstance(e.data, CallCompleted)
                              and e.data.execution_id == eid), key=lambda c: c.call_index)
                 for eid in (moved_id, execution_id_for("q-still", 0))}
        assert [c.cell_id for c in calls[moved_id]] == [CELLS[0], CELLS[1], CELLS[1]]
        assert _sessions_fold(events, moved_id).cell_id == CELLS[1]  # the scheduler's view follows the move
        # Same seed, same calls: the tokens and logprobs of every call match the unmoved run's.
        blobs = {c.record.digest: await store.blobs.get(c.record) for cs in calls.values() for c in cs}
        for a, b in zip(calls[execution_id_for("q-still", 0)], calls[moved_id], strict=True):
            ta, tb = CallTokens.decode(blobs[a.record.digest]), CallTokens.decode(blobs[b.record.digest])
            assert list(ta.new_prompt) == list(tb.new_prompt) and list(ta.completion) == list(tb.completion)
            assert list(ta.logprobs) == pytest.approx(list(tb.logprobs), abs=1e-4)
            assert (a.parent_call_index, a.branch_hint) == (b.parent_call_index, b.branch_hint)

        # Worker 1 dies with the execution on it: the next call resumes on worker 0, recomputing its history.
        victim = workers[CELLS[1]]
        assert victim.popen is not None
        os.killpg(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait(timeout=30)
        procs.remove(victim)
        await moved.call()
        events = await _events(store, run_id)
        resumed = [e.data for e in events if isinstance(e.data, CallCompleted) and e.data.execution_id == moved_id]
        assert sorted((c.call_index, c.cell_id) for c in resumed)[-1] == (3, CELLS[0])
        assert len({c.call_index for c in resumed}) == len(resumed) == 4  # each call recorded once

        for agent, eid in ((still, execution_id_for("q-still", 0)), (moved, moved_id)):
            await store.append([_event(ExecutionFinished(execution_id=eid, elapsed_s=1.0, calls=len(agent.usages)),
                                       run_id, stream_id_for("execution", eid))], expected_version="any")
        result = subprocess.run(
            [python, "-m", "gyre.cli", "replay", "--run", run_id, "--verify", "-q"],
            env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        # The moved execution's first three calls build the same tree as the unmoved run's three.
        first_three = [e for e in await _events(store, run_id) if not (
            isinstance(e.data, CallCompleted | ExecutionFinished) and e.data.execution_id == moved_id
            and getattr(e.data, "call_index", 3) >= 3)]
        trees = await _replayed_trees(store, first_three, run_id)
        still_tree, moved_tree = trees[execution_id_for("q-still", 0)], trees[moved_id]
        for (name, a), (_, b) in zip(still_tree.canonical_arrays(), moved_tree.canonical_arrays(), strict=True):
            if name == "logprob":
                assert a.tolist() == pytest.approx(b.tolist(), abs=1e-4)
            else:
                assert a.tolist() == b.tolist(), name
    finally:
        stop_all(procs, run_id)


def _sessions_fold(events: list[Any], execution_id: str) -> Any:
    """The scheduler's fold of live sessions (services/scheduler/sessions.py) over the run's log."""
    from services.scheduler.sessions import LiveSessions

    sessions = LiveSessions()
    for e in events:
        match e.data:
            case QueryDispatched():
                sessions.dispatched(e.data)
            case ExecutionStarted():
                sessions.started(e.data)
            case CallCompleted():
                sessions.served(e.data, by_rollout_cell=True)
            case KvMigrationOrdered():
                sessions.ordered(e.data, 0.0)
            case KvMigrated():
                sessions.migrated(e.data)
    session = sessions.get(execution_id)
    assert session is not None
    return session


async def _replayed_trees(store: Any, events: list[Any], run_id: str) -> dict[str, Any]:
    from services.trajectory.replay import Selection, referenced_blobs, replay

    blobs = {ref.digest: await store.blobs.get(ref) for ref in referenced_blobs(events)}
    report = replay(events, lambda ref: blobs[ref.digest], Selection(run=run_id))
    return {e.execution_id: e.tree for e in report.executions}
