"""Tests for the generated task create-file-1; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_file_exists():
    assert (APP / 'hello.txt').is_file()


def test_file_content():
    assert (APP / 'hello.txt').read_text().strip() == 'hello world'
