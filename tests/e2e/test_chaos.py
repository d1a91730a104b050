"""Whole-loop chaos: a run on its own NATS and PostgreSQL while a seeded schedule kills every process of it
once (each service, each cell's rollout worker and trainer rank) and restarts both servers under it, one fault
at a time, each after the loop has completed steps since the last. The run completes; every step trains
exactly once; no execution is lost or duplicated; `gyre replay --verify` matches. `bench/chaos.py` runs a
longer schedule and writes what each fault cost (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.chaos import check_run, fault_plan, fault_targets

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")


async def test_a_run_survives_every_process_killed_and_both_servers_restarted(tmp_path: Path):
    from gyre.chaos_run import run_chaos

    # A fault every second step (the run: 3 × 13 + 4 = 43 steps); the bench spaces them wider. (One step apart,
    # 30 steps, the run once made no step for 600 s after the trainer was killed right after its step 11: the new
    # coordinator found that batch trained and waited for step 12's, which never came. Not yet understood.)
    outcome = await run_chaos(tmp_path, seed=0, faults=None, cells=2, every_steps=2)
    print(json.dumps({k: v for k, v in outcome.faults.items() if k != "records"}, indent=2))
    assert outcome.faults["faults"] == len(fault_targets(["vm-cell0", "vm-cell1"]))
    assert set(outcome.faults["by_kind"]) == {"relay", "trajectory", "trainer", "gateway", "harness", "cells",
                                              "scheduler", "worker", "rank", "nats", "postgres"}
    assert not outcome.problems, outcome.problems  # every step once, no execution lost or repeated
    assert not outcome.unplanned, f"processes exited on their own: {outcome.unplanned}"
    # The executions the harness was running when it was killed were resumed by its successor, not ended.
    assert not [e for e in outcome.events if e.type == "execution.timed_out" and e.data.budget == "crash"]
    assert not [e for e in outcome.events if e.type == "execution.scored" and e.data.infra_failure
                and "harness stopped" in e.data.infra_failure]
    # The log alone rebuilds every tree and batch with the digests the run emitted, faults and all.
    assert outcome.replay_ok, outcome.replay_output


def test_a_fault_plan_hits_every_target_once_before_any_twice():
    cells = ["a", "b"]
    targets = fault_targets(cells)
    plan = fault_plan(7, 40, cells)
    assert sorted(plan[:len(targets)]) == sorted(targets) and len(plan) == 40
    assert all(x != y for x, y in zip(plan, plan[1:]))
    assert plan == fault_plan(7, 40, cells) and plan != fault_plan(8, 40, cells)
    assert fault_plan(7, 3, cells) == plan[:3]


def test_check_run_names_a_lost_execution_and_a_repeated_one():
    from tests.gyre.test_dashboard import golden

    events = golden("group").events
    assert check_run(events, steps=0, group_size=4) == []
    scored = next(i for i, e in enumerate(events) if e.type == "execution.scored")
    problems = check_run(events[:scored] + events[scored + 1:], steps=0, group_size=4)
    assert len(problems) == 1 and "never scored" in problems[0]
    problems = check_run(events + [e for e in events if e.type == "execution.started"][:1], steps=0, group_size=4)
    assert any("started or scored twice" in p for p in problems)
    assert any("without their 4 executions" in p for p in problems)
    assert check_run(events, steps=2, group_size=4) == ["steps completed [], expected each of 0..1 once"]
