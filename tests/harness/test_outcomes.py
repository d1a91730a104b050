"""How an agent's end is classified: finished, timed out on a budget, or stopped by the infrastructure (which
keeps the execution out of training)."""

from __future__ import annotations

import pytest

from services.harness.agent_core import AgentOutcome
from services.harness.call_account import CallAccount
from services.harness.external_harness import ExternalOutcome
from services.harness.outcomes import agent_stopped, external_stopped


def exited(code: int | None, *, timed_out: bool = False) -> ExternalOutcome:
    return ExternalOutcome(exit_code=code, timed_out=timed_out, elapsed_s=2.0, stdout_tail="", stderr_tail="")


ANSWERED = CallAccount(answered=2, completed=2)


@pytest.mark.parametrize(("status", "expected"), [
    ("submitted", ("finished", None)), ("ended", ("finished", None)), ("timed_out", ("timed_out", "wall_clock")),
    ("calls_exhausted", ("timed_out", "calls")), ("error", ("error", None)),
])
def test_the_built_in_agents_own_status_decides_its_end(status: str, expected: tuple[str, str | None]) -> None:
    stopped = agent_stopped(AgentOutcome(status=status, calls=3, elapsed_s=1.0, infra_failure=status == "error"))  # type: ignore[arg-type]
    assert (stopped.status, stopped.budget) == expected and stopped.calls == 3
    assert stopped.infra_failure == (status == "error")


def test_an_external_agent_out_of_wall_clock_timed_out_whatever_its_calls_say() -> None:
    stopped = external_stopped(exited(None, timed_out=True), CallAccount(refused=1, last_infra_refusal="500 x: y"))
    assert (stopped.status, stopped.budget, stopped.infra_failure) == ("timed_out", "wall_clock", False)


def test_a_refusal_for_the_spent_call_budget_ends_it_timed_out_on_calls_whatever_the_exit() -> None:
    for code in (0, 1):
        stopped = external_stopped(exited(code), CallAccount(answered=2, completed=2, refused=1, budget_spent=True))
        assert (stopped.status, stopped.budget, stopped.calls) == ("timed_out", "calls", 2)


def test_a_non_zero_exit_after_an_infrastructure_refusal_is_the_infrastructures_failure() -> None:
    stopped = external_stopped(exited(1), CallAccount(answered=1, completed=1, refused=1,
                                                       last_infra_refusal="503 api_error: no worker"))
    assert stopped.status == "error" and stopped.infra_failure
    assert stopped.stop_reason == "exit 1 after the model API refused its last call: 503 api_error: no worker"


def test_a_non_zero_exit_with_no_recorded_call_is_the_infrastructures_failure() -> None:
    """The gateway never recorded a call of it (unreachable, or a token it could not verify): the policy made no
    decision, so the grade of the untouched work must not train it."""
    stopped = external_stopped(exited(2), CallAccount())
    assert stopped.status == "error" and stopped.infra_failure and stopped.calls == 0
    assert stopped.stop_reason == "exit 2 before the gateway recorded any model call of it"


@pytest.mark.parametrize("account", [ANSWERED, None], ids=["after-an-answer", "account-unknown"])
def test_a_non_zero_exit_after_an_answer_or_without_an_account_is_the_agents_own(account: CallAccount | None) -> None:
    stopped = external_stopped(exited(3), account)
    assert (stopped.status, stopped.stop_reason, stopped.infra_failure) == ("finished", "exit 3", False)
    assert stopped.calls == (account.answered if account else None)


def test_a_clean_exit_is_a_finish_even_with_no_recorded_call() -> None:
    """An agent that says it is done is graded on its work, whether or not it asked the model."""
    stopped = external_stopped(exited(0), CallAccount())
    assert (stopped.status, stopped.stop_reason, stopped.infra_failure) == ("finished", "exit 0", False)
