"""The event catalogue: envelope round-trips and named errors for bad input."""

import json
import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import given
from pydantic import ValidationError
from hypothesis import strategies as st

from shared.events import (
    REGISTRY,
    BlobRef,
    CallCompleted,
    ExecutionScored,
    InvalidEventPayload,
    UnknownEventType,
    UnsupportedSchemaVersion,
    new_event,
    parse_event,
)

SPEC_TYPES = {
    "cell.registered", "cell.assigned", "cell.draining", "cell.released", "cell.ready", "kv.migrated",
    "call.completed", "execution.started", "execution.branched", "execution.timed_out",
    "execution.finished", "execution.scored", "batch.ready", "step.completed", "weights.published",
}
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def scored(reward: float = 0.5):
    return new_event(
        ExecutionScored(execution_id="e1", query_id="q1", reward=reward, tests_passed=1, tests_total=2),
        run_id="r1", stream_id="execution-e1", version=3, occurred_at=NOW,
    )


def test_catalogue_holds_every_spec_event_type():
    assert SPEC_TYPES <= set(REGISTRY)


def test_envelope_round_trips_through_json():
    event = scored()
    again = parse_event(event.to_json())
    assert again == event
    assert again.to_json() == event.to_json()
    assert again.subject == "gyre.execution.scored"


@given(st.floats(allow_nan=False, allow_infinity=False, width=32), st.integers(1, 10_000))
def test_round_trip_is_exact_for_any_reward_and_version(reward, version):
    event = new_event(
        ExecutionScored(execution_id="e", query_id="q", reward=reward, tests_passed=0, tests_total=0),
        run_id="r", stream_id="execution-e", version=version, occurred_at=NOW,
    )
    assert parse_event(event.to_json()) == event


def test_events_are_frozen():
    event = scored()
    with pytest.raises(ValidationError, match="frozen"):
        event.version = 9  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        event.data.reward = 1.0  # type: ignore[attr-defined]


def test_unknown_type_is_a_named_error():
    body = json.loads(scored().to_json())
    body["type"] = "execution.exploded"
    with pytest.raises(UnknownEventType, match="execution.exploded"):
        parse_event(json.dumps(body))


def test_unknown_type_is_named_even_when_its_payload_is_empty():
    body = json.loads(scored().to_json())
    body["type"], body["data"] = "execution.exploded", {}
    with pytest.raises(UnknownEventType, match="execution.exploded"):
        parse_event(json.dumps(body).encode())


@pytest.mark.parametrize("encode", [dict, json.dumps], ids=["dict", "json"])
def test_newer_schema_version_is_refused_by_name(encode):
    body = json.loads(scored().to_json())
    body["schema_version"] = 7
    with pytest.raises(UnsupportedSchemaVersion, match="schema_version 7"):
        parse_event(encode(body))


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda b: b["data"].pop("reward"), "data.reward" if False else "reward"),
        (lambda b: b["data"].update(reward="high"), "reward"),
        (lambda b: b["data"].update(surprise=1), "surprise"),
        (lambda b: b.pop("run_id"), "run_id"),
        (lambda b: b.update(event_id="not-a-uuid"), "event_id"),
        (lambda b: b.update(version=0), "version"),
    ],
)
@pytest.mark.parametrize("encode", [dict, json.dumps], ids=["dict", "json"])
def test_invalid_payloads_name_the_field(mutate, fragment, encode):
    body = json.loads(scored().to_json())
    mutate(body)
    with pytest.raises(InvalidEventPayload, match=fragment):
        parse_event(encode(body))


@pytest.mark.parametrize("raw", [
    b"not json", b"[1,2]", b"{}", b'{"type": 3}', b"\xff\xfe",
    b'{"type": ["cell.released"], "schema_version": 1, "data": {}}',  # unhashable: no registry lookup
    b'{"type": {"a": 1}, "data": {}}',
    b"[" * 100_000 + b"]" * 100_000,  # deeper than any parser's recursion
])
def test_garbage_is_an_invalid_payload(raw):
    with pytest.raises(InvalidEventPayload):
        parse_event(raw)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_no_event_holds_a_value_json_cannot(bad):
    """JSON has no NaN or infinity: such an event would be written as null and never read back."""
    with pytest.raises(Exception, match="finite"):
        scored(reward=bad)


def test_blob_refs_must_be_sha256_digests():
    with pytest.raises(ValidationError, match="digest"):
        BlobRef(digest="md5:abc", size=1)
    ref = BlobRef(digest="sha256:" + "0" * 64, size=10)
    event = new_event(
        CallCompleted(
            execution_id="e", call_id="c", call_index=0, record=ref, prompt_tokens=5, new_prompt_tokens=5,
            completion_tokens=3, policy_version=0, cell_id="cell-0",
        ),
        run_id="r", stream_id="execution-e", version=1, occurred_at=NOW, event_id=uuid.UUID(int=1),
    )
    assert parse_event(event.to_json()).data.record == ref


def test_an_infrastructure_failure_round_trips_and_is_written_only_when_set():
    failed = new_event(
        ExecutionScored(execution_id="e", query_id="q", reward=0.0, tests_passed=0, tests_total=0,
                        infra_failure="InternalServerError: engine down"),
        run_id="r", stream_id="execution-e", version=1, occurred_at=NOW,
    )
    assert parse_event(failed.to_json()) == failed
    plain = scored()
    assert b"infra_failure" not in plain.to_json() and parse_event(plain.to_json()).data.infra_failure is None
