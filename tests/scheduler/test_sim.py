"""Tests of the cluster simulator: determinism, calibration statistics, bounds and the report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from services.scheduler import policies
from services.scheduler.sim import run_sim
from services.scheduler.sim.bounds import DecodeLaw, alone_seconds, context_lag_nominal_s, lower_bound
from services.scheduler.sim.clairvoyant import ClairvoyantPolicy
from services.scheduler.sim.cli import sim_app
from services.scheduler.sim.engine import SimOptions, Simulation
from services.scheduler.sim.presets import get_preset, preset_names
from services.scheduler.sim.runner import async_rollout_cells, simulate_policy
from services.scheduler.sim.workload import Preset, PresetError, Workload, sample_workload, workload_stats

# A small cluster with the flagship's workload shape: a few seconds per policy.
SMALL = dict(steps=5, cells=16, batch_queries=2)


def strip_wall(report: dict) -> dict:
    text = json.dumps(report, sort_keys=True)
    data = json.loads(text)
    data.pop("wall_s")
    for m in data["policies"].values():
        m.pop("sim_wall_s")
    return data


def test_same_seed_gives_the_same_report_and_another_seed_does_not() -> None:
    a = run_sim("flagship", seed=3, plots=False, **SMALL)
    b = run_sim("flagship", seed=3, plots=False, **SMALL)
    c = run_sim("flagship", seed=4, plots=False, **SMALL)
    assert strip_wall(a) == strip_wall(b)
    assert strip_wall(a)["policies"] != strip_wall(c)["policies"]


def test_simulator_drives_the_schedulers_own_policy_objects() -> None:
    sim, _ = simulate_policy(get_preset("flagship").scaled(**SMALL), 0, "elastic")
    assert type(sim.policy) is policies.ElasticPolicy
    assert sim.policy.decide.__module__ == "services.scheduler.policies.elastic"


@pytest.mark.parametrize(
    ("preset", "stat", "published", "tolerance"),
    [
        ("repo", "mean_execution_h", 1.93, 0.04),
        ("repo", "mean_query_h", 2.96, 0.06),
        ("flagship", "share_queries_ge_4h", 0.611, 0.02),
        ("flagship", "mean_context_tokens", 700_000, 25_000),
    ],
)
def test_presets_reproduce_the_published_workload_statistics(
    preset: str, stat: str, published: float, tolerance: float
) -> None:
    p = get_preset(preset)
    stats = workload_stats(p, sample_workload(p, 0, n_queries=20_000))
    assert stats[stat] == pytest.approx(published, abs=tolerance)


@pytest.mark.parametrize("preset", ["terminal", "swe"])
def test_terminal_and_swe_presets_have_shorter_tails_than_repository_building(preset: str) -> None:
    repo = workload_stats(get_preset("repo"), sample_workload(get_preset("repo"), 0, n_queries=5_000))
    p = get_preset(preset)
    other = workload_stats(p, sample_workload(p, 0, n_queries=5_000))
    assert other["p99_execution_h"] < repo["p99_execution_h"]
    assert other["mean_query_h"] < repo["mean_query_h"]


def test_every_policy_finishes_above_the_lower_bound_within_the_staleness_bound() -> None:
    report = run_sim("flagship", seed=1, plots=False, **SMALL)
    lb = report["lower_bound"]["hours"]
    for name, m in report["policies"].items():
        assert m["end_to_end_h"] >= lb, name
        assert len(m["step_times_h"]) == SMALL["steps"]
        assert m["staleness"]["max"] <= m["staleness"]["bound"]
    assert report["policies"]["async"]["migrations"] == 0
    assert report["policies"]["elastic"]["switches"] > 0


def test_elastic_parks_no_session_and_validates_every_decision() -> None:
    """After every decision (each checked by the invariant checker) every live session sits on a rollout
    cell: elastic migrates sessions off a cell before it trains, never parks them."""
    p = get_preset("flagship").scaled(**SMALL)
    seen: list[int] = []

    class Checked(Simulation):
        def _decide(self) -> None:
            super()._decide()
            seen.append(len(self.sessions))
            parked = [s for s in self.sessions.values() if self.cells[s.cell].role is not policies.Role.ROLLOUT]
            assert not parked, f"t={self.t}: {len(parked)} sessions parked"

    sim = Checked(p, sample_workload(p, 2), policies.ElasticPolicy(), SimOptions(validate=True))
    sim.run()
    assert sim.version == p.steps
    assert max(seen) > 0  # the check ran while sessions were live


def test_the_async_split_always_holds_one_whole_query() -> None:
    # Slow training sizes the rollout share to one cell, which admits 10 of a query's 16 sessions.
    base = get_preset("flagship")
    p = base.scaled(steps=base.max_staleness + 3, cells=8, batch_queries=1, train_tokens_per_cell_s=200.0)
    cells = async_rollout_cells(p, 2)
    assert cells == 2
    policy = policies.AsyncPolicy(rollout_cells=cells, fill=p.fill)
    sim = Simulation(p, sample_workload(p, 2), policy, SimOptions(record_timeline=False))
    sim.run()
    assert len(sim.step_times) == p.steps


def test_lower_bound_grows_with_the_work() -> None:
    p = get_preset("flagship").scaled(**SMALL)
    w = sample_workload(p, 0)
    heavier = p.scaled(train_tokens_per_cell_s=p.train_tokens_per_cell_s / 4)
    assert lower_bound(heavier, w).resource_h > lower_bound(p, w).resource_h


def reduced(name: str) -> Preset:
    """A preset on a quarter of its cluster with the batch scaled along (same load per cell), few steps."""
    p = get_preset(name)
    return p.scaled(
        steps=p.max_staleness + 3, cells=max(4, p.cells // 4), batch_queries=max(1, p.batch_queries // 4)
    )


@pytest.mark.parametrize("budget", ["work", "wall_clock"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", preset_names())
def test_no_policy_beats_the_lower_bound_on_any_preset_or_seed(name: str, seed: int, budget: str) -> None:
    p = reduced(name).scaled(budget=budget)
    w = sample_workload(p, seed)
    opts = SimOptions(record_timeline=False)
    lb = lower_bound(p, w, opts)
    contenders = [
        policies.ElasticPolicy(fill=p.fill, pack_fill=p.fill),
        policies.AsyncPolicy(rollout_cells=async_rollout_cells(p, seed), fill=p.fill),
        policies.AsyncPolicy(rollout_cells=p.cells - 1, fill=p.fill),
        policies.ColocatePolicy(fill=p.fill, run_ahead=True),
        policies.ColocatePolicy(fill=p.fill, run_ahead=False),
        policies.ElasticPolicy(fill=p.fill, pack_fill=p.fill, transfer="recompute", gate="step"),  # the peer's
        # The strongest adversary we have: it knows every execution's duration and final context.
        ClairvoyantPolicy(p, w, slack=1.1),
    ]
    for policy in contenders:
        end_h = Simulation(p, w, policy, opts).run() / 3600.0
        assert end_h >= lb.hours, (policy, end_h, lb)


def test_bound_follows_the_engines_decode_law() -> None:
    p = get_preset("flagship").scaled(**SMALL)
    law = DecodeLaw.of(p)
    sim = Simulation(p, sample_workload(p, 0), policies.ElasticPolicy())
    cell = sim.cells[0]
    cell.role = policies.Role.ROLLOUT
    cell.sessions.add(0)
    for fill in (0.0, 0.1, 0.5, 1.0, 1.3):
        cell.a, cell.k, cell.v = fill * cell.cap, 0.0, 0.0
        assert 1.0 / sim._rate(cell) == pytest.approx(law.wall_per_nominal(fill * cell.cap))
        assert law.wall_per_nominal(fill * cell.cap) >= law.a + law.beta * fill * cell.cap - 1e-12
    best = law.best_token_throughput()
    for fill in np.linspace(0.0, 3.0, 301):
        c = fill * law.capacity
        assert c / law.wall_per_nominal(c) <= best * (1 + 1e-12)


def test_critical_path_charges_each_execution_its_own_context() -> None:
    p = get_preset("flagship").scaled(**SMALL)
    w = sample_workload(p, 0)
    law = DecodeLaw.of(p)
    lag = context_lag_nominal_s(p, SimOptions())
    alone = alone_seconds(p, w, lag)
    # Never faster than a session on an empty cell, and slower than that once its context has grown.
    assert np.all(alone >= w.duration_s * law.a)
    grown = w.duration_s > 2 * lag
    assert np.all(alone[grown] > w.duration_s[grown] * (law.a + law.beta * p.prompt_tokens))
    # Without the engine's rate lag the bound only rises.
    assert np.all(alone_seconds(p, w, 0.0) >= alone)


def test_cli_writes_the_json_report_and_the_timeline(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        sim_app,
        ["--preset", "terminal", "--steps", "3", "--cells", "16", "--batch-queries", "16", "--out", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert set(summary["hours"]) == {"elastic", "async", "colocate", "reprefill", "elastic-recompute"}
    assert summary["speedups"]["elastic_vs_reprefill"] > 0
    report = json.loads((tmp_path / "report_terminal.json").read_text())
    assert report["lower_bound"]["hours"] > 0
    assert (tmp_path / "timeline_terminal.png").stat().st_size > 10_000


def test_unknown_preset_is_a_clear_error() -> None:
    with pytest.raises(PresetError, match="expected a preset"):
        get_preset("nl2repo-xxl")
    assert {"flagship", "repo", "terminal", "swe"} <= set(preset_names())


# ---------------------------------------------------------------- the agent's time budget


def one_query(hours: list[float], budget: str, timeout_h: float = 8.0, **changes: object) -> tuple[Preset, Workload]:
    """One query of len(hours) executions on two cells, contexts growing 50K tokens a nominal hour."""
    p = get_preset("flagship").scaled(
        steps=1, batch_queries=1, group_size=len(hours), cells=2, budget=budget, timeout_h=timeout_h, **changes
    )
    h = np.array(hours)
    ctx = (p.prompt_tokens + 50_000 * h).astype(np.int64)
    return p, Workload(duration_s=h * 3600.0, context_tokens=ctx, timed_out=np.zeros(len(h), bool), group_size=len(h))


def test_a_wall_clock_budget_ends_an_execution_at_its_deadline_with_the_work_it_did() -> None:
    p, w = one_query([1.0, 20.0], "wall_clock")
    sim = Simulation(p, w, policies.ElasticPolicy())
    sim.run()
    assert sim.budget_cuts == 1
    cut_tokens = sim.trained_tokens - int(w.context_tokens[0])
    progress_s = (cut_tokens - p.prompt_tokens) / 50_000 * 3600.0
    law = DecodeLaw.of(p)
    budget_s = 8 * 3600.0
    # Eight hours of wall clock at a decode speed between an empty cell's and its final context's.
    assert budget_s / law.wall_per_nominal(float(w.context_tokens[1])) <= progress_s <= budget_s / law.a
    assert 8.0 < sim.step_times[0] / 3600.0 < 8.5  # the budget, then training and the optimiser step
    assert sim.step_times[0] / 3600.0 >= lower_bound(p, w).hours


def test_a_work_budget_lets_every_execution_finish_its_work() -> None:
    # The engine enforces no deadline under a work budget (the workload caps the work instead): an
    # execution given 7.5 nominal hours under a 2-h budget still runs them all.
    p, w = one_query([1.0, 7.5], "work", timeout_h=2.0)
    sim = Simulation(p, w, policies.ElasticPolicy())
    sim.run()
    assert sim.budget_cuts == 0
    assert sim.trained_tokens == int(w.context_tokens.sum())
    assert sim.step_times[0] / 3600.0 > 7.5 * DecodeLaw.of(p).a


@dataclass
class ParkAndMigrate:
    """Puts both sessions of one query on the first cell, then migrates one away (slowly) and turns the
    first cell to training, parking the other: both are off a rollout cell when their budget runs out."""

    name: str = "park-and-migrate"
    allows_parking: bool = True
    moved_at: float | None = None

    def decide(self, snap: policies.Snapshot) -> list[policies.Action]:
        first, second = (c.cell_id for c in snap.cells)
        rollout, train = policies.Role.ROLLOUT, policies.Role.TRAIN
        if snap.now_s == 0.0:
            return [policies.AssignCell(first, rollout), policies.AssignCell(second, rollout)]
        if snap.queued and all(c.state is policies.CellState.ACTIVE for c in snap.cells):
            q = snap.queued[0]
            return [policies.DispatchQuery(q.query_id, 0, (first,) * q.group_size)]
        if self.moved_at is None and snap.live and snap.now_s > 600.0:
            self.moved_at = snap.now_s
            e = snap.live[1]
            return [policies.MigrateSession(e.execution_id, first, second), policies.AssignCell(first, train)]
        return []


def test_a_session_parked_or_in_migration_is_cut_at_its_deadline_with_the_work_it_had_done() -> None:
    # 1e6 B/s: the migrating session's KV is still in flight when its 2-h budget runs out; slow training
    # keeps the step (and the run) going until after the migration lands.
    p, w = one_query([20.0, 20.0], "wall_clock", timeout_h=2.0, migration_bytes_per_s=1e6, train_tokens_per_cell_s=5.0)
    policy = ParkAndMigrate()
    sim = Simulation(p, w, policy, SimOptions(validate=False))
    end_s = sim.run()
    assert policy.moved_at is not None and policy.moved_at < 2 * 3600.0
    assert sim.budget_cuts == 2
    # Neither session progressed after it left the rollout cell: both hold the context they had then.
    law = DecodeLaw.of(p)
    most = p.prompt_tokens + 50_000 * policy.moved_at / 3600.0 / law.a
    assert 2 * p.prompt_tokens < sim.trained_tokens <= 2 * most
    # The KV landed after the cut (and was dropped); no cell still counts either session.
    landed = [t for t, kind, *_ in sim.events if kind == 3]
    assert not landed and end_s > 2 * 3600.0 + 60.0
    for cell in sim.cells:
        assert not cell.sessions and cell.a == 0.0 and cell.k == 0.0


def test_the_budget_caps_sampled_work_only_when_it_counts_work() -> None:
    work = get_preset("flagship")
    wall = work.scaled(budget="wall_clock")
    assert sample_workload(work, 0).duration_s.max() <= work.timeout_h * 3600.0
    longest = sample_workload(wall, 0).duration_s.max()
    # Under a wall-clock budget the engine cuts; the workload stops only at what no cell could finish.
    assert work.timeout_h * 3600.0 < longest <= wall.nominal_cap_h() * 3600.0
    assert wall.nominal_cap_h() == pytest.approx(wall.timeout_h / (1.0 - wall.gen_fraction))


def test_drift_grows_each_steps_work_from_the_same_draws_and_async_keeps_the_split_sized_at_the_start() -> None:
    base = get_preset("terminal").scaled(steps=6, batch_queries=4, cells=16, budget="wall_clock")
    drifting = base.scaled(drift_per_step=0.1)
    still, grown = sample_workload(base, 3), sample_workload(drifting, 3)
    g, b = base.group_size, base.batch_queries
    step = np.arange(still.duration_s.shape[0]) // (g * b)
    # Same draws, each step's difficulty 1.1^step times as large (below the cap that both share).
    uncapped = (still.duration_s < base.nominal_cap_h() * 3600.0 / 1.1**5) & ~still.timed_out
    assert np.allclose(grown.duration_s[uncapped], still.duration_s[uncapped] * 1.1 ** step[uncapped])
    assert grown.context_tokens.sum() > still.context_tokens.sum()
    assert async_rollout_cells(drifting, 0) == async_rollout_cells(base, 0)  # sized from the start
    with pytest.raises(PresetError, match="drift_per_step"):
        base.scaled(drift_per_step=-1.0)


def test_the_drift_sweep_reports_each_mode_per_rate_and_the_cli_writes_it(tmp_path: Path) -> None:
    from services.scheduler.sim.sweep import run_drift_sweep

    small = get_preset("terminal").scaled(cells=16, batch_queries=16)
    rows = run_drift_sweep(small, rates=(0.0, 0.2), steps=3)
    assert [r["drift_per_step"] for r in rows] == [0.0, 0.2]
    assert all(set(r["hours"]) == {"elastic", "async", "colocate"} and r["elastic_vs_async"] > 0 for r in rows)
    assert rows[1]["lower_bound_h"] > rows[0]["lower_bound_h"]  # more work, whatever the schedule
    assert rows[1]["async_rollout_cells"] == rows[0]["async_rollout_cells"]
    args = ["--preset", "terminal", "--steps", "2", "--cells", "16", "--batch-queries", "16", "--drift", "0.1"]
    result = CliRunner().invoke(sim_app, [*args, "--drift-sweep", "--no-plots", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "report_terminal.json").read_text())["parameters"]["drift_per_step"] == 0.1
    assert len(json.loads((tmp_path / "drift_terminal.json").read_text())) == 4


def test_cli_runs_the_preset_with_its_overrides_and_a_wall_clock_budget(tmp_path: Path) -> None:
    args = ["--preset", "terminal", "--steps", "2", "--cells", "16", "--batch-queries", "16", "--sweep"]
    result = CliRunner().invoke(sim_app, [*args, "--budget", "wall_clock", "--no-plots", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report_terminal.json").read_text())
    assert report["parameters"]["budget"] == "wall_clock" and report["parameters"]["cells"] == 16
    assert all("budget_cuts" in m for m in report["policies"].values())
    # The sweep scales the overridden cluster (16 cells), not the stock preset's 64.
    sweep = json.loads((tmp_path / "sweep_terminal.json").read_text())
    assert [row["x"] for row in sweep["cluster_size"]] == [8, 16, 32]


def test_an_unknown_budget_is_a_clear_error() -> None:
    with pytest.raises(PresetError, match="budget must be one of"):
        get_preset("swe").scaled(budget="turns")
    result = CliRunner().invoke(sim_app, ["--preset", "terminal", "--steps", "1", "--budget", "turns", "--no-plots"])
    assert result.exit_code == 2
    assert "budget must be one of" in result.output


# ---------------------------------------------------------------- calibration against the paper
# Reduced runs (fewer steps, for terminal also a quarter of the cluster with the batch scaled along,
# so the load per cell is unchanged); the full presets run in bench/sim.py. Where the model does NOT
# reproduce a published figure (elastic over async on the flagship and SWE presets), the tests assert
# what the model does show — elastic still beats async — and docs/simulator.md says which assumption
# breaks.

ASYNC_RANGE = (1.38, 1.78)
COLOCATE_RANGE = (1.21, 1.85)


@pytest.fixture(scope="module")
def flagship_reduced() -> dict:
    return run_sim("flagship", 12, 0, None, plots=False, options=SimOptions(record_timeline=False))


@pytest.fixture(scope="module")
def terminal_reduced() -> dict:
    return run_sim(
        "terminal", 4, 0, None, plots=False, options=SimOptions(record_timeline=False), batch_queries=64, cells=32
    )


def test_flagship_elastic_over_colocate_is_within_10_percent_of_published(flagship_reduced: dict) -> None:
    assert flagship_reduced["speedups"]["elastic_vs_colocate"] == pytest.approx(91.47 / 75.42, rel=0.10)


def test_terminal_elastic_over_async_falls_in_the_published_range(terminal_reduced: dict) -> None:
    assert ASYNC_RANGE[0] <= terminal_reduced["speedups"]["elastic_vs_async"] <= ASYNC_RANGE[1]


def test_flagship_elastic_beats_async(flagship_reduced: dict) -> None:
    # Published: 1.78x. An async split sized to mean demand loses less here (docs/simulator.md, "gaps").
    assert flagship_reduced["speedups"]["elastic_vs_async"] > 1.05


def test_terminal_elastic_over_colocate_falls_in_the_published_range(terminal_reduced: dict) -> None:
    assert COLOCATE_RANGE[0] <= terminal_reduced["speedups"]["elastic_vs_colocate"] <= COLOCATE_RANGE[1]


def test_swe_elastic_beats_async() -> None:
    # Published: 1.57x; the model gives less for the same reason as the flagship (docs/simulator.md).
    report = run_sim(
        "swe", 4, 0, None, plots=False, options=SimOptions(record_timeline=False), batch_queries=64, cells=32
    )
    assert report["speedups"]["elastic_vs_async"] > 1.1


def test_sweep_reports_speedups_per_budget_and_cluster_size_and_draws_them(tmp_path: Path) -> None:
    from services.scheduler.sim.sweep import run_sweep

    sweep = run_sweep("terminal", steps=2, budgets=(1.0,), sizes=(0.25, 0.5), out_dir=tmp_path)
    assert [row["x"] for row in sweep["cluster_size"]] == [16, 32]
    assert sweep["tail"][0]["x"] == get_preset("terminal").timeout_h
    for row in sweep["tail"] + sweep["cluster_size"]:
        assert row["elastic_vs_async"] > 0 and row["elastic_vs_colocate"] > 0
    assert (tmp_path / "sweep_terminal.png").stat().st_size > 10_000
    # A preset with overrides is swept as given: sizes scale its cells, not the stock preset's.
    small = get_preset("terminal").scaled(cells=32, budget="wall_clock")
    again = run_sweep(small, steps=2, budgets=(1.0,), sizes=(0.25,))
    assert [row["x"] for row in again["cluster_size"]] == [8]


def test_the_clairvoyant_reference_is_deterministic_and_runs_under_the_rules_of_every_policy() -> None:
    p = get_preset("flagship").scaled(**SMALL)
    w = sample_workload(p, 3)
    opts = SimOptions(record_timeline=False)  # validate=True: every decision is checked against the rules
    runs = [Simulation(p, w, ClairvoyantPolicy(p, w, slack=1.15), opts) for _ in range(2)]
    ends = [sim.run() for sim in runs]
    assert ends[0] == ends[1] and runs[0].step_times == runs[1].step_times
    assert max(runs[0].staleness) <= p.max_staleness
    assert runs[0].peak_fill <= 1.05  # packs by the sessions' own contexts, never far past a cell's KV
    assert len(runs[0].step_times) == p.steps


# ---------------------------------------------------------------- the peer policy: abort and prefill again


@dataclass
class MoveOnce:
    """Puts all of one query's sessions on the first cell, then moves the last one to the second by `method`."""

    method: str
    name: str = "move-once"
    allows_parking: bool = False
    moved_at: float | None = None

    def decide(self, snap: policies.Snapshot) -> list[policies.Action]:
        first, second = (c.cell_id for c in snap.cells)
        if snap.now_s == 0.0:
            return [policies.AssignCell(cell, policies.Role.ROLLOUT) for cell in (first, second)]
        if snap.queued and all(c.state is policies.CellState.ACTIVE for c in snap.cells):
            q = snap.queued[0]
            return [policies.DispatchQuery(q.query_id, 0, (first,) * q.group_size)]
        if snap.trainer.batch_complete:
            return [policies.AssignCell(c.cell_id, policies.Role.TRAIN) for c in snap.cells
                    if c.role is not policies.Role.TRAIN and c.state is policies.CellState.ACTIVE]
        if self.moved_at is None and len(snap.live) == 2 and snap.now_s > 1_800.0:
            self.moved_at = snap.now_s
            e = snap.live[-1]
            return [policies.MigrateSession(e.execution_id, first, second, self.method)]  # type: ignore[arg-type]
        return []


