"""Synthetic executions: an execution's log written the way the rollout gateway and the harness write it (delta call
records + events), for tests, golden logs and the benchmarks. Pure: ids and timestamps are derived from the
arguments, never from a clock."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import numpy as np

from shared.blobs import blob_ref
from shared.calls import CALL_RECORD_MEDIA_TYPE, CallRecord, CallTokens, call_completed, longest_prefix_parent
from shared.events import (
    BranchKind,
    Event,
    EventData,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    new_event,
)

EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


def stable_uuid(*parts: object) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, "gyre:" + "/".join(str(p) for p in parts))


@dataclass
class SyntheticExecution:
    """One synthetic execution: its calls as delta records, its events and the blobs they reference, written the
    way the gateway and the harness write them (the gateway's own call log is `services.rollout.recording`)."""

    execution_id: str
    query_id: str = "q"
    run_id: str = "run"
    task_id: str = "task"
    group_size: int = 1
    sample_index: int = 0
    step: int = 0
    seed: int = 0
    records: list[CallRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=dict)
    _sequences: list[np.ndarray] = field(default_factory=list)
    _prefix_parent: bool = True

    @property
    def stream_id(self) -> str:
        return f"execution-{self.execution_id}"

    def _emit(self, data: EventData) -> Event:
        version = len(self.events) + 1
        event = new_event(
            data,
            run_id=self.run_id,
            stream_id=self.stream_id,
            version=version,
            occurred_at=EPOCH + timedelta(seconds=version),
            event_id=stable_uuid(self.run_id, self.execution_id, version),
        )
        self.events.append(event)
        return event

    def start(self, policy_version: int = 0, harness: str = "builtin") -> Event:
        return self._emit(
            ExecutionStarted(
                execution_id=self.execution_id,
                query_id=self.query_id,
                task_id=self.task_id,
                group_size=self.group_size,
                sample_index=self.sample_index,
                seed=self.seed,
                step=self.step,
                policy_version=policy_version,
                harness=harness,
            )
        )

    def call(
        self,
        prompt: Sequence[int] | np.ndarray,
        completion: Sequence[int] | np.ndarray,
        *,
        logprobs: Sequence[float] | np.ndarray | None = None,
        policy_version: int = 0,
        chain_id: str = "main",
        branch_hint: BranchKind | None = None,
        cell_id: str = "cell-0",
        parent: tuple[int | None, int] | None = None,
    ) -> CallRecord:
        """Record one call given its FULL prompt; the delta against earlier calls is computed here."""
        prompt_arr = np.asarray(prompt, dtype=np.int32)
        completion_arr = np.asarray(completion, dtype=np.int32)
        if logprobs is None:
            # Deterministic, distinct logprobs so tests can tell which call a target came from.
            lp = -(np.arange(completion_arr.shape[0], dtype=np.float32) + 1) / 64 - len(self.records) / 1024
        else:
            lp = np.asarray(logprobs, dtype=np.float32)
        if parent is None:
            parent_index, shared = longest_prefix_parent(self._sequences, prompt_arr)
        else:
            parent_index, shared = parent
        shared = min(shared, prompt_arr.shape[0])
        if parent_index is None or shared == 0:
            parent_index, shared = None, 0
        tokens = CallTokens(new_prompt=prompt_arr[shared:].copy(), completion=completion_arr, logprobs=lp)
        index = len(self.records)
        record = CallRecord(
            execution_id=self.execution_id,
            call_id=f"{self.execution_id}-call-{index}",
            call_index=index,
            parent_call_index=parent_index,
            parent_prefix_len=shared,
            tokens=tokens,
            policy_version=policy_version,
            cell_id=cell_id,
            chain_id=chain_id,
            branch_hint=branch_hint,
        )
        blob = tokens.encode()
        ref = blob_ref(blob, CALL_RECORD_MEDIA_TYPE)
        self.blobs[ref.digest] = blob
        self._emit(call_completed(record, ref, api="internal"))
        self.records.append(record)
        self._sequences.append(np.concatenate([prompt_arr, completion_arr]))
        return record

    def sequence(self, call_index: int) -> np.ndarray:
        return self._sequences[call_index]

    def branched(self, kind: BranchKind, at_call_index: int, *, from_call_index: int | None = None,
                 chain_id: str = "main", reason: str = "") -> Event:
        return self._emit(
            ExecutionBranched(
                execution_id=self.execution_id,
                kind=kind,
                at_call_index=at_call_index,
                from_call_index=from_call_index,
                chain_id=chain_id,
                reason=reason,
            )
        )

    def finish(self, elapsed_s: float = 60.0, stop_reason: str = "submitted", infra_failure: bool = False) -> Event:
        return self._emit(
            ExecutionFinished(execution_id=self.execution_id, elapsed_s=elapsed_s, calls=len(self.records),
                              stop_reason=stop_reason, infra_failure=infra_failure)
        )

    def time_out(self, elapsed_s: float = 3600.0, budget: str = "wall_clock") -> Event:
        return self._emit(
            ExecutionTimedOut(
                execution_id=self.execution_id,
                budget=budget,  # type: ignore[arg-type]
                elapsed_s=elapsed_s,
                calls=len(self.records),
            )
        )

    def score(
        self, reward: float, *, tests_passed: int = 0, tests_total: int = 0, timed_out: bool = False,
        infra_failure: str | None = None,
    ) -> Event:
        return self._emit(
            ExecutionScored(
                execution_id=self.execution_id,
                query_id=self.query_id,
                reward=reward,
                tests_passed=tests_passed,
                tests_total=tests_total,
                timed_out=timed_out,
                infra_failure=infra_failure,
            )
        )
