"""`gyre run`'s launcher: option checks before anything starts, the learnable task set, and restarting a
service that dies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gyre import launcher, processes
from gyre.cli import _mount, app
from gyre.config import RunConfig
from gyre.run_plan import LEARNABLE_FAMILIES, learnable_tasks, plan_run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "fixed"],
         "error: command line: scheduling.mode: Input should be 'elastic', 'async', 'colocate' or 'reprefill'"),
        (["--run-id", "a b"], "error: --run-id: expected letters, digits, - and _"),
        (["--slip-rate", "1.5"], "warm_start.slip_rate: Input should be less than or equal to 1"),
        (["--warm-start", "/nonexistent/model"], "error: warm_start.model: /nonexistent/model is not a model folder"),
        (["--group-size", "0"], "scheduling.group_size: Input should be greater than or equal to 1"),
        (["--steps", "0"], "scheduling.steps: Input should be greater than or equal to 1"),
        (["--timeout-s", "0"], "logging.timeout_s: Input should be greater than 0"),
        (["--tasks-dir", "/nonexistent/tasks"], "error: tasks.dir: /nonexistent/tasks is not a folder"),
        (["--task-ids", "sum-numbers-1,no-such-task"], "error: tasks.train: no-such-task"),
        (["--config", "/nonexistent/run.yaml"], "error: /nonexistent/run.yaml: no such config file"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args: list[str], message: str, tmp_path: Path) -> None:
    _mount("run")  # what `gyre run` does before typer parses the command line
    result = CliRunner().invoke(app, ["run", *args, "--set", f"logging.runs_dir={tmp_path}"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in result.output
    assert not any(tmp_path.iterdir())  # nothing started: no run folder


def test_learnable_tasks_are_the_shipped_tasks_of_the_family() -> None:
    tasks = learnable_tasks(Path("tasks"))
    assert len(tasks) == len(set(tasks)) == 10
    # Interleaved: consecutive tasks (one step's queries) come from different families.
    families = [t.rsplit("-", 1)[0] for t in tasks]
    assert families[:4] == sorted(LEARNABLE_FAMILIES)
    assert all(a != b for a, b in zip(families, families[1:]))
    assert {t.rsplit("-", 1)[0] for t in tasks} == set(LEARNABLE_FAMILIES)
    assert all((Path("tasks") / t / "task.yaml").is_file() for t in tasks)


def test_a_run_trains_on_the_tasks_it_is_given(tmp_path: Path) -> None:
    """`tasks.train` names the tasks (each must load); without it a folder must hold the shipped family."""
    given = plan_run(RunConfig.model_validate({"tasks": {"train": ["fix-python-bug", "repair-git-repo"]}}))
    assert given.task_ids == ["fix-python-bug", "repair-git-repo"] and given.errors == []
    assert plan_run(RunConfig()).task_ids == learnable_tasks(Path("tasks"))
    (tmp_path / "mine").mkdir()
    empty = plan_run(RunConfig.model_validate({"tasks": {"dir": str(tmp_path / "mine")}}))
    assert any(e.startswith("tasks.train: empty") for e in empty.errors)


def test_a_process_that_dies_is_started_again_until_the_limit(tmp_path: Path) -> None:
    proc = processes.Proc("flaky", [sys.executable, "-c", "import sys; print('up'); sys.exit(3)"])
    proc.start({}, tmp_path)
    proc.popen.wait()
    for n in range(1, processes.MAX_RESTARTS + 1):
        processes.restart(proc, {}, tmp_path)  # the supervisor's one step
        assert proc.restarts == n
        proc.popen.wait()
    with pytest.raises(RuntimeError, match="flaky exited \\(3\\) 4 times"):
        processes.restart(proc, {}, tmp_path)
    assert (tmp_path / "flaky.log").read_text().count("up") == processes.MAX_RESTARTS + 1


def test_strays_of_a_run_are_reaped_and_no_other_process() -> None:
    import os
    import subprocess

    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "GYRE_RUN_ID": "run-stray-test"}, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "GYRE_RUN_ID": "run-stray-test-2"})
    try:
        assert processes.reap_strays("run-stray-test") == [mine.pid]
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_engines_share_the_caches_the_environment_names_and_a_stopped_run_leaves_no_scratch_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's model-class inspection and torch inductor's kernels are keyed by their inputs: every run on the machine
    shares the folders the environment names (`make` names .cache/), else each run keeps its own. The run's scratch
    folder (its engines' IPC sockets) goes when the run is stopped."""
    def env(run_id: str) -> dict[str, str]:
        return launcher.loop_environment(
            run_id=run_id, nats_url="nats://x", database_url="postgresql://x", model_dir=tmp_path,
            run_dir=tmp_path / run_id, mode="async", steps=1, group_size=2, max_staleness=1, seed=0, task_ids=["t"],
            gateway_port=1, cells=2,
        )

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared" / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared" / "inductor"))
    one, two = env("run-cache-a"), env("run-cache-b")
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        assert one[name] == two[name] and Path(one[name]).is_dir()
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    own = env("run-cache-c")
    assert own["VLLM_CACHE_ROOT"] == str(tmp_path / "run-cache-c" / "cache" / "vllm")
    assert own["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "run-cache-c" / "cache" / "torchinductor")
    scratch = Path(own["TMPDIR"])
    assert scratch == processes.scratch_folder("run-cache-c") and scratch.is_dir() and len(str(scratch)) < 40
    (scratch / "engine.sock").write_text("")
    processes.stop_all([], "run-cache-c")
    assert not scratch.exists()
    for run_id in ("run-cache-a", "run-cache-b"):
        processes.stop_all([], run_id)


def test_each_run_gets_its_own_block_of_cell_ports(tmp_path: Path) -> None:
    import socket

    from gyre.local import free_port_block

    base = free_port_block(3)
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    env = launcher.loop_environment(
        run_id="r", nats_url="nats://x", database_url="postgresql://x", model_dir=tmp_path, run_dir=tmp_path,
        mode="async", steps=1, group_size=2, max_staleness=1, seed=0, task_ids=["t"], gateway_port=1, cells=2,
    )
    assert env["GYRE_CELL_COUNT"] == "2"
    block = int(env["GYRE_CELL_HEALTH_PORT_BASE"])
    for port in range(block, block + 4):  # the block the cells will serve on (worker and rank each) is free
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_gateway_and_harness_share_a_fresh_token_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness derives each execution's token and the gateway recognises it with the same secret, with no
    call between them: every run gets a fresh secret both read."""
    from services.harness.service import HarnessSettings

    monkeypatch.delenv("GYRE_ROLLOUT_TOKEN_SECRET", raising=False)
    monkeypatch.delenv("GYRE_HARNESS_GATEWAY_TOKEN_SECRET", raising=False)

    def env() -> dict[str, str]:
        return launcher.loop_environment(
            run_id="r", nats_url="nats://x", database_url="postgresql://x", model_dir=tmp_path, run_dir=tmp_path,
            mode="async", steps=1, group_size=2, max_staleness=1, seed=0, task_ids=["t"], gateway_port=1, cells=2,
        )

    first, second = env(), env()
    assert len(first["GYRE_ROLLOUT_TOKEN_SECRET"]) >= 32
    assert second["GYRE_ROLLOUT_TOKEN_SECRET"] != first["GYRE_ROLLOUT_TOKEN_SECRET"]
    assert "GYRE_ROLLOUT_ADMIN_TOKEN" not in first  # there is no internal API left to guard
    # A harness started by hand next to a gateway takes the gateway's secret when it is not given its own.
    monkeypatch.setenv("GYRE_ROLLOUT_TOKEN_SECRET", "t" * 32)
    assert HarnessSettings().gateway_token_secret == "t" * 32
    assert HarnessSettings().gateway_url == "http://127.0.0.1:8400"


def test_sigterm_stops_every_service_as_ctrl_c_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The services run in their own sessions; a SIGTERM to `gyre run` (a closed terminal, `timeout`, `kill`)
    must still stop them."""
    import os
    import signal

    from gyre import local

    repo_tasks = Path("tasks").resolve()
    (tmp_path / "tasks").symlink_to(repo_tasks)
    monkeypatch.chdir(tmp_path)
    stopped: list[str] = []
    monkeypatch.setattr(local, "up", lambda *a, **k: local.Endpoints("nats://x:1", "postgresql://x@y:2/z", True, True))
    monkeypatch.setattr(launcher, "start_all", lambda procs, env, log_dir: None)
    monkeypatch.setattr(launcher, "stop_all", lambda procs, run_id=None: stopped.append(run_id or ""))

    async def terminated(*args: object, **kwargs: object) -> list:
        os.kill(os.getpid(), signal.SIGTERM)
        import asyncio

        await asyncio.sleep(30)
        return []

    monkeypatch.setattr(launcher, "_watch", terminated)
    _mount("run")
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, ["run", "--sft-steps", "0", "--set", f"logging.runs_dir={tmp_path / 'runs'}"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 130, result.output
    assert len(stopped) == 1 and "interrupted" in result.output
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is gone with the run


def test_a_run_with_several_gateways_starts_one_process_each_and_tells_the_harness_of_all(tmp_path: Path) -> None:
    from gyre.config import RunConfig
    from gyre.processes import service_processes
    from gyre.run_plan import plan_run
    from services.harness.service import HarnessSettings
    from shared.gateways import gateway_urls

    config = RunConfig.model_validate({"scheduling": {"gateways": 3}})
    env = launcher.run_environment(config, run_id="r", nats_url="nats://x", database_url="postgresql://x",
                                   model_dir=tmp_path, run_dir=tmp_path, task_ids=["t"], gateway_port=8500,
                                   more_gateway_ports=[8501, 8502])
    assert env["GYRE_ROLLOUT_PORT"] == "8500"
    urls = gateway_urls(env["GYRE_HARNESS_GATEWAY_URL"])
    assert urls == ["http://127.0.0.1:8500", "http://127.0.0.1:8501", "http://127.0.0.1:8502"]
    assert HarnessSettings(gateway_url=env["GYRE_HARNESS_GATEWAY_URL"]).gateway_url.count(",") == 2
    procs = {p.name: p for p in service_processes("python", more_gateway_ports=[8501, 8502])}
    assert [n for n in procs if n.startswith("gateway")] == ["gateway", "gateway-1", "gateway-2"]
    assert procs["gateway"].env == {}  # the run's first gateway: the port of the run's environment, no id
    assert procs["gateway-2"].env == {"GYRE_ROLLOUT_PORT": "8502", "GYRE_ROLLOUT_GATEWAY_ID": "2"}
    assert procs["gateway-1"].argv == procs["gateway"].argv
    assert sum("gateway" in p for p in plan_run(config).processes) == 3


def test_the_warm_starts_progress_bar_follows_the_trainers_step_lines_and_the_log_keeps_everything(tmp_path):
    import io
    import os

    from rich.console import Console
    from rich.progress import Progress

    from gyre.warm_start import _follow, _sft_progress

    script = ("echo loading; echo 'sft_step {\"step\": 1, \"steps\": 3, \"loss\": 2.5}'; "
              "echo 'sft_step {\"step\": 2, \"steps\": 3, \"loss\": 1.25}'; echo 'sft_step not json'")
    sink = io.BytesIO()
    with Progress(console=Console(file=io.StringIO())) as progress:
        task = progress.add_task("sft", total=99, loss="")
        code = _follow(["bash", "-c", script], dict(os.environ), sink,
                       lambda line: _sft_progress(progress, task, line))
        state = progress.tasks[0]
    assert code == 0 and (state.completed, state.total, state.fields["loss"]) == (2, 3, "loss 1.250")
    assert sink.getvalue().decode().splitlines()[0] == "loading" and b"not json" in sink.getvalue()


def test_the_live_view_says_a_cell_is_loading_its_model_and_for_how_long():
    """A first start takes minutes on CPUs (the model loads, the engine starts): the live view says so and
    counts the seconds, so it does not look like a hang; a later switch says it is switching."""
    from datetime import UTC, datetime, timedelta

    from rich.console import Console

    from shared.events import CellAssigned, CellReady, new_event

    def at(data, seconds_ago: float):
        return new_event(data, run_id="r", stream_id=f"cell-{data.cell_id}", version=1,
                         occurred_at=datetime.now(UTC) - timedelta(seconds=seconds_ago))

    def rendered(events) -> str:
        console = Console(width=200, record=True)
        console.print(launcher._view(events, [], steps=3, elapsed=1.0))
        return console.export_text()

    starting = [at(CellAssigned(cell_id="c0", role="rollout", policy="elastic", reason="start"), 42)]
    assert "rollout (first start: loading the model, 42 s)" in rendered(starting)
    ready = starting + [at(CellReady(cell_id="c0", role="rollout", switch_seconds=40.0), 2)]
    assert "│ rollout " in rendered(ready) and "loading" not in rendered(ready)
    moving = ready + [at(CellAssigned(cell_id="c0", role="train", policy="elastic", reason="backlog"), 3)]
    assert "train (switching, 3 s)" in rendered(moving)
