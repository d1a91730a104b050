"""The `gyre harness` commands, driven through typer's runner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from services.harness.cli import harness_app

from .conftest import TASKS

runner = CliRunner()


def test_check_task_prints_the_task_summary() -> None:
    result = runner.invoke(harness_app, ["check-task", str(TASKS / "repair-git-repo")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["workdir"] == "/app" and summary["setup"] is True and summary["solution"] is True


def test_check_task_rejects_a_bad_folder_naming_file_and_field(tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("instruction: x\nmax_test_timeout_sec: -1\n")
    result = runner.invoke(harness_app, ["check-task", str(tmp_path)])
    assert result.exit_code == 2
    assert "task.yaml" in result.output and "max_test_timeout_sec" in result.output


def test_run_solution_resolves_and_untouched_does_not(best_backend: str) -> None:
    solved = runner.invoke(harness_app, ["run-solution", str(TASKS / "uppercase-1"), "--backend", best_backend])
    assert solved.exit_code == 0, solved.output
    assert json.loads(solved.output)["score"] == 1.0
    untouched = runner.invoke(harness_app, ["run-solution", str(TASKS / "uppercase-1"), "--backend", best_backend, "--no-solution"])
    assert untouched.exit_code == 1
    assert json.loads(untouched.output)["score"] < 1.0
