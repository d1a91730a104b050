"""What the gateway holds of an execution and the rules it applies (pure): take-up from the log, the call
budget, sampling seeds, and the `call.refused` a refusal becomes."""

from __future__ import annotations

import pytest

from services.rollout.call_log import ExecutionSoFar
from services.rollout.errors import ApiError, CallBudgetSpent
from services.rollout.executions import (
    REFUSAL_CHARS,
    ExecutionState,
    check_budget,
    refusal,
    sampling_seed,
    settle,
)
from shared.calls import call_seed
from shared.events import ExecutionStarted


def _started(**kw) -> ExecutionStarted:
    return ExecutionStarted(execution_id="e", query_id="q", task_id="t", group_size=1, sample_index=0,
                            **{"seed": 7, "call_budget": 4, "cell_id": "cell-2", **kw})


def test_settling_an_execution_continues_its_seed_budget_and_calls_from_the_log() -> None:
    state = ExecutionState()
    taken = settle(state, ExecutionSoFar(started=_started(), calls=2, last_cell_id="cell-5"))
    assert (state.seed, state.max_calls, state.answered, state.settled) == (7, 4, 2, True)
    assert taken.cell_id == "cell-5" and taken.unusable_seed is None  # where its latest call ran
    assert settle(ExecutionState(), ExecutionSoFar(started=_started())).cell_id == "cell-2"  # where it was placed
    assert settle(ExecutionState(), ExecutionSoFar()).cell_id is None


def test_a_seed_the_log_holds_that_cannot_seed_calls_is_set_aside() -> None:
    state = ExecutionState()
    taken = settle(state, ExecutionSoFar(started=_started(seed=2**46)))
    assert state.seed is None and taken.unusable_seed == 2**46
    assert sampling_seed(state, None) is None


def test_calls_sample_with_their_own_seed_else_the_executions_for_their_index() -> None:
    state = ExecutionState(seed=7, answered=3)
    assert sampling_seed(state, None) == call_seed(7, 3)
    assert sampling_seed(state, 99) == 99


def test_the_call_past_the_budget_is_refused_and_its_refusal_says_the_budget_is_spent() -> None:
    state = ExecutionState(max_calls=2, answered=1)
    check_budget(state)
    state.answered = 2
    with pytest.raises(CallBudgetSpent, match="2 of 2 calls made") as err:
        check_budget(state)
    refused = refusal("e", err.value, api="openai", answered=state.answered)
    assert (refused.status, refused.kind, refused.budget_spent, refused.infra, refused.answered, refused.api) == (
        400, "invalid_request_error", True, False, 2, "openai")


def test_a_refusal_is_marked_infra_for_no_capacity_and_server_errors_and_keeps_a_bounded_reason() -> None:
    assert refusal("e", ApiError("rate_limit_error", "busy"), api="anthropic", answered=0).infra
    assert refusal("e", ApiError("overloaded_error", "busy"), api="anthropic", answered=0).infra
    long = refusal("e", ApiError("api_error", "x" * 5000), api="anthropic", answered=0)
    assert long.infra and len(long.reason) == REFUSAL_CHARS
    assert not refusal("e", ApiError("request_too_large", "big"), api="anthropic", answered=0).infra
