"""`gyre run`'s launcher: option checks before anything starts, the learnable task set, and restarting a
service that dies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared import launcher
from shared.cli import _mount, app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "fixed"], "--mode must be elastic, async or colocate"),
        (["--slip-rate", "1.5"], "--slip-rate must be a fraction"),
        (["--warm-start", "/nonexistent/model"], "not a model directory"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    _mount("run")  # what `gyre run` does before typer parses the command line
    result = CliRunner().invoke(app, ["run", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in result.output


def test_learnable_tasks_are_the_shipped_tasks_of_the_family() -> None:
    tasks = launcher.learnable_tasks()
    assert len(tasks) == len(set(tasks)) == 10
    # Interleaved: consecutive tasks (one step's queries) come from different families.
    families = [t.rsplit("-", 1)[0] for t in tasks]
    assert families[:4] == sorted(launcher.LEARNABLE_FAMILIES)
    assert all(a != b for a, b in zip(families, families[1:]))
    assert {t.rsplit("-", 1)[0] for t in tasks} == set(launcher.LEARNABLE_FAMILIES)
    assert all((Path("tasks") / t / "task.yaml").is_file() for t in tasks)


def test_a_process_that_dies_is_started_again_until_the_limit(tmp_path: Path) -> None:
    proc = launcher.Proc("flaky", [sys.executable, "-c", "import sys; print('up'); sys.exit(3)"])
    proc.start({}, tmp_path)
    proc.popen.wait()
    for n in range(1, launcher.MAX_RESTARTS + 1):
        launcher._restart(proc, {}, tmp_path)  # noqa: SLF001 - the supervisor's one step
        assert proc.restarts == n
        proc.popen.wait()
    with pytest.raises(RuntimeError, match="flaky exited \\(3\\) 4 times"):
        launcher._restart(proc, {}, tmp_path)  # noqa: SLF001
    assert (tmp_path / "flaky.log").read_text().count("up") == launcher.MAX_RESTARTS + 1


def test_strays_of_a_run_are_reaped_and_no_other_process() -> None:
    import os
    import subprocess

    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "GYRE_RUN_ID": "run-stray-test"}, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "GYRE_RUN_ID": "run-stray-test-2"})
    try:
        assert launcher.reap_strays("run-stray-test") == [mine.pid]
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_each_run_gets_its_own_block_of_cell_ports(tmp_path: Path) -> None:
    import socket

    from shared.local import free_port_block

    base = free_port_block(3)
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    env = launcher.loop_environment(
        run_id="r", nats_url="nats://x", database_url="postgresql://x", model_dir=tmp_path, run_dir=tmp_path,
        mode="async", steps=1, group_size=2, max_staleness=1, seed=0, task_ids=["t"], gateway_port=1, cells=2,
    )
    assert int(env["GYRE_CELL_HEALTH_PORT_BASE"]) >= 20000 and env["GYRE_CELL_COUNT"] == "2"
