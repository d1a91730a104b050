"""Query planning and crash recovery decisions (pure), and the async bridge the service uses."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.harness.agent_core import AgentConfig, Branch
from services.harness.execution import BuiltinHarness, LoopObserver, run_execution_async
from services.harness.external_harness import GatewayAccess
from services.harness.outcomes import AgentStopped
from services.harness.planning import QueryPlanError, plan_query, recovery_actions
from services.harness.tasks import load_task
from shared.events import execution_id_for

from .scripted_server import ScriptedAnthropicServer, shell, tool
from .test_agent_loop import partial_task


def test_query_expands_to_one_execution_per_seed_with_stable_ids() -> None:
    plan = plan_query(query_id="q7", task_id="sum-numbers-1", group_size=3, seeds=[11, 12, 13])
    assert [p.execution_id for p in plan] == ["execution-q7-000", "execution-q7-001", "execution-q7-002"]
    assert [p.seed for p in plan] == [11, 12, 13] and {p.group_size for p in plan} == {3}
    assert plan == plan_query(query_id="q7", task_id="sum-numbers-1", group_size=3, seeds=[11, 12, 13])


def test_seed_count_must_match_group_size() -> None:
    with pytest.raises(QueryPlanError, match="expected 4 seeds"):
        plan_query(query_id="q", task_id="t", group_size=4, seeds=[1, 2])


stage_sets = st.sets(st.sampled_from(["started", "stopped", "scored"]))


@given(st.dictionaries(st.text(min_size=1, max_size=8), stage_sets, max_size=12))
def test_recovery_grades_every_unscored_started_execution_once(stages: dict[str, set[str]]) -> None:
    actions = recovery_actions(stages)  # type: ignore[arg-type]
    ids = [a.execution_id for a in actions]
    assert ids == sorted(set(ids))
    expected = {e for e, s in stages.items() if "started" in s and "scored" not in s}
    assert set(ids) == expected
    for action in actions:
        assert action.grade
        assert action.mark_timed_out == ("stopped" not in stages[action.execution_id])


def test_execution_id_is_a_stream_id() -> None:
    assert execution_id_for("abc", 5).startswith("execution-")


async def test_loop_observer_delivers_branches_then_stop_on_the_event_loop(tmp_path: Path, best_backend: str) -> None:
    loop = asyncio.get_running_loop()
    seen: list[object] = []

    async def on_branched(branch: Branch) -> None:
        assert asyncio.get_running_loop() is loop
        seen.append(branch.kind)

    async def on_stopped(stopped: AgentStopped) -> None:
        seen.append(stopped.status)

    task = load_task(partial_task(tmp_path / "task"))
    script = [tool("nope", {}), shell("touch a.txt b.txt"), tool("submit", {})]
    with ScriptedAnthropicServer(script) as server:
        result = await run_execution_async(
            execution_id="execution-async",
            task=task,
            harness=BuiltinHarness(agent=AgentConfig(model="m", sdk_max_retries=0, seed=5)),
            gateway=GatewayAccess(base_url=server.base_url, token="t", model="m"),
            state_dir=tmp_path / "state",
            backend=best_backend,
            observer=LoopObserver(loop, on_branched=on_branched, on_stopped=on_stopped),
        )
    assert seen == ["retry", "finished"]
    assert result.grade.score == 1.0
    seeds = [r["seed"] for r in server.requests]
    assert len(set(seeds)) == len(seeds) == 3
