"""The run report is a pure fold of a run's events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared.events import (
    BatchReady,
    BlobRef,
    CellAssigned,
    CellReady,
    ExecutionBranched,
    ExecutionScored,
    ExecutionStarted,
    StepCompleted,
    new_event,
)
from gyre.report import build_report, summary_lines, write_report

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ev(data, t: float, stream: str = "s"):
    return new_event(data, run_id="r", stream_id=stream, version=1, occurred_at=T0 + timedelta(seconds=t))


def run_events():
    out = [ev(CellAssigned(cell_id="c0", role="rollout", policy="async"), 0),
           ev(CellReady(cell_id="c0", role="rollout", switch_seconds=2.0), 2)]
    t = 3.0
    for step, rewards in enumerate([[0.0, 0.5, 1.0, 0.5], [1.0, 1.0, 0.5, 1.0]]):
        for i, r in enumerate(rewards):
            eid = f"e{step}{i}"
            out.append(ev(ExecutionStarted(execution_id=eid, query_id=f"q{step}", task_id="t", group_size=4,
                                           sample_index=i, seed=i, step=step), t))
            out.append(ev(ExecutionScored(execution_id=eid, query_id=f"q{step}", reward=r, tests_passed=0,
                                          tests_total=2, timed_out=(r == 0.0)), t + 1))
        out.append(ev(ExecutionBranched(execution_id=f"e{step}0", kind="compaction", at_call_index=3), t + 1))
        out.append(ev(BatchReady(step=step, batch=BlobRef(digest="sha256:" + "0" * 64, size=1), query_ids=[f"q{step}"],
                                 executions=4, trees=4, micro_batches=1, unique_tokens=100, flat_tokens=250,
                                 target_tokens=40, min_policy_version=step, max_policy_version=step,
                                 stale_executions=step), t + 2))
        out.append(ev(StepCompleted(step=step, policy_version=step + 1, world_size=1, seconds=1.5,
                                    metrics={"loss": 0.1 * step}), t + 3))
        t += 10
    out.append(ev(CellAssigned(cell_id="c0", role="train", policy="colocate"), t))
    out.append(ev(CellReady(cell_id="c0", role="train", switch_seconds=4.0), t + 4))
    return out


def test_report_folds_rewards_per_step_and_statistics(tmp_path):
    report = build_report("r", run_events())
    assert [s.step for s in report.steps] == [0, 1]
    assert report.steps[0].mean_reward == 0.5 and report.steps[0].pass_rate == 0.25
    assert report.steps[1].mean_reward == 0.875 and report.steps[1].loss == 0.1
    assert report.reward_gain == 0.375
    assert (report.reward_head, report.reward_tail) == (0.5, 0.875)  # a 2-step run: one step each side
    assert report.timed_out == 1 and report.executions == 8
    assert report.branches == {"compaction": 2}
    assert report.dedup_factor == 2.5
    assert report.stale_executions == 1 and "1 left out as too stale" in summary_lines(report)[0]
    assert [s["seconds"] for s in report.switches] == [2.0, 4.0]
    roles = [(seg["role"], seg["start_s"], seg["end_s"]) for seg in report.timeline]
    assert roles[:2] == [("rollout (switching)", 0.0, 2.0), ("rollout", 2.0, 23.0)]
    files = write_report(report, tmp_path)
    assert {f.name for f in files} == {"report.json", "training_curve.png", "cell_timeline.png"}
    assert all(f.stat().st_size > 0 for f in files)
    assert "0.500 → 0.875" in "\n".join(summary_lines(report))


def test_executions_infrastructure_ended_are_counted_but_kept_out_of_the_reward_curve():
    events = run_events()
    events.append(ev(ExecutionStarted(execution_id="ex", query_id="q1", task_id="t", group_size=4, sample_index=4,
                                      seed=4, step=1), 50))
    events.append(ev(ExecutionScored(execution_id="ex", query_id="q1", reward=0.0, tests_passed=0, tests_total=2,
                                     timed_out=True, infra_failure="InternalServerError: engine down"), 51))
    report = build_report("r", events)
    assert report.executions == 9 and report.infra_failures == 1
    assert report.steps[1].mean_reward == 0.875 and report.steps[1].executions == 4
    assert "1 ended by infrastructure" in summary_lines(report)[0]
