"""`gyre harness …` commands: check task folders, run reference solutions, run one execution by hand."""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path
from typing import Annotated

import typer

from services.harness.agent import AgentConfig, Budget
from services.harness.execution import BuiltinHarness, Harness, run_execution
from services.harness.external import ExternalHarness, GatewayAccess, claude_code
from services.harness.taskgen import write_family
from services.harness.taskrun import check_with_solution
from services.harness.tasks import TaskFormatError, discover_tasks, load_task

harness_app = typer.Typer(help="Tasks, sandboxes and executions of the harness service.", no_args_is_help=True)

BACKENDS = ("auto", "bwrap", "unshare", "docker")


def _backend(value: str) -> str:
    if value not in BACKENDS:
        raise typer.BadParameter(f"expected one of {', '.join(BACKENDS)}, got {value!r}")
    return value


Backend = Annotated[str, typer.Option(help="Sandbox backend: auto, bwrap, unshare or docker.", callback=_backend)]


def _load(task_dir: Path):  # type: ignore[no-untyped-def]
    try:
        return load_task(task_dir)
    except TaskFormatError as exc:
        typer.echo(f"invalid task: {exc}", err=True)
        raise typer.Exit(2) from exc


@harness_app.command("check-task")
def check_task(task_dir: Path) -> None:
    """Validate a task folder and print what the harness will use."""
    task = _load(task_dir)
    typer.echo(
        json.dumps(
            {
                "task_id": task.task_id,
                "workdir": task.workdir,
                "max_agent_timeout_sec": task.config.max_agent_timeout_sec,
                "max_test_timeout_sec": task.config.max_test_timeout_sec,
                "tests": "run-tests.sh" if task.run_tests else "tests/test_outputs.py",
                "solution": task.solution is not None,
                "setup": task.setup is not None,
                "workspace": task.workspace is not None,
            }
        )
    )


@harness_app.command("run-solution")
def run_solution_cmd(
    task_dir: Path,
    backend: Backend = "auto",
    no_solution: Annotated[bool, typer.Option("--no-solution", help="Grade the untouched workspace instead.")] = False,
) -> None:
    """Run a task's reference solution in a fresh sandbox and grade it (exit 0 when resolved)."""
    task = _load(task_dir)
    with tempfile.TemporaryDirectory(prefix="gyre-solution-") as tmp:
        graded = check_with_solution(task, Path(tmp) / "sandbox", backend=backend, apply_solution=not no_solution)
    typer.echo(json.dumps({"task_id": task.task_id, "score": graded.score, "resolved": graded.resolved, "source": graded.source, "detail": graded.detail}))
    raise typer.Exit(0 if graded.resolved else 1)


@harness_app.command("check-all")
def check_all(tasks_dir: Path = Path("tasks"), backend: Backend = "auto") -> None:
    """Every task must score 1.0 with its solution and < 1.0 untouched (the acceptance check)."""
    failures = 0
    with tempfile.TemporaryDirectory(prefix="gyre-check-") as tmp:
        for task in discover_tasks(tasks_dir):
            solved = check_with_solution(task, Path(tmp) / f"{task.task_id}-solved", backend=backend)
            untouched = check_with_solution(task, Path(tmp) / f"{task.task_id}-untouched", backend=backend, apply_solution=False)
            ok = solved.score == 1.0 and untouched.score < 1.0
            failures += not ok
            typer.echo(f"{'ok  ' if ok else 'FAIL'} {task.task_id:28s} solution={solved.score:.2f} untouched={untouched.score:.2f}")
    raise typer.Exit(1 if failures else 0)


@harness_app.command("gen-tasks")
def gen_tasks(out: Path = Path("tasks")) -> None:
    """(Re)write the generated family of simple tasks."""
    for folder in write_family(out):
        typer.echo(str(folder))


@harness_app.command("run")
def run_cmd(
    task_dir: Path,
    base_url: Annotated[str, typer.Option(help="The gateway's URL, e.g. http://127.0.0.1:8400 (its GYRE_ROLLOUT_PORT)")],
    token: Annotated[str, typer.Option(help="The execution's token")],
    model: Annotated[str, typer.Option(help="The served model's name")],
    harness: Annotated[str, typer.Option(help="builtin, claude-code, or command")] = "builtin",
    command: Annotated[str | None, typer.Option(help="For --harness command: a bash command line; the task text is in $GYRE_INSTRUCTION")] = None,
    claude_code_dir: Annotated[Path | None, typer.Option(help="Folder holding node_modules/@anthropic-ai/claude-code")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Where the sandbox's state (the preserved work) goes")] = None,
    max_calls: Annotated[int | None, typer.Option(help="Call budget")] = None,
    wall_clock_s: Annotated[float | None, typer.Option(help="Wall-clock budget (capped by the task's)")] = None,
    backend: Backend = "auto",
) -> None:
    """Run one execution of a task against a gateway and print the outcome and score."""
    task = _load(task_dir)
    chosen: Harness
    match harness:
        case "builtin":
            chosen = BuiltinHarness(agent=AgentConfig(model=model))
        case "claude-code":
            if claude_code_dir is None:
                raise typer.BadParameter("--claude-code-dir is required for --harness claude-code")
            chosen = claude_code(claude_code_dir, model)
        case "command":
            if not command:
                raise typer.BadParameter("--command is required for --harness command")
            chosen = ExternalHarness(name="command", command=("bash", "-c", command))
        case other:
            raise typer.BadParameter(f"unknown harness {other!r}: expected builtin, claude-code or command")
    execution_id = f"execution-{uuid.uuid4().hex[:12]}"
    state = state_dir or Path(tempfile.mkdtemp(prefix="gyre-exec-")) / execution_id
    result = run_execution(
        execution_id=execution_id,
        task=task,
        harness=chosen,
        gateway=GatewayAccess(base_url=base_url, token=token, model=model),
        state_dir=state,
        budget=Budget(max_calls=max_calls, wall_clock_s=wall_clock_s),
        backend=backend,
    )
    typer.echo(result.model_dump_json(exclude={"agent": {"call_log"}}))
