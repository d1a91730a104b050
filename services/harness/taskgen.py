"""Generates the parameterised family of simple file/shell tasks under tasks/ (deterministic, no clock).

Run `python -m services.harness.taskgen tasks/` to (re)write them; each family is a function from
parameters to a task folder's files, so the tiny model in the RL demo sees many variants of one skill.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from services.harness.task_files import RUN_TESTS, TEST_HEADER, Files, write_task


def _task_yaml(instruction: str, family: str, difficulty: str = "easy") -> str:
    lines = [
        "instruction: |-",
        *("  " + line for line in instruction.splitlines()),
        "author_name: Gyre",
        f"difficulty: {difficulty}",
        "category: file-operations",
        f"family: {family}",
        "tags: [generated, simple]",
        "parser_name: pytest",
        "max_agent_timeout_sec: 120",
        "max_test_timeout_sec: 60",
        "",
    ]
    return "\n".join(lines)


def create_file(task_id: str, name: str, text: str) -> Files:
    return {
        "task.yaml": _task_yaml(f"Create a file named {name} in /app containing exactly this text: {text}", "create-file"),
        "solution.sh": f"#!/bin/bash\nprintf '%s\\n' {shlex.quote(text)} > /app/{name}\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_file_exists():
    assert (APP / {name!r}).is_file()


def test_file_content():
    assert (APP / {name!r}).read_text().strip() == {text!r}
""",
    }


def sum_numbers(task_id: str, numbers: list[int]) -> Files:
    total = sum(numbers)
    content = "".join(f"{n}\n" for n in numbers)
    return {
        "task.yaml": _task_yaml(
            "The file /app/numbers.txt contains one integer per line. "
            "Write their sum (just the number) to /app/sum.txt.",
            "sum-numbers",
        ),
        "workspace/numbers.txt": content,
        "solution.sh": "#!/bin/bash\nawk '{s+=$1} END {print s}' /app/numbers.txt > /app/sum.txt\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_sum_file_exists():
    assert (APP / "sum.txt").is_file()


def test_sum_is_correct():
    assert (APP / "sum.txt").read_text().strip() == "{total}"


def test_input_untouched():
    assert (APP / "numbers.txt").read_text() == {content!r}
""",
    }


def count_matches(task_id: str, word: str, lines: list[str]) -> Files:
    count = sum(1 for line in lines if word in line)
    return {
        "task.yaml": _task_yaml(
            f"Count how many lines of /app/log.txt contain the word {word} "
            f"and write that count (just the number) to /app/count.txt.",
            "count-matches",
        ),
        "workspace/log.txt": "".join(f"{line}\n" for line in lines),
        "solution.sh": f"#!/bin/bash\ngrep -c {shlex.quote(word)} /app/log.txt > /app/count.txt\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_count_file_exists():
    assert (APP / "count.txt").is_file()


def test_count_is_correct():
    assert (APP / "count.txt").read_text().strip() == "{count}"
""",
    }


def uppercase(task_id: str, text: str) -> Files:
    return {
        "task.yaml": _task_yaml(
            "Write the contents of /app/in.txt converted to upper case into /app/out.txt.", "uppercase"
        ),
        "workspace/in.txt": text + "\n",
        "solution.sh": "#!/bin/bash\ntr '[:lower:]' '[:upper:]' < /app/in.txt > /app/out.txt\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_out_file_exists():
    assert (APP / "out.txt").is_file()


def test_out_is_upper_case():
    assert (APP / "out.txt").read_text().strip() == {text.upper()!r}
""",
    }


def sort_lines(task_id: str, words: list[str]) -> Files:
    return {
        "task.yaml": _task_yaml(
            "Sort the lines of /app/names.txt alphabetically and write them to /app/sorted.txt, one per line.",
            "sort-lines",
        ),
        "workspace/names.txt": "".join(f"{w}\n" for w in words),
        "solution.sh": "#!/bin/bash\nLC_ALL=C sort /app/names.txt > /app/sorted.txt\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_sorted_file_exists():
    assert (APP / "sorted.txt").is_file()


def test_lines_are_sorted():
    assert (APP / "sorted.txt").read_text().split() == {sorted(words)!r}
""",
    }


def move_file(task_id: str, name: str, folder: str) -> Files:
    content = f"keep me: {task_id}\n"
    return {
        "task.yaml": _task_yaml(f"Create a directory /app/{folder} and move /app/{name} into it.", "move-file"),
        f"workspace/{name}": content,
        "solution.sh": f"#!/bin/bash\nmkdir -p /app/{folder} && mv /app/{name} /app/{folder}/\n",
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id)
        + f"""

def test_directory_exists():
    assert (APP / {folder!r}).is_dir()


def test_file_moved_with_content():
    assert (APP / {folder!r} / {name!r}).read_text() == {content!r}


def test_original_gone():
    assert not (APP / {name!r}).exists()
""",
    }


def _families() -> Iterator[tuple[str, Callable[..., Files], dict[str, object]]]:
    for i, (name, text) in enumerate(
        [("hello.txt", "hello world"), ("greeting.txt", "good morning"), ("note.txt", "gyre rocks"), ("answer.txt", "42")]
    ):
        yield f"create-file-{i + 1}", create_file, {"name": name, "text": text}
    for i, numbers in enumerate([[3, 5, 8], [10, 20, 30, 40], [7, -2, 15, 100, 1]]):
        yield f"sum-numbers-{i + 1}", sum_numbers, {"numbers": numbers}
    logs = [
        ("ERROR", ["INFO start", "ERROR disk full", "INFO retry", "ERROR disk full again", "INFO done"]),
        ("WARN", ["WARN low memory", "INFO ok", "INFO ok", "WARN high load", "WARN slow", "ERROR crash"]),
        ("timeout", ["request ok", "request timeout", "request ok", "request ok"]),
    ]
    for i, (word, lines) in enumerate(logs):
        yield f"count-matches-{i + 1}", count_matches, {"word": word, "lines": lines}
    for i, text in enumerate(["make this loud", "shell tasks are fun"]):
        yield f"uppercase-{i + 1}", uppercase, {"text": text}
    for i, words in enumerate([["pear", "apple", "fig", "banana"], ["zeta", "alpha", "mu", "delta", "beta"]]):
        yield f"sort-lines-{i + 1}", sort_lines, {"words": words}
    for i, (name, folder) in enumerate([("report.txt", "archive"), ("data.csv", "backup")]):
        yield f"move-file-{i + 1}", move_file, {"name": name, "folder": folder}
    from services.harness import projects  # the long-horizon family

    for task_id, params in projects.shipped():
        yield task_id, projects.project, params


def write_family(root: Path) -> list[Path]:
    """Write every generated task folder under root, replacing files it owns; returns the folders."""
    written = []
    for task_id, family, params in _families():
        folder = root / task_id
        files = family(task_id, **params)
        files["run-tests.sh"] = RUN_TESTS
        files["params.json"] = json.dumps(params, sort_keys=True) + "\n"
        written.append(write_task(folder, files))
    return written


if __name__ == "__main__":
    for folder in write_family(Path(sys.argv[1] if len(sys.argv) > 1 else "tasks")):
        print(folder)
