"""The run's query plan: ids, tasks and seeds as functions of the run, and its dispatch events."""

from __future__ import annotations

import pytest

from services.scheduler.plan import PlanError, derive_seed

from .fold_log import plan


def test_query_ids_name_run_step_and_index_and_parse_back() -> None:
    p = plan()
    ids = [p.query_id(n) for n in range(p.total_queries)]
    assert ids[:3] == ["r1-step0-q0", "r1-step0-q1", "r1-step1-q0"]
    assert len(set(ids)) == len(ids)
    assert [p.number_of(i) for i in ids] == list(range(p.total_queries))
    assert p.number_of("r2-step0-q0") is None and p.number_of("r1-step0-q5") is None


def test_seeds_follow_the_run_seed_not_the_run_id() -> None:
    a, b = plan(run_id="async-run"), plan(run_id="colocate-run")
    assert [a.seeds_for(n) for n in range(6)] == [b.seeds_for(n) for n in range(6)]
    assert a.seeds_for(0) != plan(seed=8).seeds_for(0)
    assert len({s for n in range(6) for s in a.seeds_for(n)}) == 12  # distinct per step, index and sample
    assert derive_seed(7, 0, 0, 0) == a.seeds_for(0)[0]


def test_task_choice_round_robin_and_seeded_are_deterministic() -> None:
    assert [plan().task_for(n) for n in range(4)] == ["a", "b", "c", "a"]
    seeded = plan(task_order="seeded")
    assert [seeded.task_for(n) for n in range(20)] == [plan(task_order="seeded").task_for(n) for n in range(20)]
    assert set(seeded.task_for(n) for n in range(60)) == {"a", "b", "c"}


def test_plan_rejects_no_tasks_and_dispatch_past_the_last_step() -> None:
    with pytest.raises(PlanError, match="at least one task"):
        plan(task_ids=())
    with pytest.raises(PlanError, match=r"\[0, 6\)"):
        plan().dispatch(6, policy_version=0)
    q = plan().dispatch(3, policy_version=1)
    assert (q.query_id, q.step, q.task_id, q.group_size, q.policy_version) == ("r1-step1-q1", 1, "a", 2, 1)
    assert q.step_queries == 2  # the trajectory service waits for both of the step's queries
