"""The account of an external agent's calls, folded from its execution's stream: what tells an agent that stopped
on its own from one the infrastructure stopped."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.harness.call_account import call_account
from shared.calls import CALL_RECORD_MEDIA_TYPE
from shared.events import BlobRef, CallCompleted, CallRefused, ExecutionStarted


def answered(index: int) -> CallCompleted:
    return CallCompleted(execution_id="e", call_id=f"c{index}", call_index=index,
                         record=BlobRef(digest="sha256:" + "0" * 64, size=1, media_type=CALL_RECORD_MEDIA_TYPE),
                         prompt_tokens=3, new_prompt_tokens=3, completion_tokens=1, policy_version=0, cell_id="cell-0")


def refused(status: int, *, reason: str = "no capacity", budget_spent: bool = False) -> CallRefused:
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "api_error")
    return CallRefused(execution_id="e", status=status, kind=kind, reason=reason, infra=status == 429 or status >= 500,
                       budget_spent=budget_spent)


def test_a_stream_without_calls_records_none() -> None:
    started = ExecutionStarted(execution_id="e", query_id="q", task_id="t", group_size=1, sample_index=0, seed=1)
    account = call_account([started])
    assert not account.recorded_any and account.answered == 0 and account.last_infra_refusal is None


def test_an_infrastructure_refusal_of_the_latest_call_stands_with_its_status_kind_and_reason() -> None:
    account = call_account([answered(0), refused(503, reason="no worker")])
    assert account.last_infra_refusal == "503 api_error: no worker"
    assert account.recorded_any and account.answered == 1 and account.refused == 1


def test_a_later_answer_or_a_refusal_of_the_request_itself_clears_it() -> None:
    assert call_account([refused(500), answered(0)]).last_infra_refusal is None
    assert call_account([refused(429), refused(400)]).last_infra_refusal is None


def test_a_spent_call_budget_is_remembered_whatever_follows() -> None:
    account = call_account([answered(0), answered(1), refused(400, reason="budget", budget_spent=True), refused(500)])
    assert account.budget_spent and account.last_infra_refusal is not None


def test_answered_calls_are_counted_from_call_zero_without_a_gap() -> None:
    """A call recorded past a gap (its reply finished after the agent stopped) is not in the end event's count."""
    account = call_account([answered(0), answered(1), answered(3)])
    assert (account.answered, account.completed) == (2, 3)
    assert call_account([answered(2)]).recorded_any


def test_a_long_reason_is_cut_to_what_an_end_event_keeps() -> None:
    assert len(call_account([refused(500, reason="x" * 500)]).last_infra_refusal or "") == 500


calls = st.lists(st.one_of(st.integers(min_value=0, max_value=5).map(answered),
                           st.sampled_from([400, 413, 429, 500, 503]).map(refused),
                           st.just(refused(400, budget_spent=True))), max_size=12)


@given(calls)
def test_only_the_latest_call_decides_whether_an_infrastructure_refusal_stands(
    events: list[CallCompleted | CallRefused],
) -> None:
    account = call_account(events)
    latest = events[-1] if events else None
    stands = isinstance(latest, CallRefused) and latest.infra
    assert (account.last_infra_refusal is not None) == stands
    assert account.budget_spent == any(isinstance(e, CallRefused) and e.budget_spent for e in events)
    assert account.recorded_any == bool(events)
