"""The trajectory fold decides what an execution is from its events alone, whatever order they arrive in:
the live service (events from several JetStream streams, redeliveries) and replay (log order) must agree."""

from __future__ import annotations

import itertools

from services.trajectory.state import BatchParams, RunLog, assemble_step_batch, execution_tree
from services.trajectory.synthetic import SyntheticExecution
from shared.events import ExecutionTimedOut


def timed_out_with_a_late_call() -> SyntheticExecution:
    """The agent stopped waiting at its deadline during call 1; the engine answered anyway and the gateway
    recorded that call (and a fork label for it) after the end was reported."""
    log = SyntheticExecution("late", group_size=1)
    log.start()
    log.call([1, 2, 3], [4, 5])
    log.time_out()  # calls=1
    log.branched("fork", 1, from_call_index=0)
    log.call([1, 2, 3, 4, 5, 6, 9], [7, 8])
    log.score(0.25, timed_out=True)
    return log


def test_a_call_recorded_after_the_end_is_not_part_of_the_trajectory() -> None:
    log = timed_out_with_a_late_call()
    run = RunLog()
    run.apply_all(log.events)
    state = run.executions["late"]
    assert state.complete and state.late_calls == [1]
    tree = execution_tree(state, lambda ref: log.blobs[ref.digest])
    assert [c.call_index for c in tree.calls] == [0]
    assert tree.num_targets == 2
    assert run.blob_refs(["late"]) == [log.events[1].data.record]


def test_the_tree_is_the_same_whether_the_late_call_arrives_before_or_after_the_score() -> None:
    log = timed_out_with_a_late_call()
    late = [e for e in log.events if e.type in ("call.completed", "execution.branched")][1:]
    early = [e for e in log.events if e not in late]
    digests = set()
    for order in (log.events, early + late, late + early):
        run = RunLog()
        for event in order:
            run.apply(event)
            state = run.executions["late"]
            if state.complete:  # the live service builds the tree the moment it can
                digests.add(execution_tree(state, lambda ref: log.blobs[ref.digest]).digest())
        # Replay builds from the whole log once it is read.
        digests.add(execution_tree(run.executions["late"], lambda ref: log.blobs[ref.digest]).digest())
    assert len(digests) == 1


def test_two_end_reports_settle_the_same_way_in_any_order() -> None:
    log = SyntheticExecution("twice", group_size=1)
    log.start()
    log.call([1, 2], [3])
    log.call([1, 2, 3, 4], [5])
    agent_end = log.finish()  # calls=2
    crash_end = log._emit(ExecutionTimedOut(execution_id="twice", budget="crash", elapsed_s=0, calls=0))
    outcomes = set()
    for first, second in itertools.permutations([agent_end, crash_end]):
        run = RunLog()
        run.apply_all([*log.events[:3], first, second])
        s = run.executions["twice"]
        outcomes.add((s.ended, s.ended_calls, s.timed_out))
    assert outcomes == {("finished", 2, False)}


def test_an_end_reporting_fewer_calls_than_the_log_holds_waits_for_none_and_keeps_the_prefix() -> None:
    log = SyntheticExecution("short", group_size=1)
    log.start()
    log.call([1, 2], [3])
    run = RunLog()
    run.apply_all(log.events)
    assert not run.executions["short"].has_all_calls  # no end yet
    log.time_out(budget="crash")  # calls=1
    log.call([1, 2, 3, 4], [5])  # still in flight at the crash, recorded afterwards
    log.score(0.0, timed_out=True)
    run.apply_all(log.events)
    s = run.executions["short"]
    assert s.complete and s.late_calls == [1] and s.missing_calls() == []


def group_with_an_infra_failure(flag: bool) -> tuple[RunLog, dict[str, bytes]]:
    """Three samples of one query: one solved it, one did not, one lost its model API (scored 0 on nothing)."""
    run, blobs = RunLog(), {}
    for i, (reward, failure) in enumerate([(1.0, None), (0.0, None), (0.0, "APIConnectionError: gateway down")]):
        log = SyntheticExecution(f"e{i}", query_id="q", group_size=3, sample_index=i)
        log.start()
        log.call([1, 2, 3], [4 + i, 5])
        log.finish()
        log.score(reward, infra_failure=failure if flag else None)
        run.apply_all(log.events)
        blobs.update(log.blobs)
    return run, blobs


def test_an_execution_infrastructure_ended_is_left_out_of_its_group_and_batch() -> None:
    params = BatchParams(budget=256, cap_k=4, eps=1e-6, drop_zero_variance=False)
    run, blobs = group_with_an_infra_failure(True)
    assert run.executions["e2"].infra_failure == "APIConnectionError: gateway down"
    batch = assemble_step_batch(run, 0, lambda ref: blobs[ref.digest], params)
    kept = {e.execution_id: e.advantage for e in batch.executions}
    assert set(kept) == {"e0", "e1"}
    assert kept["e0"] > 0.99 and kept["e1"] < -0.99  # normalised over the two that count
    assert batch.meta["infra_failures"] == 1
    # Without the flag the failed sample trains as a policy failure and drags the group's mean down.
    run, blobs = group_with_an_infra_failure(False)
    batch = assemble_step_batch(run, 0, lambda ref: blobs[ref.digest], params)
    assert len(batch.executions) == 3 and "infra_failures" not in batch.meta


def test_a_step_waits_for_every_query_its_dispatches_say_feed_it() -> None:
    """Two queries feed step 0; the second is dispatched only once room frees, after the first has completed
    and been scored. The step's batch must wait for it (its first dispatch says two queries feed the step),
    whatever the trajectory service was configured with."""
    from datetime import UTC, datetime

    from shared.events import QueryDispatched, new_event

    def dispatched(query_id: str, step_queries: int | None) -> object:
        data = QueryDispatched(query_id=query_id, task_id="t", group_size=2, seeds=[0, 1], step=0, policy_version=0,
                               step_queries=step_queries)
        return new_event(data, run_id="r", stream_id=f"query-{query_id}", version=1, occurred_at=datetime.now(UTC))

    def group(query_id: str) -> list[object]:
        events = []
        for i in range(2):
            log = SyntheticExecution(f"{query_id}-e{i}", query_id=query_id, group_size=2, sample_index=i)
            log.start()
            log.call([1, 2, 3], [4 + i, 5])
            log.finish()
            log.score(float(i))
            events += log.events
        return events

    run = RunLog()
    run.apply_all([dispatched("qa", 2), *group("qa")])
    assert run.ready_steps() == [] and run.ready_steps(1) == []
    run.apply_all([dispatched("qb", 2)])
    assert run.ready_steps() == []  # qb's group has not run yet
    run.apply_all(group("qb"))
    assert run.ready_steps() == [0] and run.ready_steps(1) == [0]
    assert run.step_execution_ids(0) == ["qa-e0", "qa-e1", "qb-e0", "qb-e1"]
    # A log written before dispatches said so: the configured number decides, as before.
    old = RunLog()
    old.apply_all([dispatched("qa", None), *group("qa")])
    assert old.ready_steps() == [0] and old.ready_steps(2) == []
