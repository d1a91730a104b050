"""Tests for the generated task project-9; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_m1():
    path = APP / "src" / "m1.txt"
    assert path.is_file() and path.read_text().strip() == 'CLOUD PAPER GYRE'


def test_m2():
    path = APP / "src" / "m2.txt"
    assert path.is_file() and path.read_text().strip() == '50'


def test_m3():
    path = APP / "src" / "m3.txt"
    assert path.is_file() and path.read_text().strip() == '201'
