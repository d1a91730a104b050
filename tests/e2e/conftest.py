"""On a failed end-to-end test, the services' own logs go into the report: their warnings and errors and
their last lines, so a failure on a machine nobody can log in to still says what each service was doing."""

from __future__ import annotations

from pathlib import Path

import pytest


def service_log_digest(log_dir: Path, *, notable: int = 15, tail: int = 8) -> str:
    parts = []
    for log in sorted(log_dir.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        flagged = [line for line in lines if '"level": "error"' in line or '"level": "warning"' in line
                   or "Traceback" in line or "Error" in line]
        parts.append(f"==== {log.relative_to(log_dir)} ({len(lines)} lines, {len(flagged)} notable)")
        parts += [f"  ! {line[:400]}" for line in flagged[-notable:]]
        parts += [f"    {line[:400]}" for line in lines[-tail:]]
    return "\n".join(parts) or f"no service logs under {log_dir}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and tmp_path is not None:
        report.sections.append(("service logs", service_log_digest(Path(tmp_path) / "logs")))
    return None
