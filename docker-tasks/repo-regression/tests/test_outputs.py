"""Grades repo-regression: touching ranges merge again, the library's tests pass, and the fix is a commit on
top of the history the image prepared."""

import subprocess
import sys

APP = "/app"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", APP, *args], capture_output=True, text=True, check=True).stdout.strip()


def test_touching_ranges_merge() -> None:
    sys.path.insert(0, APP)
    from intervals import merge

    assert merge([(1, 3), (3, 5)]) == [(1, 5)]
    assert merge([(7, 8), (1, 3), (3, 3), (4, 5)]) == [(1, 3), (4, 5), (7, 8)]
    assert merge([(2, 4), (0, 2), (4, 6)]) == [(0, 6)]


def test_library_tests_pass() -> None:
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=APP,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:]


def test_history_kept_and_fix_committed() -> None:
    subjects = _git("log", "--format=%s").splitlines()
    assert subjects[-2:] == ["intervals: tidy the merge loop", "intervals: merge overlapping ranges"]
    assert len(subjects) >= 3
    assert _git("status", "--porcelain", "--untracked-files=no") == ""
