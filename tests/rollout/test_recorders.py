"""The call recorder's contract (tests/rollout/recorder_contract.py) against each storage backend: the real
Postgres event store and the in-memory fake the gateway tests use."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.rollout.recorder import CallStorage, RecordingFailed
from services.rollout.recorder_memory import InMemoryCallRecorder, MemoryCallStorage
from services.rollout.recorder_postgres import PostgresCallStorage
from tests.rollout.recorder_contract import CallRecorderContract, successive_calls


class TestPostgresCallRecorder(CallRecorderContract):
    @pytest.fixture
    async def storage(self, store) -> AsyncIterator[CallStorage]:
        yield PostgresCallStorage(store)


class TestInMemoryCallRecorder(CallRecorderContract):
    @pytest.fixture
    async def storage(self) -> AsyncIterator[CallStorage]:
        yield MemoryCallStorage()

    async def test_fail_next_fails_one_call_write_and_not_a_refusal(self) -> None:
        """What the gateway tests lean on: `fail_next` is one store outage for the next call's write."""
        recorder = InMemoryCallRecorder()
        recorder.fail_next = ConnectionError("down")
        with pytest.raises(RecordingFailed):
            await recorder.record(successive_calls(1)[0])
        assert recorder.fail_next is None and recorder.events == []
        assert (await recorder.record(successive_calls(1)[0])).placement.call_index == 0
        assert len(recorder.calls("exec-pg")) == 1 and recorder.restarted().storage is recorder.storage
