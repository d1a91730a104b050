"""Tests for the generated task create-file-2; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_file_exists():
    assert (APP / 'greeting.txt').is_file()


def test_file_content():
    assert (APP / 'greeting.txt').read_text().strip() == 'good morning'
