"""Tests for the generated task create-file-3; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_file_exists():
    assert (APP / 'note.txt').is_file()


def test_file_content():
    assert (APP / 'note.txt').read_text().strip() == 'gyre rocks'
