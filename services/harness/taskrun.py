"""Task lifecycle in a sandbox: lay out the workspace, run setup.sh, run the reference solution, grade.

Tests reach the sandbox only at grading: a fresh copy is bound at /tests for that one command, so
nothing the agent wrote can stand in for them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.harness.grading import GradeResult, grade
from services.harness.sandbox import Sandbox, chown_tree
from services.harness.sandbox_spec import Bind, ExecResult, SandboxSpec
from services.harness.sandboxes import make_sandbox
from services.harness.task_images import BaseImageMap, environment_for
from services.harness.tasks import TEST_DIR, Task

LOGS_DIR = "/logs"
REWARD_FILE = f"{LOGS_DIR}/verifier/reward.txt"
_TASK_FILES = "/gyre-task"
# -P: the working directory is not put on sys.path, so a `pytest.py` the agent left there cannot stand in for pytest.
DEFAULT_TEST_COMMAND = f"python -P -m pytest -rA -p no:cacheprovider {TEST_DIR}/test_outputs.py"


class TaskSetupError(RuntimeError):
    """setup.sh failed, so the task cannot start; the message carries its output."""


def sandbox_spec_for(task: Task, base: SandboxSpec | None = None) -> SandboxSpec:
    """The sandbox spec for a task: the base spec with the task's working directory."""
    base = base or SandboxSpec()
    return base.model_copy(update={"workdir": task.workdir})


def open_sandbox(
    task: Task,
    state_dir: Path,
    *,
    backend: str = "auto",
    spec: SandboxSpec | None = None,
    gateway_url: str | None = None,
    base_images: BaseImageMap | None = None,
) -> Sandbox:
    """The sandbox a task runs in: under Docker in the task's own image (built once per content of its
    environment, FROM lines mapped through `base_images`) beside its side services; else over the host."""
    environment = environment_for(task, base_images) if backend == "docker" else None
    return make_sandbox(state_dir, sandbox_spec_for(task, spec), backend=backend, gateway_url=gateway_url,
                        environment=environment)


def prepare(task: Task, sandbox: Sandbox) -> None:
    """Copy workspace/ into the working directory and run setup.sh (if any) inside the sandbox."""
    if task.workspace is not None:
        shutil.copytree(task.workspace, sandbox.work_host, dirs_exist_ok=True, symlinks=True)
    sandbox.give_to_sandbox()
    if task.setup is not None:
        result = sandbox.exec(
            ["bash", f"{_TASK_FILES}/setup.sh"],
            timeout_s=task.config.max_test_timeout_sec,
            binds=[Bind(host=task.setup, inside=f"{_TASK_FILES}/setup.sh")],
        )
        if not result.ok:
            raise TaskSetupError(
                f"{task.setup}: expected exit 0, got {result.exit_code} (timed out: {result.timed_out}); "
                f"stderr: {result.stderr[-2000:]}"
            )


def run_solution(task: Task, sandbox: Sandbox) -> ExecResult:
    """Run the task's reference solution.sh in the working directory."""
    if task.solution is None:
        raise FileNotFoundError(f"{task.root}: expected a solution.sh, found none")
    return sandbox.exec(
        ["bash", f"{_TASK_FILES}/solution.sh"],
        timeout_s=task.config.max_agent_timeout_sec,
        binds=[Bind(host=task.solution, inside=f"{_TASK_FILES}/solution.sh")],
    )


def run_tests(task: Task, sandbox: Sandbox) -> tuple[GradeResult, ExecResult]:
    """Copy the tests in (fresh), run them against the preserved work, and score the result."""
    tests_host = sandbox.state_dir / "grading" / "tests"
    logs_host = sandbox.state_dir / "grading" / "logs"
    for folder in (tests_host, logs_host):
        shutil.rmtree(folder, ignore_errors=True)
    tests_host.mkdir(parents=True)
    (logs_host / "verifier").mkdir(parents=True)
    if task.tests_dir is not None:
        shutil.copytree(task.tests_dir, tests_host, dirs_exist_ok=True)
    if task.run_tests is not None:
        shutil.copyfile(task.run_tests, tests_host / "run-tests.sh")
        command: str = f"bash {TEST_DIR}/run-tests.sh"
    else:
        command = DEFAULT_TEST_COMMAND
    chown_tree(tests_host.parent, sandbox.uid)
    result = sandbox.exec(
        command,
        timeout_s=task.config.max_test_timeout_sec,
        # Entry-point plugins of the host's Python cost seconds per run and tests need none of them.
        env={"TEST_DIR": TEST_DIR, "REWARD_FILE": REWARD_FILE, "WORKDIR": task.workdir, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        binds=[
            Bind(host=tests_host, inside=TEST_DIR, read_only=False),
            Bind(host=logs_host, inside=LOGS_DIR, read_only=False),
        ],
    )
    reward_text = read_inside_file(logs_host, logs_host / "verifier" / "reward.txt")
    graded = grade(result.stdout + "\n" + result.stderr, reward_text, parser=task.config.parser_name)
    if result.timed_out:
        graded = graded.model_copy(update={"detail": (graded.detail + "; tests timed out").lstrip("; ")})
    return graded, result


def read_inside_file(root: Path, path: Path, limit: int = 4096) -> str | None:
    """Read a file the sandbox could have tampered with: never through a link that leaves `root`."""
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        return None
    if not resolved.is_relative_to(root.resolve()) or not resolved.is_file():
        return None
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(limit).decode(errors="replace")


def check_with_solution(
    task: Task, state_dir: Path, *, backend: str = "auto", spec: SandboxSpec | None = None, apply_solution: bool = True,
    base_images: BaseImageMap | None = None,
) -> GradeResult:
    """Fresh sandbox, optional reference solution, grade; the sandbox's state folder is removed after."""
    sandbox = open_sandbox(task, state_dir, backend=backend, spec=spec, base_images=base_images)
    try:
        prepare(task, sandbox)
        if apply_solution:
            run_solution(task, sandbox)
        graded, _ = run_tests(task, sandbox)
        return graded
    finally:
        sandbox.close(remove=True)
