"""Execution plumbing around the agent: crash recovery grades preserved work; setup failures are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.harness.execution import grade_preserved
from services.harness.sandboxes import make_sandbox
from services.harness.taskrun import TaskSetupError, prepare, sandbox_spec_for
from services.harness.tasks import load_task

from .test_agent_loop import partial_task


def test_work_preserved_by_a_crashed_execution_is_graded_on_reattach(tmp_path: Path, best_backend: str) -> None:
    task = load_task(partial_task(tmp_path / "task"))
    state = tmp_path / "execution-crashed"
    box = make_sandbox(state, sandbox_spec_for(task), backend=best_backend)
    prepare(task, box)
    assert box.exec("echo A > a.txt", timeout_s=60).ok
    box.close()  # the service died here: no grade, but the state folder stays
    graded = grade_preserved(task, state, backend=best_backend)
    assert graded.score == 0.5 and graded.passed == 1


def test_grading_a_missing_state_folder_is_a_named_error(tmp_path: Path, best_backend: str) -> None:
    task = load_task(partial_task(tmp_path / "task"))
    with pytest.raises(FileNotFoundError, match="work/"):
        grade_preserved(task, tmp_path / "never-ran", backend=best_backend)


def test_failing_setup_script_stops_the_task_with_its_output(tmp_path: Path, best_backend: str) -> None:
    root = partial_task(tmp_path / "task")
    (root / "setup.sh").write_text("echo 'cannot build fixture' >&2\nexit 3\n")
    task = load_task(root)
    box = make_sandbox(tmp_path / "state", sandbox_spec_for(task), backend=best_backend)
    try:
        with pytest.raises(TaskSetupError, match="cannot build fixture"):
            prepare(task, box)
    finally:
        box.close(remove=True)


def test_reward_file_linked_outside_the_logs_is_ignored(tmp_path: Path) -> None:
    from services.harness.taskrun import read_inside_file

    logs = tmp_path / "logs"
    (logs / "verifier").mkdir(parents=True)
    secret = tmp_path / "host-secret.txt"
    secret.write_text("0.9")
    (logs / "verifier" / "reward.txt").symlink_to(secret)
    assert read_inside_file(logs, logs / "verifier" / "reward.txt") is None
    (logs / "verifier" / "reward.txt").unlink()
    (logs / "verifier" / "reward.txt").write_text("0.5\n")
    assert read_inside_file(logs, logs / "verifier" / "reward.txt") == "0.5\n"


async def test_executions_run_on_their_own_threads_not_the_loops_default_pool(monkeypatch) -> None:
    """An execution's thread waits for its callbacks on the event loop, and a callback may need the loop's
    default pool (a host-name lookup when the store opens a connection). With executions on the default pool,
    a full pool would wait on itself for ever; on a pool of their own they cannot starve it."""
    import asyncio
    import concurrent.futures

    import services.harness.execution as execution

    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))  # a default pool the executions fill

    def fake_run_execution(**kwargs):
        async def callback() -> str:
            return await asyncio.to_thread(lambda: "resolved")  # needs a default-pool thread
        return asyncio.run_coroutine_threadsafe(callback(), loop).result(timeout=5)

    monkeypatch.setattr(execution, "run_execution", fake_run_execution)
    own = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="execution")
    try:
        results = await asyncio.wait_for(asyncio.gather(
            execution.run_execution_async(own), execution.run_execution_async(own)), timeout=10)
    finally:
        own.shutdown(wait=False)
    assert results == ["resolved", "resolved"]
