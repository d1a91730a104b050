"""Tests for the generated task uppercase-1; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_out_file_exists():
    assert (APP / "out.txt").is_file()


def test_out_is_upper_case():
    assert (APP / "out.txt").read_text().strip() == 'MAKE THIS LOUD'
