"""Tests for the generated task project-2; run by run-tests.sh after the agent stops."""

from pathlib import Path

APP = Path("/app")


def test_m1():
    path = APP / "src" / "m1.txt"
    assert path.is_file() and path.read_text().strip() == '65'


def test_m2():
    path = APP / "src" / "m2.txt"
    assert path.is_file() and path.read_text().strip() == 'lake\nwater\nzebra'


def test_m3():
    path = APP / "src" / "m3.txt"
    assert path.is_file() and path.read_text().strip() == 'cloud\ngreen\ntree\nwater'


def test_m4():
    path = APP / "src" / "m4.txt"
    assert path.is_file() and path.read_text().strip() == 'CLOUD DELTA RIVER'


def test_m5():
    path = APP / "src" / "m5.txt"
    assert path.is_file() and path.read_text().strip() == 'TREE PAPER'


def test_m6():
    path = APP / "src" / "m6.txt"
    assert path.is_file() and path.read_text().strip() == '1'
