"""The slow tests' times beside what they take on an idle machine of the project's kind, printed at the end of every
run. A loaded or slower machine makes every test slower by about the same factor; a regression makes one test far
slower than that factor. The table says which, so a slow CI run can be told from a test that got slower.

The expectations are tests/expected_times.json: seconds per test (setup, call and teardown), measured with
`make test` on an idle 2-core machine. `--record-times FILE` writes this run's times in the same form, to update it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

EXPECTED = Path(__file__).with_name("expected_times.json")
LISTED_FROM_S = 20.0  # a test expected, or found, to take at least this long is listed
RECORDED_FROM_S = 10.0  # and one of at least this long is recorded by --record-times
OFF_FACTOR = 1.5  # a test slower than the run's typical factor by this much is named as off


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-times", metavar="FILE", default=None,
                     help="write each test's time (of those over %g s) as JSON, the form of %s" % (
                         RECORDED_FROM_S, EXPECTED.name))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller sees every worker's reports; a worker reports to it
        config.pluginmanager.register(Timing(config), "gyre-timing")


def cpu_ticks() -> tuple[int, int]:
    """The machine's busy and idle CPU time since boot (Linux /proc/stat), in clock ticks; (0, 0) elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, idle


class Timing:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.started = time.monotonic()
        self.ticks = cpu_ticks()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        expected: dict[str, float] = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}
        for line in timing_lines(dict(self.seconds), expected, machine=self.machine()):
            terminalreporter.write_line(line)
        if path := self.config.getoption("--record-times"):
            record = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= RECORDED_FROM_S}
            Path(path).write_text(json.dumps(record, indent=1) + "\n")
            terminalreporter.write_line(f"test times written to {path}")

    def machine(self) -> str:
        busy0, idle0 = self.ticks
        busy1, idle1 = cpu_ticks()
        share = (busy1 - busy0) / max(1, (busy1 - busy0) + (idle1 - idle0))
        return (f"{os.cpu_count()} cores, {share:.0%} busy on average over the "
                f"{time.monotonic() - self.started:.0f} s of the run")


def timing_lines(seconds: dict[str, float], expected: dict[str, float], *, machine: str) -> list[str]:
    """The table: each long test's expected and actual seconds and their ratio, then the run's typical ratio and the
    tests far off it."""
    listed = sorted((n for n in seconds if max(seconds[n], expected.get(n, 0.0)) >= LISTED_FROM_S),
                    key=lambda n: -seconds[n])
    if not listed:
        return []
    ratios = {n: seconds[n] / expected[n] for n in listed if expected.get(n)}
    typical = statistics.median(ratios.values()) if ratios else None
    lines = ["", f"slow tests: expected on an idle 2-core machine (tests/{EXPECTED.name}) and here ({machine})",
             f"{'expected s':>10} {'actual s':>9} {'ratio':>6}  test"]
    for n in listed:
        ratio = f"{ratios[n]:.2f}" if n in ratios else "new"
        flag = "  <- off" if typical and n in ratios and ratios[n] > typical * OFF_FACTOR else ""
        lines.append(f"{expected.get(n, 0.0):>10.0f} {seconds[n]:>9.0f} {ratio:>6}  {n}{flag}")
    if typical is not None:
        off = [n for n in ratios if ratios[n] > typical * OFF_FACTOR]
        lines.append(f"typical ratio {typical:.2f} over {len(ratios)} tests: "
                     + ("the machine's pace, no test far off it" if not off else
                        f"{len(off)} test(s) over {OFF_FACTOR}x it, a regression or a test that waited on something"))
    return lines
