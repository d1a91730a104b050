"""`gyre harness …` commands: check task folders, run reference solutions, run one execution by hand."""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.harness.agent_core import AgentConfig, Branch, Budget
from services.harness.call_account import CallAccount, call_account
from services.harness.outcomes import AgentStopped
from services.harness.sandbox_spec import SandboxError
from services.harness.sandboxes import BACKEND_NAMES
from services.harness.task_images import BaseImageMap, TaskImageError
from services.harness.taskgen import write_family
from services.harness.taskrun import TaskSetupError, check_with_solution
from services.harness.tasks import Task, TaskFormatError, load_task, scan_tasks
from shared.events import stream_id_for
from shared.execution_tokens import derive_execution_token, execution_named_by, execution_of_token

if TYPE_CHECKING:
    from services.harness.execution import Harness

harness_app = typer.Typer(help="Tasks, sandboxes and executions of the harness service.", no_args_is_help=True)


def _backend(value: str) -> str:
    if value not in BACKEND_NAMES:
        raise typer.BadParameter(f"expected one of {', '.join(BACKEND_NAMES)}, got {value!r}")
    return value


Backend = Annotated[str, typer.Option(help="Sandbox backend: auto, bwrap, unshare or docker.", callback=_backend)]


def _base_images(value: str) -> str:
    try:
        BaseImageMap.parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return value


BaseImages = Annotated[str, typer.Option(
    envvar="GYRE_HARNESS_BASE_IMAGES", callback=_base_images,
    help="Docker backend: where each FROM comes from, ref=image,...,*=default (default: *=gyre-base:bookworm).")]


def _load(task_dir: Path) -> Task:
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
    base_images: BaseImages = "",
) -> None:
    """Run a task's reference solution in a fresh sandbox and grade it (exit 0 when resolved)."""
    task = _load(task_dir)
    with tempfile.TemporaryDirectory(prefix="gyre-solution-") as tmp:
        try:
            graded = check_with_solution(task, Path(tmp) / "sandbox", backend=backend, apply_solution=not no_solution,
                                         base_images=BaseImageMap.parse(base_images))
        except (TaskImageError, SandboxError, TaskSetupError) as exc:
            typer.echo(f"cannot run {task.task_id}: {' '.join(str(exc).split())}", err=True)
            raise typer.Exit(2) from exc
    typer.echo(json.dumps({"task_id": task.task_id, "score": graded.score, "resolved": graded.resolved, "source": graded.source, "detail": graded.detail}))
    raise typer.Exit(0 if graded.resolved else 1)


@harness_app.command("check-all")
def check_all(tasks_dir: Path = Path("tasks"), backend: Backend = "auto", base_images: BaseImages = "") -> None:
    """Every task must score 1.0 with its solution and < 1.0 untouched (the acceptance check); a task that cannot
    be loaded or run is reported with its reason (BAD) and the rest are checked."""
    tasks, malformed = scan_tasks(tasks_dir)
    for name, problem in malformed.items():
        typer.echo(f"BAD  {name:28s} {problem}")
    failures = len(malformed)
    images = BaseImageMap.parse(base_images)
    with tempfile.TemporaryDirectory(prefix="gyre-check-") as tmp:
        for task in tasks:
            try:
                solved = check_with_solution(task, Path(tmp) / f"{task.task_id}-solved", backend=backend,
                                             base_images=images)
                untouched = check_with_solution(task, Path(tmp) / f"{task.task_id}-untouched", backend=backend,
                                                apply_solution=False, base_images=images)
            except (TaskImageError, SandboxError, TaskSetupError) as exc:
                failures += 1
                typer.echo(f"BAD  {task.task_id:28s} {' '.join(str(exc).split())}")
                continue
            ok = solved.score == 1.0 and untouched.score < 1.0
            failures += not ok
            typer.echo(f"{'ok  ' if ok else 'FAIL'} {task.task_id:28s} solution={solved.score:.2f} untouched={untouched.score:.2f}")
    raise typer.Exit(1 if failures else 0)


@harness_app.command("record-claude-code")
def record_claude_code(
    install_dir: Annotated[Path, typer.Option(help="Folder holding node_modules/@anthropic-ai/claude-code")] = Path(
        ".cache/claude-code"),
    tools: Annotated[str, typer.Option(help="The built-in tools it offers, comma-separated (its --tools); "
                                            "empty: its default set")] = "",
) -> None:
    """Record the installed Claude Code's first request (the fixture the run plan sizes the context from and the
    warm start builds its demonstrations on), with its default tools or `--tools`."""
    from services.harness.claude_code_request import record_first_request, recording_path, save_recording
    from shared.settings import split_names

    chosen = split_names(tools)
    recording = record_first_request(install_dir, tools=chosen)
    path = recording_path(chosen)
    save_recording(recording, path)
    request = recording["request"]
    typer.echo(f"Claude Code {recording['version']}: {len(request.get('tools', []))} tools, "
               f"{len(json.dumps(request)):,} bytes -> {path}")


@harness_app.command("gen-tasks")
def gen_tasks(out: Path = Path("tasks")) -> None:
    """(Re)write the generated family of simple tasks."""
    for folder in write_family(out):
        typer.echo(str(folder))


