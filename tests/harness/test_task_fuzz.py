"""Generated malformed task folders: every one loads or is refused with a one-line TaskFormatError naming the
file (never another exception), and a checker reports the bad ones and checks the rest."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from services.harness.cli import harness_app
from services.harness.tasks import TaskFormatError, load_task, scan_tasks
from tests.hostile import json_values

VALID = {"instruction": "Make the tests pass.", "max_agent_timeout_sec": 60, "parser_name": "pytest",
         "tags": ["x"], "workdir": "/app"}
yaml_values = json_values(text_size=20, max_leaves=8)
task_yamls = (
    st.binary(max_size=200)  # anything, not UTF-8 included
    | st.text(max_size=200).map(str.encode)  # any text (mostly not YAML mappings)
    | yaml_values.map(lambda v: yaml.safe_dump(v).encode())
    | st.builds(lambda key, value: yaml.safe_dump({**VALID, key: value}).encode(),
                st.sampled_from([*VALID, "parser_name", "difficulty", "author_email"]), yaml_values)
    | st.integers(100, 5000).map(lambda n: ("a: " + "[" * n + "]" * n).encode())  # nested past any stack
    | st.just(b"instruction: [unclosed\n  - x\n: y")
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=task_yamls, tests=st.sampled_from(["run-tests.sh", "tests/test_outputs.py", None]),
       workspace=st.sampled_from(["dir", "file", None]), dockerfile=st.none() | st.binary(max_size=80))
def test_any_task_folder_loads_or_is_named_in_one_line(content: bytes, tests: str | None, workspace: str | None,
                                                       dockerfile: bytes | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="gyre-fuzz-")) / "task-x"
    try:
        root.mkdir()
        (root / "task.yaml").write_bytes(content)
        if tests is not None:
            (root / tests).parent.mkdir(exist_ok=True)
            (root / tests).write_text("true\n")
        if workspace == "dir":
            (root / "workspace").mkdir()
        elif workspace == "file":
            (root / "workspace").write_text("not a folder")
        if dockerfile is not None:
            (root / "Dockerfile").write_bytes(dockerfile)
        try:
            task = load_task(root)
        except TaskFormatError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(str(root)), message
            assert exc.problem.strip()
        else:
            assert task.instruction.strip() and task.workdir.startswith("/")
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def test_check_all_reports_a_malformed_task_and_checks_the_rest(tmp_path: Path) -> None:
    good = tmp_path / "good"
    (good / "tests").mkdir(parents=True)
    (good / "task.yaml").write_text(yaml.safe_dump({"instruction": "Write ok to out.txt."}))
    (good / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\ndef test_ok():\n    assert Path('/app/out.txt').read_text().strip() == 'ok'\n")
    (good / "solution.sh").write_text("echo ok > /app/out.txt\n")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "task.yaml").write_bytes(b"instruction: \xff\xfe not utf-8")
    swe = tmp_path / "swe"
    swe.mkdir()
    (swe / "task.yaml").write_text(yaml.safe_dump({"instruction": "Fix it.", "parser_name": "swebench"}))
    tasks, problems = scan_tasks(tmp_path)
    assert [t.task_id for t in tasks] == ["good"] and sorted(problems) == ["bad", "swe"]
    result = CliRunner().invoke(harness_app, ["check-all", "--tasks-dir", str(tmp_path), "--backend", "auto"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert any(line.startswith("BAD  bad") and "not UTF-8" in line for line in lines), lines
    assert any(line.startswith("BAD  swe") and "parser_name" in line for line in lines), lines
    assert any(line.startswith("ok   good") for line in lines), lines
    assert result.exception is None or isinstance(result.exception, SystemExit)
