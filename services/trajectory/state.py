"""The trajectory service's view of a run, as a pure fold over the execution log.

Both the live service and `gyre replay` derive everything from this fold, so a restarted service sees exactly
what it saw before (no state of its own to lose) and replay reproduces the live batches. Applying an event
twice is a no-op (events are keyed by event_id), and event order across streams does not matter.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.trajectory.training_batch import ExecutionInput, build_training_batch
from services.trajectory.tree import TrajectoryTree
from services.trajectory.tree_builder import BranchLabel, build_tree
from shared.batch import TrainingBatch
from shared.calls import CallRecord, CallRecordError, call_record
from shared.events import (
    BatchReady,
    BlobRef,
    CallCompleted,
    Event,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    QueryDispatched,
)

CONSUMED_TYPES: tuple[str, ...] = (
    "query.dispatched",
    "execution.started",
    "execution.branched",
    "execution.finished",
    "execution.timed_out",
    "execution.scored",
    "call.completed",
    "batch.ready",
)

BlobGetter = Callable[[BlobRef], bytes]


class LogError(Exception):
    """The execution log is inconsistent or corrupted (missing calls, bad blobs, conflicting facts)."""


@dataclass
class ExecutionState:
    execution_id: str
    run_id: str = ""
    query_id: str | None = None
    task_id: str = ""
    step: int | None = None
    group_size: int | None = None
    sample_index: int = 0
    policy_version: int = 0
    calls: dict[int, CallCompleted] = field(default_factory=dict)
    labels: list[BranchLabel] = field(default_factory=list)
    ended: str | None = None  # "finished" | "timed_out"
    ended_calls: int | None = None
    reward: float | None = None
    scored_timed_out: bool = False
    infra_failure: str | None = None  # why infrastructure ended it; such an execution is not trained on
    _end_rank: tuple[bool, int, bool] | None = field(default=None, repr=False, compare=False)

    @property
    def timed_out(self) -> bool:
        return self.ended == "timed_out" or self.scored_timed_out

    @property
    def started(self) -> bool:
        return self.query_id is not None

    @property
    def trajectory_calls(self) -> dict[int, CallCompleted]:
        """The calls the execution ended with. A call recorded after its end (the agent stopped waiting for it
        at its deadline, or its harness crashed while the engine still answered) is in the log but is not part
        of the execution: the live service may have built the tree before that call arrived, so leaving it out
        is what keeps replay equal to the live batch."""
        if self.ended_calls is None:
            return self.calls
        return {i: c for i, c in self.calls.items() if i < self.ended_calls}

    @property
    def late_calls(self) -> list[int]:
        """Indices of calls recorded after the execution ended (see `trajectory_calls`)."""
        return sorted(i for i in self.calls if self.ended_calls is not None and i >= self.ended_calls)

    @property
    def trajectory_labels(self) -> list[BranchLabel]:
        if self.ended_calls is None:
            return list(self.labels)
        return [label for label in self.labels if label.at_call_index < self.ended_calls]

    @property
    def has_all_calls(self) -> bool:
        return self.ended_calls is not None and all(i in self.calls for i in range(self.ended_calls))

    @property
    def complete(self) -> bool:
        """Ended, scored, and every call it reported is in the log."""
        return self.started and self.ended is not None and self.reward is not None and self.has_all_calls

    def missing_calls(self) -> list[int]:
        expected = range(self.ended_calls if self.ended_calls is not None else (max(self.calls, default=-1) + 1))
        return [i for i in expected if i not in self.calls]


@dataclass
class QueryState:
    query_id: str
    step: int
    group_size: int
    execution_ids: list[str] = field(default_factory=list)
    step_queries: int | None = None  # from its dispatch: how many queries feed its step


@dataclass
class RunLog:
    """Everything the trajectory service knows, folded from events."""

    executions: dict[str, ExecutionState] = field(default_factory=dict)
    queries: dict[str, QueryState] = field(default_factory=dict)
    batches: dict[int, Event] = field(default_factory=dict)  # step → its batch.ready event
    _seen: set[uuid.UUID] = field(default_factory=set)

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(event)

    def _execution(self, execution_id: str, run_id: str) -> ExecutionState:
        state = self.executions.get(execution_id)
        if state is None:
            state = self.executions[execution_id] = ExecutionState(execution_id, run_id=run_id)
        return state

    def _query(self, query_id: str, step: int, group_size: int) -> QueryState:
        q = self.queries.get(query_id)
        if q is None:
            q = self.queries[query_id] = QueryState(query_id, step, group_size)
        elif (q.step, q.group_size) != (step, group_size):
            raise LogError(
                f"query {query_id}: step/group size ({step}, {group_size}) conflict with ({q.step}, {q.group_size})"
            )
        return q

    def apply(self, event: Event) -> None:
        if event.event_id in self._seen:
            return
        self._seen.add(event.event_id)
        d = event.data
        match d:
            case QueryDispatched():
                self._query(d.query_id, d.step, d.group_size).step_queries = d.step_queries
            case ExecutionStarted():
                s = self._execution(d.execution_id, event.run_id)
                s.query_id, s.task_id, s.step = d.query_id, d.task_id, d.step
                s.group_size, s.sample_index, s.policy_version = d.group_size, d.sample_index, d.policy_version
                q = self._query(d.query_id, d.step, d.group_size)
                if d.execution_id not in q.execution_ids:
                    q.execution_ids.append(d.execution_id)
            case CallCompleted():
                s = self._execution(d.execution_id, event.run_id)
                previous = s.calls.get(d.call_index)
                if previous is not None and previous.record.digest != d.record.digest:
                    raise LogError(f"execution {d.execution_id}: two different records for call {d.call_index}")
                s.calls[d.call_index] = d
            case ExecutionBranched():
                s = self._execution(d.execution_id, event.run_id)
                s.labels.append(BranchLabel(d.at_call_index, d.kind, d.from_call_index, d.chain_id))
            case ExecutionFinished():
                self._end(self._execution(d.execution_id, event.run_id), "finished", d.calls, crash=False)
            case ExecutionTimedOut():
                self._end(self._execution(d.execution_id, event.run_id), "timed_out", d.calls,
                          crash=d.budget == "crash")
            case ExecutionScored():
                s = self._execution(d.execution_id, event.run_id)
                s.reward = d.reward
                s.scored_timed_out = s.scored_timed_out or d.timed_out
                s.infra_failure = d.infra_failure
            case BatchReady():
                self.batches.setdefault(d.step, event)
            case _:
                pass  # other event types are not the trajectory service's concern

    @staticmethod
    def _end(s: ExecutionState, how: str, calls: int, *, crash: bool) -> None:
        """Record how an execution ended. The harness reports one end per execution; should two arrive, the
        choice must not depend on their order (a redelivery can swap them): an agent's own end beats a crash
        mark, then the one reporting more calls, then "timed_out" over "finished"."""
        rank = (not crash, calls, how == "timed_out")
        if s._end_rank is not None and s._end_rank >= rank:
            return
        s.ended, s.ended_calls, s._end_rank = how, calls, rank

    # ---- steps ------------------------------------------------------------------------------------

    def step_queries(self, step: int) -> list[QueryState]:
        return sorted((q for q in self.queries.values() if q.step == step), key=lambda q: q.query_id)

    def query_complete(self, query: QueryState) -> bool:
        members = [self.executions[e] for e in query.execution_ids if e in self.executions]
        return len(members) >= query.group_size and all(m.complete for m in members)

    def ready_steps(self, queries_per_step: int | None = None) -> list[int]:
        """Steps without a batch yet whose every known query has a complete, scored group, and all of whose
        queries are known: as many as their dispatches say feed the step (`QueryDispatched.step_queries`), and
        at least `queries_per_step` when it is configured."""
        steps = sorted({q.step for q in self.queries.values()} - set(self.batches))
        ready = []
        for step in steps:
            queries = self.step_queries(step)
            needed = max([queries_per_step or 0, *(q.step_queries or 0 for q in queries)])
            if len(queries) < needed:
                continue
            if queries and all(self.query_complete(q) for q in queries):
                ready.append(step)
        return ready

    def step_execution_ids(self, step: int) -> list[str]:
        out = []
        for q in self.step_queries(step):
            members = sorted(
                (self.executions[e] for e in q.execution_ids if e in self.executions),
                key=lambda s: (s.sample_index, s.execution_id),
            )
            out += [m.execution_id for m in members[: q.group_size]]
        return out

    def blob_refs(self, execution_ids: Iterable[str]) -> list[BlobRef]:
        return [c.record for e in execution_ids for _, c in sorted(self.executions[e].trajectory_calls.items())]


def call_records(state: ExecutionState, get_blob: BlobGetter) -> list[CallRecord]:
    """Decode an execution's call records, checking every blob against its digest."""
    missing = state.missing_calls()
    if missing:
        raise LogError(f"execution {state.execution_id}: calls {missing[:10]} are missing from the log")
    records = []
    calls = state.trajectory_calls
    for index in sorted(calls):
        c = calls[index]
        try:
            blob = get_blob(c.record)
        except KeyError as exc:
            raise LogError(f"execution {state.execution_id} call {index}: blob {c.record.digest} not found") from exc
        try:
            records.append(call_record(c, blob))
        except CallRecordError as exc:
            raise LogError(str(exc)) from exc
    return records


