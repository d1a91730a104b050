"""Tests for the generated task move-file-1; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_directory_exists():
    assert (APP / 'archive').is_dir()


def test_file_moved_with_content():
    assert (APP / 'archive' / 'report.txt').read_text() == 'keep me: move-file-1\n'


def test_original_gone():
    assert not (APP / 'report.txt').exists()
