"""Grades parse-logs-report: each key of /app/report.json against values computed from the shipped log."""

import json
from pathlib import Path

APP = Path("/app")


def report():
    return json.loads((APP / "report.json").read_text())


def test_report_is_json_object():
    assert isinstance(report(), dict)


def test_total_requests():
    assert report()["total_requests"] == 60


def test_status_counts():
    assert report()["status_counts"] == {"200": 35, "301": 7, "302": 4, "404": 8, "500": 6}


def test_top_path():
    assert report()["top_path"] == "/login"


def test_unique_ips():
    assert report()["unique_ips"] == 6


def test_error_rate():
    assert abs(report()["error_rate"] - 0.1) < 1e-9
