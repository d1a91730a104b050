"""What every generated task folder shares: its test runner, its tests' header, and how its files are written."""

from __future__ import annotations

from pathlib import Path

RUN_TESTS = """#!/bin/bash
# Runs the task's tests against the working directory; pytest's -rA summary is what gets scored.
cd "${WORKDIR:-/app}"
python -P -m pytest -rA -p no:cacheprovider "$TEST_DIR/test_outputs.py"
"""

TEST_HEADER = '''"""Tests for the generated task {task_id}; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")
'''

Files = dict[str, str]


def write_task(folder: Path, files: Files) -> Path:
    """Write one task folder's files (scripts executable); returns the folder."""
    for relative, text in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if relative.endswith(".sh"):
            path.chmod(0o755)
    return folder
