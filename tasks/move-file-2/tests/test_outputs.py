"""Tests for the generated task move-file-2; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_directory_exists():
    assert (APP / 'backup').is_dir()


def test_file_moved_with_content():
    assert (APP / 'backup' / 'data.csv').read_text() == 'keep me: move-file-2\n'


def test_original_gone():
    assert not (APP / 'data.csv').exists()
