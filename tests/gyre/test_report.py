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
    WeightsLoaded,
    WeightsPublished,
    WeightsRetired,
    new_event,
)
from gyre.report import build_report, summary_lines
from gyre.report_plots import write_report

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
        out.append(ev(ExecutionBranched(execution_id=f"e{step}1", kind="fork", at_call_index=2,
                                        cause="reply_rewritten" if step else "context_rewritten"), t + 1))
        out.append(ev(BatchReady(step=step, batch=BlobRef(digest="sha256:" + "0" * 64, size=1), query_ids=[f"q{step}"],
                                 executions=4, trees=4, micro_batches=1, unique_tokens=100, flat_tokens=250,
                                 target_tokens=40, min_policy_version=step, max_policy_version=step,
                                 stale_executions=step, trajectories_before_cap=12, trajectories_after_cap=9,
                                 capped_executions=1, dropped_targets=7, group_shared_tokens=50), t + 2))
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
    assert report.branches == {"compaction": 2, "fork": 2}
    assert report.forks_by_cause == {"context_rewritten": 1, "reply_rewritten": 1}
    assert "forks by cause: context rewritten 1, reply rewritten 1" in summary_lines(report)
    assert report.dedup_factor == 2.5
    assert report.group_shared_tokens == 100
    assert "tokens: 200 unique, 500 flat (dedup ×2.50); 100 packed, each query's opening prompt once (×2.00)" \
        in summary_lines(report)
    assert (report.trajectories_before_cap, report.trajectories_after_cap, report.capped_executions,
            report.cap_dropped_targets) == (24, 18, 2, 14)
    assert "trajectories per execution: 3.00 before the cap, 2.25 after; the cap cut 2 executions and left 14 " \
        "target tokens untrained" in "\n".join(summary_lines(report))
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


def test_executions_a_restarted_harness_resumed_are_counted_with_the_calls_it_replayed():
    from shared.events import ExecutionResumed

    events = run_events()
    events += [ev(ExecutionResumed(execution_id="e1", replayed_calls=3, attempt=1), 52),
               ev(ExecutionResumed(execution_id="e1", replayed_calls=5, attempt=2), 53)]
    report = build_report("r", events)
    assert (report.resumed_executions, report.replayed_calls) == (2, 8)
    assert "2 resumed after a harness stop (8 calls replayed)" in summary_lines(report)[0]
    assert report.steps[1].mean_reward == 0.875  # a resume changes no score


