"""The cell agent's pure parts: what runs on a cell (cell_launch.py), the fold of its processes' reports
(cell_reports.py) and its switch decisions (cell_switch.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from datetime import UTC, datetime, timedelta

import pytest

from services.scheduler.cell_launch import CellLaunch
from services.scheduler.cell_process import HOLD_ARGV, CellProcess
from services.scheduler.cell_reports import CellReports
from services.scheduler.cell_settings import CellSettings
from services.scheduler.cell_switch import keeps_old_process, kept_roles, merged_phases, restart_delay, takes_role_warm
from shared.cells import Role
from shared.events import CellDrained, EventData, GroupFormed, WeightsLoaded, new_event
from shared.settings import Settings

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def launch(index: int = 1, **cfg: object) -> CellLaunch:
    settings = Settings(run_id="r1", subject_prefix="gyre", database_url="postgresql://db", nats_url="nats://n")
    return CellLaunch(CellSettings(**{"count": 3, "health_port_base": 9300, **cfg}), settings, "n1", f"n1-cell{index}",
                      index)


def at(seconds: float, data: EventData, cause: uuid.UUID | None = None):
    return new_event(data, run_id="r1", stream_id="s", version=1, occurred_at=T0 + timedelta(seconds=seconds),
                     causation_id=cause)


def loaded(version: int, cell: str = "c0", **phases: float) -> WeightsLoaded:
    return WeightsLoaded(cell_id=cell, worker_id=cell, version=version, phases=phases)


def group(generation: int, *members: str) -> GroupFormed:
    return GroupFormed(generation=generation, members=list(members), world_size=len(members), next_step=0,
                       seconds=1.0, phases={"group_s": 0.5})


# ---- cell_launch ----


def test_a_cells_two_processes_get_health_ports_of_their_own() -> None:
    cell = launch(index=1)
    assert (cell.port(Role.ROLLOUT), cell.port(Role.TRAIN)) == (9301, 9304)  # the node's rollout ports, then train
    assert launch(health_port_base=0).port(Role.TRAIN) is None


def test_a_standby_worker_is_told_so_and_a_rank_gets_its_cell() -> None:
    cell = launch(index=0, device="cuda", accelerators=2)
    base = {"GYRE_HEALTH_PORT": "8000", "PATH": "/bin"}
    standby = cell.environment(Role.ROLLOUT, base, standby=True)
    assert (standby["GYRE_ROLLOUT_STANDBY"], standby["GYRE_ROLLOUT_CELL_ID"], standby["GYRE_HEALTH_PORT"]) == (
        "1", "n1-cell0", "9300")
    assert cell.environment(Role.ROLLOUT, base)["GYRE_ROLLOUT_STANDBY"] == "0"
    rank = cell.environment(Role.TRAIN, base)
    assert (rank["GYRE_TRAINER_CELL_ID"], rank["GYRE_HEALTH_PORT"], rank["CUDA_VISIBLE_DEVICES"]) == (
        "n1-cell0", "9303", "0,1")
    assert "GYRE_ROLLOUT_STANDBY" not in rank and rank["PATH"] == "/bin" and rank["GYRE_NATS_URL"] == "nats://n"


def test_the_train_role_runs_a_trainer_rank_ready_once_its_group_forms_by_default() -> None:
    cell = launch()
    assert cell.command(Role.TRAIN, "py") == ["py", "-m", "services.trainer", "rank"]
    assert (cell.readiness(Role.TRAIN), cell.readiness(Role.ROLLOUT)) == ("group", "status")
    assert cell.reports_its_drain(Role.TRAIN) and cell.reports_its_drain(Role.ROLLOUT)


def test_a_placeholder_or_an_unreachable_health_port_is_only_waited_to_start() -> None:
    hold = launch(train_command="hold")
    assert hold.command(Role.TRAIN, "py") == HOLD_ARGV and hold.readiness(Role.TRAIN) == "started"
    assert not hold.reports_its_drain(Role.TRAIN)
    assert launch(train_ready="health", health_port_base=0).readiness(Role.TRAIN) == "started"
    assert launch(train_command="{python} serve {port} {devices}").command(Role.TRAIN, "py") == [
        "py", "serve", "9304", "1"]


# ---- cell_reports ----


def test_a_drain_ends_only_with_the_report_its_own_order_caused_and_only_once() -> None:
    reports = CellReports("c0")
    mine, other = uuid.uuid4(), uuid.uuid4()
    drained = CellDrained(cell_id="c0", worker_id="c0", migrated_sessions=2, parked_sessions=0, seconds=1.0)
    assert reports.fold(at(1, drained, cause=other))
    assert reports.drained(mine) is None
    reports.fold(at(2, drained, cause=mine))
    assert reports.drained(mine) == drained and reports.drained(mine) is None
    assert not reports.fold(at(3, drained.model_copy(update={"cell_id": "c1"}), cause=mine))  # another cell's


def test_a_worker_is_ready_with_its_first_load_since_the_switch_began_not_an_older_or_a_later_one() -> None:
    reports = CellReports("c0")
    for seconds, version in ((1, 3), (5, 4), (9, 5)):
        reports.fold(at(seconds, loaded(version, wake_s=float(version))))
    reports.fold(at(5, loaded(4, wake_s=4.0)))  # delivered twice
    reports.fold(at(6, loaded(9, cell="c1")))
    assert len(reports.loads) == 3
    assert reports.loaded_since(T0 + timedelta(seconds=2)) == loaded(4, wake_s=4.0)
    assert reports.loaded_since(T0 + timedelta(seconds=10)) is None


def test_a_rank_is_ready_with_the_first_group_formed_after_the_switch_began_that_lists_its_cell() -> None:
    reports = CellReports("c0")
    for data in (group(1, "c0"), group(2, "c1"), group(4, "c0", "c1"), group(3, "c0"), group(3, "c0")):
        reports.fold(at(1, data))
    assert [g.generation for g in reports.groups] == [1, 4, 3]  # a group without the cell is not its news
    assert reports.group_after(1) == group(3, "c0")
    assert reports.group_after(4) is None


# ---- cell_switch ----


def test_a_warm_cell_keeps_both_roles_processes_and_a_cold_one_only_its_roles() -> None:
    assert kept_roles(Role.IDLE, warm=True) == (Role.ROLLOUT, Role.TRAIN)  # before its first order: both stand by
    assert kept_roles(Role.IDLE, warm=True, parked=True) == ()  # ordered idle: nothing
    assert kept_roles(Role.IDLE, warm=False) == ()
    assert kept_roles(Role.TRAIN, warm=True) == (Role.ROLLOUT, Role.TRAIN)
    assert kept_roles(Role.TRAIN, warm=False) == (Role.TRAIN,)


@pytest.mark.parametrize(("warm", "target", "reports", "drained", "kept"), [
    (True, Role.TRAIN, True, True, True),  # let go as asked: it stands by
    (True, Role.TRAIN, True, False, False),  # silent past the drain timeout: state unknown
    (True, Role.TRAIN, False, False, True),  # a process that never reports is not waited for, and stays
    (True, Role.IDLE, True, True, False),  # an idle cell keeps nothing
    (False, Role.TRAIN, True, True, False),  # the restart path
])
def test_the_old_roles_process_stays_only_on_a_warm_cell_that_it_let_go_of(warm, target, reports, drained,
                                                                           kept) -> None:
    assert keeps_old_process(warm=warm, target=target, reports_drain=reports, drained=drained) is kept


def test_a_switch_is_warm_only_onto_a_running_process_that_its_release_wakes() -> None:
    assert takes_role_warm(warm=True, released=True, target_running=True)
    assert not takes_role_warm(warm=True, released=True, target_running=False)  # its standby died
    assert not takes_role_warm(warm=False, released=True, target_running=True)
    assert not takes_role_warm(warm=True, released=False, target_running=True)  # no release: nothing wakes it


def test_a_process_that_keeps_crashing_waits_longer_each_time_up_to_the_cap() -> None:
    assert [restart_delay(2.0, 60.0, n) for n in (1, 2, 3, 4, 5, 6, 100)] == [2, 4, 8, 16, 32, 60, 60]


def test_a_switchs_phases_are_its_reports_merged_in_order() -> None:
    assert merged_phases({"drain_s": 1.0}, {"wake_s": 0.5, "load_s": 0.2}, {"start_s": 3.0}) == {
        "drain_s": 1.0, "wake_s": 0.5, "load_s": 0.2, "start_s": 3.0}


def test_a_pinned_cpu_cell_gets_its_own_cores_where_the_node_has_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    cell = launch(1, pin_cores=True, accelerators=2)
    assert cell.cores == [2, 3]
    env = cell.environment(Role.ROLLOUT, {})
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("2,3", "2")
    assert launch(1, accelerators=2).cores is None, "not asked for"
    assert launch(1, pin_cores=True, accelerators=3).cores is None, "3 cells × 3 cores: the node has 6"
    assert launch(1, pin_cores=True, device="cuda").cores is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch(1).environment(Role.ROLLOUT, {})


async def test_a_pinned_process_and_its_threads_run_on_the_cores_given(tmp_path: Path) -> None:
    import os
    import sys

    core = sorted(os.sched_getaffinity(0))[-1]
    argv = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    proc = await CellProcess.start(argv, env=dict(os.environ), role=Role.ROLLOUT, log_path=tmp_path / "p.log",
                                   cores=[core])
    assert await proc.wait() == 0
    await proc.stop(1.0)
    assert (tmp_path / "p.log").read_text().strip() == f"[{core}]"