def execution_tree(state: ExecutionState, get_blob: BlobGetter) -> TrajectoryTree:
    try:
        return build_tree(state.execution_id, call_records(state, get_blob), state.trajectory_labels)
    except LogError:
        raise
    except Exception as exc:
        raise LogError(f"execution {state.execution_id}: cannot build its tree: {exc}") from exc


@dataclass(frozen=True)
class BatchParams:
    budget: int
    cap_k: int
    eps: float
    drop_zero_variance: bool
    max_staleness: int | None = None
    cap_keeps_final: bool = True  # the cap keeps the final call's trajectory first (cap.py); older batches: False
    share_group_prefix: bool = True  # a query's executions packed over their common context once; older: False

    @classmethod
    def from_meta(cls, meta: dict[str, int | float | str]) -> BatchParams:
        staleness = meta.get("max_staleness", -1)
        return cls(
            budget=int(meta["budget"]),
            cap_k=int(meta["cap_k"]),
            eps=float(meta["eps"]),
            drop_zero_variance=bool(int(meta["drop_zero_variance"])),
            max_staleness=None if int(staleness) < 0 else int(staleness),
            cap_keeps_final=meta.get("cap_rule") == "final-first",
            share_group_prefix=meta.get("pack_rule") == "group-prefix",
        )


