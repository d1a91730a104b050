"""Tests for the generated task count-matches-3; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_count_file_exists():
    assert (APP / "count.txt").is_file()


def test_count_is_correct():
    assert (APP / "count.txt").read_text().strip() == "1"
