"""Grades csv-revenue-summary: header, regions in order, and each region's revenue."""

from pathlib import Path

APP = Path("/app")
EXPECTED = {"east": "27.50", "north": "74.99", "south": "99.98", "west": "30.00"}


def lines():
    return (APP / "summary.csv").read_text().strip().splitlines()


def test_header():
    assert lines()[0].strip() == "region,revenue"


def test_regions_sorted():
    assert [line.split(",")[0] for line in lines()[1:]] == sorted(EXPECTED)


def test_revenues():
    assert dict(line.strip().split(",") for line in lines()[1:]) == EXPECTED
