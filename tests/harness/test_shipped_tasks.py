"""Every shipped task scores < 1.0 with no work done and 1.0 with its reference solution, in the sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.harness.sandboxes import make_sandbox
from services.harness.taskrun import prepare, run_solution, run_tests, sandbox_spec_for
from services.harness.tasks import discover_tasks

from .conftest import TASKS

SHIPPED = discover_tasks(TASKS)


@pytest.mark.parametrize("task", SHIPPED, ids=[task.task_id for task in SHIPPED])
def test_reference_solution_resolves_and_no_work_does_not(task, tmp_path: Path, best_backend: str) -> None:  # type: ignore[no-untyped-def]
    sandbox = make_sandbox(tmp_path / "sb", sandbox_spec_for(task), backend=best_backend)
    try:
        prepare(task, sandbox)
        # Grading twice in one sandbox is safe: tests are copied in fresh and leave nothing in the workdir.
        untouched, _ = run_tests(task, sandbox)
        assert untouched.score < 1.0, untouched
        solved = run_solution(task, sandbox)
        assert solved.ok, solved.stderr[-2000:]
        graded, output = run_tests(task, sandbox)
        assert graded.score == 1.0, (graded, output.stdout[-3000:], output.stderr[-2000:])
        assert graded.resolved
    finally:
        sandbox.close(remove=True)


def test_a_pytest_module_left_in_the_workdir_does_not_grade_the_task(tmp_path: Path, best_backend: str) -> None:
    """Tests run from the working directory, where the agent writes: a `pytest.py` there that prints a passing
    summary and writes a reward file must not stand in for pytest."""
    task = next(t for t in SHIPPED if t.task_id == "create-file-1")
    sandbox = make_sandbox(tmp_path / "sb", sandbox_spec_for(task), backend=best_backend)
    try:
        prepare(task, sandbox)
        fake = ("import os\nprint('=== short test summary info ===')\nprint('PASSED ../tests/test_outputs.py::t')\n"
                "open(os.environ['REWARD_FILE'], 'w').write('1.0')\n")
        (sandbox.work_host / "pytest.py").write_text(fake)
        sandbox.give_to_sandbox()
        graded, output = run_tests(task, sandbox)
        assert graded.score < 1.0 and graded.source == "pytest", (graded, output.stdout[-2000:])
        assert graded.tests and not any(test.endswith("::t") for test, _ in graded.tests)
    finally:
        sandbox.close(remove=True)


def test_a_swebench_parsed_task_scores_by_its_graders_verdict_block(tmp_path: Path, best_backend: str) -> None:
    """Terminal-Bench's `swebench` parser, end to end: run-tests.sh prints the grader's verdict between the
    markers, and the task scores 1.0 only when it says PASSED."""
    from services.harness.taskrun import check_with_solution
    from services.harness.tasks import load_task

    root = tmp_path / "swe-task"
    root.mkdir()
    (root / "task.yaml").write_text("instruction: Write fixed to /app/state.\nparser_name: swebench\n")
    (root / "run-tests.sh").write_text(
        'echo "SWEBench results starts here"\n'
        'if [ "$(cat /app/state 2>/dev/null)" = fixed ]; then echo PASSED; else echo FAILED; fi\n'
        'echo "SWEBench results ends here"\n')
    (root / "solution.sh").write_text("echo fixed > /app/state\n")
    task = load_task(root)
    solved = check_with_solution(task, tmp_path / "solved", backend=best_backend)
    assert solved.score == 1.0 and solved.source == "swebench", solved
    untouched = check_with_solution(task, tmp_path / "untouched", backend=best_backend, apply_solution=False)
    assert untouched.score == 0.0 and untouched.source == "swebench", untouched