def test_an_elastic_run_reports_roles_and_world_size_per_step_and_each_switch_with_its_phases(tmp_path):
    from shared.events import CellDrained, CellDraining, CellReleased, GroupFormed, KvMigrated, RankStepped

    def scored(step: int, t: float) -> list:
        eid = f"e{step}"
        return [ev(ExecutionStarted(execution_id=eid, query_id=f"q{step}", task_id="t", group_size=1,
                                    sample_index=0, seed=0, step=step), t),
                ev(ExecutionScored(execution_id=eid, query_id=f"q{step}", reward=1.0, tests_passed=1,
                                   tests_total=1), t + 1)]

    def formed(generation: int, members: list[str], t: float):
        return ev(GroupFormed(generation=generation, members=members, world_size=len(members), next_step=0,
                              seconds=1.0, reason="joined"), t)

    events = [
        ev(CellAssigned(cell_id="c0", role="rollout", policy="elastic"), 0),
        ev(CellAssigned(cell_id="c1", role="rollout", policy="elastic"), 0),
        ev(CellAssigned(cell_id="c2", role="train", policy="elastic"), 0),
        ev(CellReady(cell_id="c0", role="rollout", switch_seconds=60.0, warm=False), 60),
        ev(CellReady(cell_id="c1", role="rollout", switch_seconds=61.0, warm=False), 61),
        formed(1, ["c2"], 62),
        ev(CellReady(cell_id="c2", role="train", switch_seconds=62.0, warm=False), 62),
        *scored(0, 63),
        ev(RankStepped(step=0, generation=1, cell_id="c2", rank=0, world_size=1, micro_batches=2, tokens=90,
                       seconds=2.0), 66),
        ev(StepCompleted(step=0, policy_version=1, world_size=1, seconds=2.0, metrics={"loss": 0.2}), 66),
        # c1 moves to training with two live sessions: one by its KV, one recomputed.
        ev(CellAssigned(cell_id="c1", role="train", policy="elastic"), 70),
        ev(CellDraining(cell_id="c1", from_role="rollout"), 70.1),
        ev(KvMigrated(execution_id="x", from_cell="c1", to_cell="c0", tokens=500, bytes=10, seconds=0.2,
                      method="kv"), 70.5),
        ev(KvMigrated(execution_id="y", from_cell="c1", to_cell="c0", tokens=50, bytes=0, seconds=0.1,
                      method="recompute", fallback="KV object kv-123: expected digest sha256:ab, read sha256:cd"),
           70.7),
        ev(CellDrained(cell_id="c1", worker_id="w1", migrated_sessions=2, parked_sessions=0, seconds=0.7,
                       phases={"drain_s": 0.6, "sleep_s": 0.1}), 70.8),
        ev(CellReleased(cell_id="c1", from_role="rollout", migrated_sessions=2, seconds=0.8), 70.9),
        formed(2, ["c2", "c1"], 72),
        ev(CellReady(cell_id="c1", role="train", switch_seconds=2.0, warm=True,
                     phases={"drain_s": 0.6, "sleep_s": 0.1, "group_s": 0.5, "load_s": 0.4}), 72),
        *scored(1, 73),
        *(ev(RankStepped(step=1, generation=2, cell_id=c, rank=r, world_size=2, micro_batches=1, tokens=45,
                         seconds=1.1), 76) for r, c in enumerate(["c2", "c1"])),
        ev(StepCompleted(step=1, policy_version=2, world_size=2, seconds=1.2, metrics={"loss": 0.1}), 76),
    ]
    report = build_report("r", events)
    assert [(s.step, s.world_size, s.roles) for s in report.steps] == [
        (0, 1, {"rollout": 2, "train": 1}), (1, 2, {"rollout": 1, "train": 2})]
    assert [r["cell_id"] for r in report.steps[1].ranks] == ["c2", "c1"]
    moved = report.switches[-1]
    assert (moved["cell_id"], moved["from_role"], moved["to_role"], moved["warm"]) == ("c1", "rollout", "train", True)
    assert moved["sessions_moved"] == {"kv": 1, "recompute": 1}
    assert moved["phases"] == {"drain_s": 0.6, "sleep_s": 0.1, "group_s": 0.5, "load_s": 0.4}
    assert report.migrations == {"kv": 1, "recompute": 1}
    assert (report.prefill_tokens_avoided, report.kv_bytes_moved) == (500, 10)
    assert report.kv_fallbacks == {"corrupted or truncated in transit": 1}
    assert [g["world_size"] for g in report.world_sizes] == [1, 2]
    text = "\n".join(summary_lines(report))
    assert "trainer world size per step: 1–2 (1 2)" in text
    assert "rollout→train ×1, median 2.00 s (1 warm)" in text and "3 first starts" in text
    assert "sessions moved: 1 by kv, 1 by recompute; re-prefill avoided: 500 tokens" in text
    assert "KV moves that recomputed: 1× corrupted or truncated in transit" in text
    assert {f.name for f in write_report(report, tmp_path)} == {"report.json", "training_curve.png", "cell_timeline.png"}


