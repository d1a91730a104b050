"""Task-folder loading: valid folders load with their defaults; bad task.yaml is named with its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.harness.tasks import DEFAULT_WORKDIR, TaskFormatError, discover_tasks, load_task

from .conftest import TASKS


def write_task(root: Path, yaml_text: str | None, *, tests: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if yaml_text is not None:
        (root / "task.yaml").write_text(yaml_text)
    if tests:
        (root / "tests").mkdir(exist_ok=True)
        (root / "tests" / "test_outputs.py").write_text("def test_ok():\n    assert True\n")
    return root


def test_valid_task_loads_with_terminal_bench_defaults(tmp_path: Path) -> None:
    task = load_task(write_task(tmp_path / "t", "instruction: do it\nunknown_tb_field: 3\n"))
    assert task.instruction == "do it"
    assert task.workdir == DEFAULT_WORKDIR
    assert task.config.max_agent_timeout_sec == 360.0
    assert task.run_tests is None and task.tests_dir is not None
    assert task.solution is None and task.setup is None


def test_workdir_comes_from_the_dockerfile_when_task_yaml_has_none(tmp_path: Path) -> None:
    root = write_task(tmp_path / "t", "instruction: x\n")
    (root / "Dockerfile").write_text("FROM debian\nWORKDIR /srv\nWORKDIR /srv/project\n")
    assert load_task(root).workdir == "/srv/project"


def test_missing_task_yaml_names_the_file(tmp_path: Path) -> None:
    root = write_task(tmp_path / "t", None)
    with pytest.raises(TaskFormatError) as info:
        load_task(root)
    assert str(root / "task.yaml") in str(info.value)
    assert "missing" in str(info.value)


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("max_agent_timeout_sec: 10\n", "instruction"),
        ("instruction: '   '\n", "instruction"),
        ("instruction: x\nmax_agent_timeout_sec: -5\n", "max_agent_timeout_sec"),
        ("instruction: x\nmax_test_timeout_sec: soon\n", "max_test_timeout_sec"),
        ("instruction: x\nworkdir: relative/dir\n", "workdir"),
        ("instruction: x\nparser_name: junit\n", "parser_name"),
        ("instruction: x\nparser_name: mlebench\n", "parser_name"),
        ("instruction: x\nparser_name: swebench\n", "parser_name"),  # without the run-tests.sh that prints it
    ],
)
def test_invalid_task_yaml_names_file_and_field(tmp_path: Path, yaml_text: str, field: str) -> None:
    root = write_task(tmp_path / "t", yaml_text)
    with pytest.raises(TaskFormatError) as info:
        load_task(root)
    assert info.value.field == field
    assert str(root / "task.yaml") in str(info.value) and f"'{field}'" in str(info.value)


def test_task_yaml_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="mapping"):
        load_task(write_task(tmp_path / "t", "- just\n- a list\n"))


def test_unparseable_yaml_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="YAML"):
        load_task(write_task(tmp_path / "t", "instruction: [unclosed\n"))


def test_task_without_any_tests_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError) as info:
        load_task(write_task(tmp_path / "t", "instruction: x\n", tests=False))
    assert info.value.field == "tests"


def test_shipped_tasks_are_at_least_twenty_all_with_solutions() -> None:
    tasks = discover_tasks(TASKS)
    assert len(tasks) >= 20
    assert all(task.solution is not None for task in tasks)
    families = {task.config.family for task in tasks if task.config.family}
    assert len(families) >= 5
    realistic = [task for task in tasks if "realistic" in task.config.tags]
    assert len(realistic) >= 5


def test_generated_family_matches_the_generator(tmp_path: Path) -> None:
    from services.harness.taskgen import write_family

    for folder in write_family(tmp_path):
        shipped = TASKS / folder.name
        for path in folder.rglob("*"):
            if path.is_file():
                relative = path.relative_to(folder)
                assert (shipped / relative).read_text() == path.read_text(), f"tasks/{folder.name}/{relative} is stale"
