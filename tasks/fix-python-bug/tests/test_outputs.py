"""Grades fix-python-bug: the module is fixed (checked on fresh cases) and the project's tests are unchanged."""

import hashlib
import subprocess
import sys
from pathlib import Path

APP = Path("/app")
ORIGINAL_TESTS_SHA256 = "9336502d9d6f0d6487f941a4768fd96f8efcf0116f0ceddd5b879de45eec5dbe"


def _stats():
    sys.path.insert(0, str(APP))
    import stats

    return stats


def test_project_tests_unchanged():
    assert hashlib.sha256((APP / "test_stats.py").read_bytes()).hexdigest() == ORIGINAL_TESTS_SHA256


def test_project_tests_pass():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_stats.py"], cwd=APP, capture_output=True
    )
    assert result.returncode == 0, result.stdout.decode()[-2000:]


def test_median_even_fresh_cases():
    stats = _stats()
    assert stats.median([10, 20]) == 15
    assert stats.median([1, 2, 3, 4, 5, 6]) == 3.5


def test_variance_fresh_cases():
    stats = _stats()
    assert stats.variance([1, 1, 1]) == 0
    assert stats.variance([1, 3]) == 1