def test_weight_sync_reports_each_versions_latency_the_generation_pause_and_what_retention_deleted():
    ref = BlobRef(digest="sha256:" + "1" * 64, size=1, store="object")

    def published(version: int, t: float):
        return ev(WeightsPublished(version=version, step=version - 1, weights=ref, format="shards",
                                   dtype="bfloat16", bytes=3 * 2**20, publish_s=0.5), t)

    def loaded(worker: str, version: int, t: float, pause: float | None):
        phases = {"fetch_s": 0.3, "pause_s": pause, "swap_s": 0.1} if pause is not None else {}
        return ev(WeightsLoaded(cell_id=worker, worker_id=worker, version=version, phases=phases), t)

    events = [
        published(0, 0), loaded("w0", 0, 1, None), loaded("w1", 0, 1, None),
        published(1, 10), loaded("w0", 1, 11, 0.2), loaded("w1", 1, 12, 0.4),
        loaded("w1", 1, 13, None),  # a redelivered record: the first one counts
        published(2, 20), loaded("w0", 2, 20.5, 0.1), loaded("w1", 2, 21, 0.3),
        ev(WeightsRetired(version=0, objects=4, bytes=3 * 2**20, kept=[1, 2]), 21),
    ]
    report = build_report("r", events)
    by_version = {s["version"]: s for s in report.weight_syncs}
    assert by_version[1]["served_s"] == 2.0 and by_version[1]["workers"] == 2 and by_version[1]["pauses"] == [0.2, 0.4]
    assert by_version[2]["served_s"] == 1.0
    assert (report.weights_retired, report.weights_retired_bytes) == (1, 3 * 2**20)
    text = "\n".join(summary_lines(report))
    assert "weight sync: 2 versions of 3.0 MiB (bfloat16); step end → every worker serving median 2.00 s" in text
    assert "(max 2.50; storing them median 0.50 s); generation paused median 0.250 s a load (max 0.400)" in text
    assert "weights retired: 1 versions, 3.0 MiB deleted" in text


def test_report_times_steps_and_folds_occupancy_busy_ranks_and_staleness() -> None:
    from shared.events import CallCompleted, ExecutionFinished, KvMigrated, QueryDispatched, RankStepped

    ref = BlobRef(digest="sha256:" + "1" * 64, size=1)
    events = [
        ev(QueryDispatched(query_id="q0", task_id="t", group_size=2, seeds=[1, 2], step=1, policy_version=0,
                           placements=["c0", "c1"]), 1),
        ev(ExecutionStarted(execution_id="a", query_id="q0", task_id="t", group_size=2, sample_index=0, seed=1,
                            step=1), 2),
        ev(ExecutionStarted(execution_id="b", query_id="q0", task_id="t", group_size=2, sample_index=1, seed=2,
                            step=1), 3),
        ev(CallCompleted(execution_id="b", call_id="b-0", call_index=0, record=ref, prompt_tokens=5,
                         new_prompt_tokens=5, completion_tokens=1, policy_version=0, cell_id="c1"), 4),
        ev(KvMigrated(execution_id="b", from_cell="c1", to_cell="c0", method="kv", tokens=5, bytes=10,
                      seconds=0.1), 6),
        ev(ExecutionFinished(execution_id="a", elapsed_s=7, calls=2), 9),
        ev(ExecutionFinished(execution_id="b", elapsed_s=7, calls=2), 10),
        ev(RankStepped(step=1, generation=1, cell_id="c1", rank=0, world_size=1, micro_batches=1, tokens=9,
                       seconds=2.0), 14),
        ev(ExecutionScored(execution_id="a", query_id="q0", reward=1.0, tests_passed=1, tests_total=1), 15),
        ev(StepCompleted(step=1, policy_version=1, world_size=1, seconds=2.0, metrics={}), 15.5),
    ]
    report = build_report("r", events)
    assert report.first_dispatch_s == 0.0  # the first event
    assert report.occupied == {"c0": [[1.0, 9.0]], "c1": [[2.0, 5.0]]}  # b moved to c0 at 5 s, both ended by 9
    assert report.rank_busy == {"c1": [[11.0, 13.0]]}
    assert report.staleness == {"mean": 1.0, "max": 1}
    assert report.steps[0].completed_s == 14.5
