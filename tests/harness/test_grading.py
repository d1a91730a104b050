"""Grading core: pytest -rA summaries and reward files become scores in [0, 1]."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.harness.grading import TestOutcome, grade, grade_pytest_output, parse_pytest_summary

SAMPLE = """\
============================= test session starts ==============================
collected 3 items

../tests/test_outputs.py .F.                                             [100%]

=================================== FAILURES ===================================
PASSED something that is not in the summary
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_a
FAILED ../tests/test_outputs.py::test_b - assert 1 == 2
PASSED ../tests/test_outputs.py::test_c
========================= 1 failed, 2 passed in 0.02s ==========================
"""


def test_summary_lines_give_fraction_passed() -> None:
    result = grade_pytest_output(SAMPLE)
    assert result.score == 2 / 3
    assert result.source == "pytest"
    assert dict(result.tests)["../tests/test_outputs.py::test_b"] is TestOutcome.FAILED
    assert not result.resolved


def test_teardown_error_after_pass_counts_as_error() -> None:
    text = "=== short test summary info ===\nPASSED t.py::a\nERROR t.py::a - teardown boom\nPASSED t.py::b\n"
    assert dict(parse_pytest_summary(text))["t.py::a"] is TestOutcome.ERROR
    assert grade_pytest_output(text).score == 0.5


def test_parametrized_ids_with_spaces_are_separate_tests() -> None:
    """pytest keeps spaces inside parametrize ids; reading the id to the first space merged three tests into one
    failure (0.0 where one of three passed)."""
    text = ("=== short test summary info ===\nPASSED t.py::test_x[a b]\n"
            "FAILED t.py::test_x[a c] - assert 'a c' == 'a b'\nFAILED t.py::test_x[a d] - AssertionError: x - y\n")
    result = grade_pytest_output(text)
    assert [t for t, _ in result.tests] == ["t.py::test_x[a b]", "t.py::test_x[a c]", "t.py::test_x[a d]"]
    assert result.score == 1 / 3


def test_a_reward_parser_task_without_a_reward_file_scores_zero() -> None:
    """`parser_name: reward` says the checker writes the reward: a pytest summary elsewhere in the output is not it."""
    result = grade(SAMPLE, None, parser="reward")
    assert result.score == 0.0 and result.source == "none" and "reward file" in result.detail
    assert grade(SAMPLE, None).score == 2 / 3


def test_collection_error_scores_zero() -> None:
    text = "=== short test summary info ===\nERROR ../tests/test_outputs.py - ModuleNotFoundError\n"
    assert grade_pytest_output(text).score == 0.0


def test_no_results_scores_zero_with_reason() -> None:
    result = grade_pytest_output("bash: python: command not found\n")
    assert result.score == 0.0 and result.source == "none" and "no pytest results" in result.detail


def test_only_the_tasks_parser_scores_it() -> None:
    """A reward file scores a `parser_name: reward` task; a pytest task ignores one (code the agent wrote runs
    during its tests and could write it)."""
    result = grade(SAMPLE, "0.25\n", parser="reward")
    assert result.score == 0.25 and result.source == "reward-file"
    result = grade(SAMPLE, "1.0\n", parser="pytest")
    assert result.score == 2 / 3 and result.source == "pytest"


def test_bad_reward_file_scores_zero_with_reason() -> None:
    for text in ("lots", "1.5", "nan", "-0.1"):
        result = grade("", text, parser="reward")
        assert result.score == 0.0 and "reward file" in result.detail


outcomes = st.sampled_from(["PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"])


@given(st.lists(outcomes, max_size=30))
def test_score_is_fraction_of_counted_tests(words: list[str]) -> None:
    lines = ["=== short test summary info ==="] + [f"{w} t.py::test_{i}" for i, w in enumerate(words)]
    result = grade_pytest_output("\n".join(lines) + "\n")
    counted = [w for w in words if w != "SKIPPED"]
    passed = [w for w in counted if w in ("PASSED", "XFAIL", "XPASS")]
    expected = len(passed) / len(counted) if counted else 0.0
    assert result.score == expected
    assert 0.0 <= result.score <= 1.0
    assert result.resolved == (bool(counted) and len(passed) == len(counted))


def test_the_swebench_parser_reads_the_last_verdict_block_all_or_nothing() -> None:
    from services.harness.grading import SWEBENCH_END, SWEBENCH_START

    def block(verdict: str) -> str:
        return f"{SWEBENCH_START}\n{verdict}\n{SWEBENCH_END}\n"

    passed = grade("noise\n" + block("PASSED"), None, parser="swebench")
    assert passed.score == 1.0 and passed.source == "swebench" and passed.tests == (("tests", TestOutcome.PASSED),)
    assert grade(block("FAILED"), None, parser="swebench").score == 0.0
    # An earlier block (the agent's own code printing one) does not stand in for the grader's, printed last.
    assert grade(block("PASSED") + block("FAILED"), None, parser="swebench").score == 0.0
    missing = grade(SAMPLE, "1.0", parser="swebench")
    assert missing.score == 0.0 and missing.source == "none" and "no SWE-bench result block" in missing.detail
    assert grade(f"{SWEBENCH_END}\n{SWEBENCH_START}\nPASSED\n", None, parser="swebench").score == 0.0
