"""Executions outlive their harness: the harness service process is killed mid-execution, a new one resumes the
execution (its recorded calls answered from the log by the real gateway, its commands redone in a fresh
workspace) and it finishes with the same calls an uninterrupted execution makes, no infrastructure failure.

The gateway is the real one (token check, tito, recording in PostgreSQL, replay) over the rollout tests'
scripted engine, served in this test's event loop; the harness runs as `python -m services.harness`, as a run
starts it, so a kill is a real SIGKILL of the process and of nothing else.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from services.harness.agent_core import AgentConfig, Budget
from services.harness.execution import BuiltinHarness, run_execution
from services.harness.external_harness import GatewayAccess
from services.harness.tasks import load_task
from services.rollout.recorder_postgres import PostgresCallRecorder
from shared.calls import ExecutionSequences, call_record
from shared.chat import format_tool_call
from shared.events import CallCompleted, ExecutionStarted, new_event, stream_id_for
from shared.execution_tokens import derive_execution_token
from shared.runtime import utcnow
from tests.conftest import Infra, unique
from tests.rollout import fakes

from .conftest import TASKS

STEPS = [
    # The harness is killed while this command sleeps, after the call that asked for it was answered.
    format_tool_call("shell", {"command": "printf 'hello ' > hello.txt && sleep 5"}),
    format_tool_call("shell", {"command": "printf 'world\\n' >> hello.txt"}),
    format_tool_call("submit", {"answer": "done"}),
]


def _script(codec: fakes.CharCodec) -> Any:
    def script(prompt: list[int]) -> str:
        return STEPS[min(codec.decode(prompt).count("</tool_response>"), len(STEPS) - 1)]

    return script


async def _serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not (server.started and server.servers):
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _harness(infra: Infra, store: Any, bus: Any, run_id: str, gateway_url: str, work: Path, log: Path) -> Any:
    env = {**os.environ, "GYRE_DATABASE_URL": infra.database_url, "GYRE_NATS_URL": infra.nats_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "GYRE_RUN_ID": run_id,
           "GYRE_HARNESS_TASKS_DIR": str(TASKS), "GYRE_HARNESS_WORK_DIR": str(work),
           "GYRE_HARNESS_GATEWAY_URL": gateway_url, "GYRE_HARNESS_GATEWAY_TOKEN_SECRET": fakes.TOKEN_SECRET.decode(),
           "GYRE_HARNESS_MODEL_NAME": "tiny", "GYRE_HARNESS_CONCURRENCY": "1", "GYRE_HARNESS_WALL_BUDGET_S": "120"}
    return subprocess.Popen([sys.executable, "-m", "services.harness"], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


async def _types(store: Any, execution_id: str) -> list[Any]:
    return [item.event for item in await store.read_stream(stream_id_for("execution", execution_id))]


async def _wait(store: Any, execution_id: str, kind: str, count: int, proc: Any, log: Path, timeout: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while sum(e.type == kind for e in await _types(store, execution_id)) < count:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert asyncio.get_running_loop().time() < deadline, f"no {count} {kind} in {timeout} s"
        await asyncio.sleep(0.1)


async def _sequences(store: Any, execution_id: str) -> list[np.ndarray]:
    seqs = ExecutionSequences()
    for event in await _types(store, execution_id):
        if isinstance(event.data, CallCompleted):
            seqs.add(call_record(event.data, await store.blobs.get(event.data.record)))
    return seqs.sequences


async def test_a_harness_killed_mid_execution_is_resumed_and_the_execution_makes_the_calls_it_would_have(
        store, bus, infra: Infra, tmp_path: Path, best_backend: str) -> None:
    run_id = unique("run-")
    codec = fakes.CharCodec()
    stack = fakes.build_stack([fakes.ScriptedEngine(codec, _script(codec), max_model_len=65536)], codec,
                              recorder=PostgresCallRecorder(store, run_id=run_id))  # type: ignore[arg-type]
    server, serving, base_url = await _serve(stack.app)
    try:
        # The control: the same execution uninterrupted, through the same gateway.
        control = await asyncio.to_thread(
            run_execution, execution_id="exec-control", task=load_task(TASKS / "create-file-1"),
            harness=BuiltinHarness(agent=AgentConfig(model="tiny", sdk_max_retries=0)),
            gateway=GatewayAccess(base_url=base_url, token=derive_execution_token(fakes.TOKEN_SECRET, "exec-control"),
                                  model="tiny"),
            state_dir=tmp_path / "control", backend=best_backend, budget=Budget(max_calls=10))
        assert control.grade.score == 1.0

        # The execution as a dispatch announced it; the harness that started it is gone before its first call.
        execution_id = "q-kill-s0"
        started = ExecutionStarted(execution_id=execution_id, query_id="q-kill", task_id="create-file-1",
                                   group_size=1, sample_index=0, seed=5)
        await store.append([new_event(started, run_id=run_id, stream_id=stream_id_for("execution", execution_id),
                                      version=1, occurred_at=utcnow())])
        log, work = tmp_path / "harness.log", tmp_path / "executions"
        first = _harness(infra, store, bus, run_id, base_url, work, log)
        try:
            # It picks the execution up, its agent's first call is answered, and it is killed in the command after.
            await _wait(store, execution_id, "call.completed", 1, first, log)
            await asyncio.sleep(1.0)
            os.killpg(first.pid, signal.SIGKILL)
            await asyncio.to_thread(first.wait, 30)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
        second = _harness(infra, store, bus, run_id, base_url, work, log)
        try:
            await _wait(store, execution_id, "execution.scored", 1, second, log)
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.to_thread(second.wait, 60)
    finally:
        server.should_exit = True
        await serving

    events = await _types(store, execution_id)
    kinds = [e.type for e in events]
    resumed = [e.data for e in events if e.type == "execution.resumed"]
    # Resumed twice: by the first harness (no call yet) and, after the kill, by the second (one call replayed).
    assert [(r.attempt, r.replayed_calls) for r in resumed] == [(1, 0), (2, 1)], kinds
    assert "execution.timed_out" not in kinds and kinds.count("execution.finished") == 1
    (scored,) = [e.data for e in events if e.type == "execution.scored"]
    assert scored.infra_failure is None and scored.reward == 1.0
    (finished,) = [e.data for e in events if e.type == "execution.finished"]
    assert finished.calls == 3 and finished.stop_reason == "submitted"
    # The same calls as the uninterrupted control, each once: the replayed call was not generated or recorded again.
    got, expected = await _sequences(store, execution_id), await _sequences(store, "exec-control")
    assert len(got) == len(expected) == 3
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert len(stack.engines[0].prompts) == 6  # three for the control, three for the killed-and-resumed one
