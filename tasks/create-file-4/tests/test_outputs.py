"""Tests for the generated task create-file-4; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_file_exists():
    assert (APP / 'answer.txt').is_file()


def test_file_content():
    assert (APP / 'answer.txt').read_text().strip() == '42'
