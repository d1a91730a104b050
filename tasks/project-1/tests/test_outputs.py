"""Tests for the generated task project-1; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_m1():
    path = APP / "src" / "m1.txt"
    assert path.is_file() and path.read_text().strip() == '260'


def test_m2():
    path = APP / "src" / "m2.txt"
    assert path.is_file() and path.read_text().strip() == 'bird\nmoon\nstone'


def test_m3():
    path = APP / "src" / "m3.txt"
    assert path.is_file() and path.read_text().strip() == '2'