def test_a_recompute_move_keeps_the_work_done_and_stalls_its_target_for_the_prefill() -> None:
    """The session loses nothing it generated (verl resubmits prompt + partial output), but its history is prefilled
    again on the target at the preset's prefill rate, during which the target decodes nothing."""
    hours = [1.0, 3.0]
    runs = {}
    for method in ("kv", "recompute"):
        p, w = one_query(hours, "work", train_tokens_per_cell_s=1e6)
        policy = MoveOnce(method)
        sim = Simulation(p, w, policy, SimOptions(decide_interval_s=60.0, tick_s=600.0))
        sim.run()
        runs[method] = (sim, policy)
        assert sim.trained_tokens == int(w.context_tokens.sum()), "every session did all of its work"
    kv, (recompute, policy) = runs["kv"][0], runs["recompute"]
    assert (kv.recomputes, recompute.recomputes) == (0, 1) and kv.migrations == recompute.migrations == 1
    assert recompute.migrated_bytes == 0.0 and kv.migrated_bytes > 0.0
    assert policy.moved_at is not None
    p = recompute.p
    assert p.prefill_rate() == 3.0 * p.train_tokens_per_cell_s
    # The moved session's history when it moved, at the prefill rate: what the target stalled for.
    assert recompute.recomputed_tokens > p.prompt_tokens
    assert recompute.prefill_stall_cell_s == pytest.approx(recompute.recomputed_tokens / p.prefill_rate())
    # With prefill 3x a 1e6 tokens/s trainer the recompute is quicker than 50 GB/s of KV at 180 KB a token.
    assert recompute.migration_s < kv.migration_s


