"""Tests for the generated task sort-lines-2; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_sorted_file_exists():
    assert (APP / "sorted.txt").is_file()


def test_lines_are_sorted():
    assert (APP / "sorted.txt").read_text().split() == ['alpha', 'beta', 'delta', 'mu', 'zeta']
