"""Grades repair-git-repo: config.ini restored and committed on top of the untouched history."""

import subprocess
from pathlib import Path

APP = Path("/app")
CONFIG = "[server]\nport = 8080\nhost = 0.0.0.0\n\n[database]\nurl = sqlite:///app.db\npool = 4\n"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=APP, capture_output=True, text=True, check=True).stdout


def test_config_restored_in_working_tree():
    assert (APP / "config.ini").read_text() == CONFIG


def test_config_committed_at_head():
    assert git("show", "HEAD:config.ini") == CONFIG


def test_history_kept_and_extended():
    subjects = git("log", "--format=%s", "main").splitlines()
    assert len(subjects) >= 4
    assert "cleanup: remove unused files" in subjects[1:]
    assert subjects[-1] == "initial application"


def test_cleanup_changes_kept():
    assert "notes.tmp" not in git("ls-tree", "--name-only", "HEAD").split()
    assert "Run with" in git("show", "HEAD:README.md")


def test_working_tree_clean():
    assert git("status", "--porcelain") == ""