def test_a_target_prefilling_decodes_nothing_until_it_is_done() -> None:
    p, w = one_query([2.0, 2.0], "work")
    sim = Simulation(p, w, policies.ElasticPolicy())
    cell = sim.cells[1]
    cell.role = policies.Role.ROLLOUT
    cell.sessions.add(0)
    cell.a = 0.2 * cell.cap
    cell.prefill_until = 100.0
    sim.t = 50.0
    assert sim._rate(cell) == 0.0
    sim.t = 100.0
    assert sim._rate(cell) > 0.0


def test_the_peer_policy_moves_every_session_by_recompute_and_finishes_above_the_bound() -> None:
    p = reduced("terminal")
    report = run_sim(p, seed=0, policies=("elastic", "reprefill", "elastic-recompute"), plots=False)
    runs = report["policies"]
    assert runs["elastic"]["recomputes"] == 0 and runs["elastic"]["migrations"] > 0
    for name in ("reprefill", "elastic-recompute"):
        assert runs[name]["recomputes"] == runs[name]["migrations"] > 0, name
        assert runs[name]["prefill_stall_cell_h"] > 0.0
        assert runs[name]["end_to_end_h"] >= report["lower_bound"]["hours"]
        assert runs[name]["staleness"]["max"] <= p.max_staleness
    assert runs["reprefill"]["sample_wait_s"] > 0.0, "the gate had a measured wait to go on"
    speedups = report["speedups"]
    assert set(speedups) >= {"elastic_vs_reprefill", "elastic_vs_elastic_recompute", "kv_share_of_reprefill_gap"}
    gap = runs["reprefill"]["end_to_end_h"] - runs["elastic"]["end_to_end_h"]
    from_kv = runs["elastic-recompute"]["end_to_end_h"] - runs["elastic"]["end_to_end_h"]
    assert speedups["kv_share_of_reprefill_gap"] == pytest.approx(from_kv / gap)