def assemble_step_batch(
    log: RunLog, step: int, get_blob: BlobGetter, params: BatchParams,
    trees: dict[str, TrajectoryTree] | None = None,
) -> TrainingBatch:
    """The batch of one step: every execution of the step's queries, capped, with advantages, packed.

    Executions with a target generated more than `max_staleness` versions behind the step are left out of the
    packing (their rewards still count in their group's advantage normalisation). Executions that
    infrastructure ended (`infra_failure`) are left out altogether: their reward says nothing about the policy,
    so they neither train nor move their group's mean; the group is normalised over the rest.
    """
    ids = log.step_execution_ids(step)
    inputs = []
    infra_failures = 0
    for execution_id in ids:
        state = log.executions[execution_id]
        if state.reward is None or state.query_id is None:
            raise LogError(f"step {step}: execution {execution_id} is not scored yet")
        if state.infra_failure is not None:
            infra_failures += 1
            continue
        tree = trees.get(execution_id) if trees is not None else None
        if tree is None:
            tree = execution_tree(state, get_blob)
            if trees is not None:
                trees[execution_id] = tree
        inputs.append(
            ExecutionInput(execution_id, state.query_id, tree, state.reward, state.timed_out, state.sample_index)
        )
    min_version = step - params.max_staleness if params.max_staleness is not None else None
    batch = build_training_batch(
        step, inputs, budget=params.budget, cap_k=params.cap_k, eps=params.eps,
        drop_zero_variance=params.drop_zero_variance, min_policy_version=min_version,
        cap_keeps_final=params.cap_keeps_final, share_group_prefix=params.share_group_prefix,
        extra_meta={
            "max_staleness": params.max_staleness if params.max_staleness is not None else -1,
            "queries": ",".join(q.query_id for q in log.step_queries(step)),
            # Only when there were any, so batches of logs written before the flag existed rebuild identically.
            **({"infra_failures": infra_failures} if infra_failures else {}),
        },
    )
    return batch
