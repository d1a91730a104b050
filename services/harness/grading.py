"""Grading core: turn a test run's output (pytest -rA summary or a reward file) into a score. Pure."""

from __future__ import annotations

import math
import re
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class TestOutcome(str, Enum):
    __test__ = False  # not a pytest class
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"


class GradeResult(BaseModel):
    """The grader's verdict for one execution: score in [0, 1], resolved when it is 1.0."""

    model_config = ConfigDict(frozen=True)

    score: float = Field(ge=0.0, le=1.0)
    tests: tuple[tuple[str, TestOutcome], ...] = ()
    source: str  # "pytest", "reward-file", "swebench" or "none"
    detail: str = ""

    @property
    def resolved(self) -> bool:
        return self.score >= 1.0

    @property
    def passed(self) -> int:
        return sum(1 for _, outcome in self.tests if outcome is TestOutcome.PASSED)


class RewardFileError(ValueError):
    """A reward file did not hold one number in [0, 1]."""


_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+\s*$")
# A test id runs to its parametrize brackets' end (ids may hold spaces there), then " - reason" may follow.
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED)\s+([^\s\[]+(?:\[.*?\](?=\s+-\s|\s*$))?)")
_OUTCOME = {
    "PASSED": TestOutcome.PASSED,
    "XPASS": TestOutcome.PASSED,
    "FAILED": TestOutcome.FAILED,
    "ERROR": TestOutcome.ERROR,
    # An expected failure that failed is what the test author wanted.
    "XFAIL": TestOutcome.PASSED,
    "SKIPPED": TestOutcome.SKIPPED,
}


def parse_pytest_summary(output: str) -> tuple[tuple[str, TestOutcome], ...]:
    """Read the `-rA` short summary: one (test id, outcome) per test, last word wins per id."""
    lines = output.splitlines()
    start = 0
    for index, line in enumerate(lines):
        if _SUMMARY_HEADER.match(line):
            start = index + 1
    results: dict[str, TestOutcome] = {}
    for line in lines[start:]:
        match = _SUMMARY_LINE.match(line)
        if match is None:
            continue
        word, test_id = match.groups()
        if word == "SKIPPED":
            continue
        outcome = _OUTCOME[word]
        # A test that passed its call but errored in teardown is reported twice: the error counts.
        if results.get(test_id) in (TestOutcome.FAILED, TestOutcome.ERROR):
            continue
        results[test_id] = outcome
    return tuple(results.items())


def score_tests(tests: tuple[tuple[str, TestOutcome], ...]) -> float:
    counted = [outcome for _, outcome in tests if outcome is not TestOutcome.SKIPPED]
    if not counted:
        return 0.0
    return sum(1 for outcome in counted if outcome is TestOutcome.PASSED) / len(counted)


def grade_pytest_output(output: str) -> GradeResult:
    tests = parse_pytest_summary(output)
    if not tests:
        return GradeResult(score=0.0, source="none", detail="no pytest results in the test output")
    return GradeResult(score=score_tests(tests), tests=tests, source="pytest")


def parse_reward(text: str) -> float:
    """A reward file holds one float in [0, 1]."""
    stripped = text.strip()
    try:
        value = float(stripped)
    except ValueError as exc:
        raise RewardFileError(f"expected one number in [0, 1], got {stripped[:80]!r}") from exc
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise RewardFileError(f"expected one number in [0, 1], got {value}")
    return value


SWEBENCH_START = "SWEBench results starts here"
SWEBENCH_END = "SWEBench results ends here"


def grade_swebench_output(output: str) -> GradeResult:
    """Terminal-Bench's `swebench` parser: the tests print the SWE-bench grader's verdict between two marker
    lines; the task is resolved (1.0) when that block is exactly PASSED, else 0.0 (one test, named `tests`).
    The last block counts, so an earlier one the agent's code printed cannot stand in for the grader's."""
    start, end = output.rfind(SWEBENCH_START), output.rfind(SWEBENCH_END)
    if start < 0 or end < start:
        return GradeResult(score=0.0, source="none", detail="no SWE-bench result block in the test output")
    passed = output[start + len(SWEBENCH_START) : end].strip() == "PASSED"
    return GradeResult(score=1.0 if passed else 0.0, source="swebench",
                       tests=(("tests", TestOutcome.PASSED if passed else TestOutcome.FAILED),))


def grade(test_output: str, reward_text: str | None, parser: str = "pytest") -> GradeResult:
    """The task's `parser_name` says what scores it, and only that counts. `pytest`: the pytest summary; a
    reward file is ignored (the agent's own code runs during the tests, e.g. a script the tests call, and can
    write one). `reward`: the reward file the checker writes; a pytest summary in its output is not it.
    `swebench`: the SWE-bench grader's verdict block, all or nothing."""
    if parser == "swebench":
        return grade_swebench_output(test_output)
    if parser != "reward":
        return grade_pytest_output(test_output)
    if reward_text is None:
        return GradeResult(score=0.0, source="none", detail="parser_name is reward and no reward file was written")
    try:
        score = parse_reward(reward_text)
    except RewardFileError as exc:
        return GradeResult(score=0.0, source="none", detail=f"reward file: {exc}")
    return GradeResult(score=score, tests=parse_pytest_summary(test_output), source="reward-file")