def test_a_fitted_cell_holds_the_kv_the_live_scheduler_admitted_against() -> None:
    from services.scheduler.sim.calibrate import _cell_capacity

    # Per cell the smaller of the registered capacity and its engine's report, either alone; the median of cells.
    assert _cell_capacity({"c0": 1 << 20, "c1": 1 << 20}, {"c0": 73_728, "c1": 73_728}) == 73_728
    assert _cell_capacity({"c0": 50_000}, {"c1": 80_000}) == 65_000
    assert _cell_capacity({}, {}) == 1 << 20  # neither: the scheduler's default


def test_a_fitted_preset_admits_as_many_sessions_a_cell_as_the_live_scheduler() -> None:
    from services.scheduler.policies import FILL, SESSION_RESERVE_TOKENS
    from services.scheduler.sim.calibrate import Calibration, preset_for
    from services.scheduler.sim.engine import session_reserve_tokens

    config = {"scheduling": {"queries_per_step": 1, "group_size": 2, "max_staleness": 1, "cells": 2},
              "budgets": {"wall_s": 90}, "model": {"max_model_len": 8192}}
    for capacity in (18_432, 73_728, 1 << 20):  # 2.25, 9 and 128 reserves a cell
        cal = Calibration(run_id="r", executions=4, gen_fraction=0.3, per_token_s=0.01, per_token_slope_s=0.001,
                          kv_capacity_tokens=capacity, to_train_s=1.0, to_rollout_s=0.2,
                          migration_tokens_per_s=None, train_tokens_per_cell_s=1000.0, step_overhead_s=0.5,
                          mean_context_tokens=1500.0, prompt_tokens=500.0, duration_log_mean=3.0,
                          duration_log_sd=1.0, mean_sessions_per_cell=2.0)
        preset = preset_for(cal, config, steps=1)
        live = int(capacity * FILL) // SESSION_RESERVE_TOKENS
        assert int(capacity * preset.fill) // session_reserve_tokens(preset) == live, capacity