class StoredCallAccount:
    """Reads the execution's call account from the event store when an external agent exits, as the service does."""

    def __init__(self, database_url: str, schema: str | None, execution_id: str) -> None:
        self.database_url, self.schema, self.execution_id = database_url, schema, execution_id

    def branched(self, branch: Branch) -> None:
        return None

    def agent_stopped(self, stopped: AgentStopped) -> None:
        return None

    def call_account(self) -> CallAccount | None:
        from shared.store import EventStore

        async def read() -> CallAccount:
            store = await EventStore.connect(self.database_url, schema=self.schema)
            try:
                stored = await store.read_stream(stream_id_for("execution", self.execution_id))
            finally:
                await store.close()
            return call_account(item.event.data for item in stored)

        try:
            return asyncio.run(read())
        except Exception as exc:  # the check is advice: without it the exit is the agent's own
            typer.echo(f"warning: the calls of {self.execution_id} could not be read from the log: {exc}", err=True)
            return None


def _execution_token(execution_id: str, token: str | None, secret: str | None) -> str:
    """The token given, checked against the execution id when the secret is known, or derived from the secret."""
    if token is None:
        if not secret:
            raise typer.BadParameter("expected --token, or --token-secret to derive the execution's token from")
        return derive_execution_token(secret.encode(), execution_id)
    if secret and execution_of_token(secret.encode(), token) != execution_id:
        raise typer.BadParameter(f"--token was not derived for execution {execution_id!r} with --token-secret")
    return token


@harness_app.command("run")
def run_cmd(
    task_dir: Path,
    base_url: Annotated[str, typer.Option(help="The gateway's URL, e.g. http://127.0.0.1:8400 (its GYRE_ROLLOUT_PORT)")],
    model: Annotated[str, typer.Option(help="The served model's name")],
    execution_id: Annotated[str | None, typer.Option(
        help="The execution's id: the gateway records its calls on this execution's stream (default: a fresh id)")] = None,
    token: Annotated[str | None, typer.Option(help="The execution's token (default: derived with --token-secret)")] = None,
    token_secret: Annotated[str | None, typer.Option(
        help="The gateway's token secret: derives the token for --execution-id, or checks --token against it",
        envvar=["GYRE_HARNESS_GATEWAY_TOKEN_SECRET", "GYRE_ROLLOUT_TOKEN_SECRET"], show_envvar=False)] = None,
    database_url: Annotated[str | None, typer.Option(
        help="The event store: with it, an external agent's exit is read with the calls the gateway recorded "
             "(infrastructure refusal, spent call budget)", envvar="GYRE_DATABASE_URL", show_envvar=False)] = None,
    db_schema: Annotated[str | None, typer.Option(help="The event store's schema", envvar="GYRE_DB_SCHEMA",
                                                  show_envvar=False)] = None,
    harness: Annotated[str, typer.Option(help="builtin, claude-code, or command")] = "builtin",
    command: Annotated[str | None, typer.Option(help="For --harness command: a bash command line; the task text is in $GYRE_INSTRUCTION")] = None,
    claude_code_dir: Annotated[Path | None, typer.Option(help="Folder holding node_modules/@anthropic-ai/claude-code")] = None,
    claude_code_tools: Annotated[str, typer.Option(help="The built-in tools Claude Code offers, comma-separated "
                                                        "(its --tools); empty: its default set")] = "",
    state_dir: Annotated[Path | None, typer.Option(help="Where the sandbox's state (the preserved work) goes")] = None,
    max_calls: Annotated[int | None, typer.Option(help="Call budget")] = None,
    wall_clock_s: Annotated[float | None, typer.Option(help="Wall-clock budget (capped by the task's)")] = None,
    backend: Backend = "auto",
) -> None:
    """Run one execution of a task against a gateway and print the outcome and score."""
    # The agent and its SDK load here, not with the CLI: `--help` answers without them.
    from services.harness.execution import BuiltinHarness, run_execution
    from services.harness.external_harness import ExternalHarness, GatewayAccess, claude_code
    from shared.settings import split_names

    task = _load(task_dir)
    chosen: Harness
    match harness:
        case "builtin":
            chosen = BuiltinHarness(agent=AgentConfig(model=model))
        case "claude-code":
            if claude_code_dir is None:
                raise typer.BadParameter("--claude-code-dir is required for --harness claude-code")
            chosen = claude_code(claude_code_dir.resolve(), model, tools=split_names(claude_code_tools))
        case "command":
            if not command:
                raise typer.BadParameter("--command is required for --harness command")
            chosen = ExternalHarness(name="command", command=("bash", "-c", command))
        case other:
            raise typer.BadParameter(f"unknown harness {other!r}: expected builtin, claude-code or command")
    if execution_id is None and token is not None:
        # A token the run derived names its execution: its calls are recorded, and read back, on that stream.
        execution_id = execution_named_by(token)
        if execution_id is None and database_url:
            raise typer.BadParameter("--execution-id is required with a --token that names no execution when the "
                                     "calls are read from the log")
    if execution_id is None:
        execution_id = f"execution-{uuid.uuid4().hex[:12]}"
    execution_token = _execution_token(execution_id, token, token_secret)
    state = state_dir or Path(tempfile.mkdtemp(prefix="gyre-exec-")) / execution_id
    result = run_execution(
        execution_id=execution_id,
        task=task,
        harness=chosen,
        gateway=GatewayAccess(base_url=base_url, token=execution_token, model=model),
        state_dir=state,
        budget=Budget(max_calls=max_calls, wall_clock_s=wall_clock_s),
        backend=backend,
        observer=StoredCallAccount(database_url, db_schema, execution_id) if database_url else None,
    )
    typer.echo(result.model_dump_json(exclude={"agent": {"call_log"}}))
