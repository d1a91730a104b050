"""Tests for the generated task sum-numbers-2; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_sum_file_exists():
    assert (APP / "sum.txt").is_file()


def test_sum_is_correct():
    assert (APP / "sum.txt").read_text().strip() == "100"


def test_input_untouched():
    assert (APP / "numbers.txt").read_text() == '10\n20\n30\n40\n'
