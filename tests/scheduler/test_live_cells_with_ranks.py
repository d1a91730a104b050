"""The cell agent with the real trainer: a real rank process (`python -m services.trainer rank`, torch, gloo) on
the cell and the real coordinator (the trainer service) answering it, with the fake rollout worker on the other
side (no vLLM here: tests/rollout covers the worker's standby and wake). Slow: it imports torch in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.cell_agent import CellAgent
from services.scheduler.cell_settings import CellSettings
from services.trainer.options import TrainerOptions
from tests.conftest import Infra, unique
from tests.trainer.cluster import FastTrainerService, settings_for
from tests.trainer.trainer_trees import tiny_model

from .live_cells import Running, assign, fake_worker, launches, wait_for, wait_until

pytestmark = pytest.mark.slow

CELL = "n1-cell0"


@pytest.mark.timeout(900)
async def test_a_warm_cell_moves_its_role_between_a_real_trainer_rank_and_a_worker(
        store, bus, infra: Infra, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_path / "model"
    tiny_model("qwen3", seed=11).save_pretrained(model_dir)
    run_id = unique("cells-")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state")
    # What the agent's children inherit (a deployment sets them in the agent's environment).
    monkeypatch.setenv("GYRE_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("GYRE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    agent = CellAgent(settings, CellSettings(count=1, node_id="n1", health_port_base=0, ready_timeout_s=600,
                                             restart_backoff_s=0.5, rollout_command=fake_worker("peer", tmp_path)))
    coordinator = FastTrainerService(settings, TrainerOptions(precision="fp32", idle_wait_s=1.0,
                                                              collective_timeout_s=60.0))
    await coordinator.start()
    try:
        async with Running(store, bus, infra, agent):
            # From idle: the rank has stood by since the cell registered; the release from idle lets it in.
            await assign(store, run_id, CELL, "train")
            await wait_for(store, run_id, CELL, "cell.ready", 1, timeout=600)
            await wait_until(lambda: launches(tmp_path, CELL, "rollout"), "the standby worker")
            await assign(store, run_id, CELL, "rollout")  # the coordinator lets the rank go; the worker wakes
            await wait_for(store, run_id, CELL, "cell.ready", 2, timeout=600)
            await assign(store, run_id, CELL, "train")  # the worker drains and sleeps; the rank joins again
            events = await wait_for(store, run_id, CELL, "cell.ready", 3, timeout=600)
            ranks = [p for p in agent.runners[CELL].procs.values() if p.role == "train"]
            assert len(ranks) == 1 and agent.runners[CELL].launches == 2  # one rank, one worker, all along
    finally:
        await coordinator.stop()
    readies = [e.data for e in events if e.type == "cell.ready"]
    assert [(r.role, r.warm) for r in readies] == [("train", True), ("rollout", True), ("train", True)]
    assert {"group_s", "build_s", "load_s"} <= readies[0].phases.keys() and "start_s" not in readies[0].phases
    assert {"wait_step_s", "leave_s", "wake_s", "load_s"} <= readies[1].phases.keys()
    assert {"drain_s", "sleep_s", "group_s", "build_s", "load_s"} <= readies[2].phases.keys()
    drains = [e for e in events if e.type == "cell.draining"]
    drained = [e for e in events if e.type == "cell.drained"]
    assert [d.causation_id for d in drained] == [d.event_id for d in drains]  # the coordinator's, then the worker's
    formed = [s.event.data.members for s in await store.read_all(types=["trainer.group_formed"], run_id=run_id)]
    assert formed[0] == [CELL] and formed[-1] == [CELL] and [] in formed
