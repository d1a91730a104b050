"""Elastic training on real rank processes (gloo) driven by the cells' events, as the scheduler and the cell agent
write them: the world size follows the cells (1 → 2 → 1) and changes nothing but the layout, and a rank killed
mid-step is left out while its step is redone once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.checkpoints import latest_checkpoint, read_trainer_state
from services.trainer.options import TrainerOptions
from shared.cells import Role
from shared.events import Event
from tests.conftest import Infra, RunningRelay, unique
from tests.trainer.cluster import (
    FastTrainerService,
    RankProcess,
    assign,
    drain_from_train,
    events_of,
    formed_with,
    published_weights,
    put_batch,
    settings_for,
    until,
    wait_for,
)
from tests.trainer.trainer_trees import tiny_model

A, B = "n-cell0", "n-cell1"
# Every version kept: the test compares the first published weights with the last.
OPTIONS = TrainerOptions(lr=1e-3, precision="fp32", idle_wait_s=1.0, collective_timeout_s=60.0, keep_versions=1000)
LOSS = dict(eps_low=0.2, eps_high=0.28, recompute_old_logprobs=True)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    tiny_model("qwen3", seed=11).save_pretrained(d)
    return d


def by_step(events: list[Event]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for e in events:
        out.setdefault(e.data.step, []).append(e)
    return out


async def final_weights(store, bus, run_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # noqa: ANN001
    """The initial and the newest weights the run published."""
    published = sorted((e.data for e in await events_of(store, run_id, "weights.published")), key=lambda d: d.version)
    first, last = published[0], published[-1]
    return await published_weights(bus, first), await published_weights(bus, last)


async def fixed_one_rank_run(store, bus, infra: Infra, model_dir: Path, workdir: Path, steps: int) -> str:  # noqa: ANN001
    run_id = unique("fixed")
    settings = settings_for(store, bus, infra, run_id, model_dir, workdir / "state", **LOSS)
    rank = RankProcess(settings, A, workdir / "logs").start()
    coordinator = FastTrainerService(settings, OPTIONS)
    try:
        await coordinator.start()
        await assign(store, run_id, A, Role.TRAIN)
        for step in range(steps):
            await put_batch(store, run_id, step)
        await wait_for(store, run_id, "step.completed", steps, settle_s=0.0)
    finally:
        await coordinator.stop()
        rank.stop()
    return run_id


@pytest.mark.timeout(900)
async def test_world_size_one_two_one_ends_with_the_parameters_of_a_fixed_one_rank_run(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    run_id = unique("elastic")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state", **LOSS)
    relay = RunningRelay(store, bus, infra)
    ranks = [RankProcess(settings, cell, tmp_path / "logs").start() for cell in (A, B)]
    coordinator = FastTrainerService(settings, OPTIONS)
    try:
        try:
            await coordinator.start()
            await put_batch(store, run_id, 0)  # no cell trains yet: the batch waits (handed back, retried)
            await wait_for(store, run_id, "trainer.rank_ready", 2, settle_s=0.0)  # both stand by
            await assign(store, run_id, A, Role.TRAIN)
            await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
            await put_batch(store, run_id, 1)
            await wait_for(store, run_id, "step.completed", 2, settle_s=0.0)

            await assign(store, run_id, B, Role.TRAIN)  # from idle: the cell trains at once, its rank joins
            await wait_for(store, run_id, "trainer.group_formed", 1, where=formed_with(A, B), settle_s=0.0)
            for step in (2, 3):
                await put_batch(store, run_id, step)
            await wait_for(store, run_id, "step.completed", 4, settle_s=0.0)

            await assign(store, run_id, B, Role.ROLLOUT)
            draining = await drain_from_train(store, run_id, B)  # the agent switches it away
            drained = await wait_for(store, run_id, "cell.drained", 1, settle_s=0.0)
            await wait_for(store, run_id, "trainer.group_formed", 2, where=formed_with(A), settle_s=0.0)
            for step in (4, 5):
                await put_batch(store, run_id, step)
            completed = await wait_for(store, run_id, "step.completed", 6)
        finally:
            await coordinator.stop()
            for rank in ranks:
                rank.stop()
        fixed = await fixed_one_rank_run(store, bus, infra, model_dir, tmp_path / "fixed", 6)
    finally:
        await relay.stop()

    assert await bus.read_dead_letters("trainer") == [], "a batch waiting for a training cell was dead-lettered"
    steps = by_step(completed)
    assert sorted(steps) == list(range(6)) and all(len(v) == 1 for v in steps.values())
    assert [steps[s][0].data.world_size for s in range(6)] == [1, 1, 2, 2, 1, 1]
    formed = [e.data for e in await events_of(store, run_id, "trainer.group_formed")]
    assert [(f.members, f.world_size, f.next_step, f.reason) for f in formed] == [
        ([A], 1, 0, "joined n-cell0"), ([A, B], 2, 2, "joined n-cell1"), ([A], 1, 4, "left n-cell1")]
    assert all({"group_s", "build_s", "load_s"} <= f.phases.keys() for f in formed)
    ranked = by_step(await events_of(store, run_id, "trainer.rank_stepped"))
    assert {s: sorted((e.data.cell_id, e.data.rank, e.data.world_size) for e in ranked[s]) for s in (1, 2)} == {
        1: [(A, 0, 1)], 2: [(A, 0, 2), (B, 1, 2)]}
    assert [len(ranked[s]) for s in range(6)] == [1, 1, 2, 2, 1, 1]
    assert sum(e.data.micro_batches for e in ranked[2]) == steps[2][0].data.metrics["micro_batches"]
    # The drain of the training cell is answered once its rank left, caused by the drain it answers.
    assert len(drained) == 1 and drained[0].causation_id == draining.event_id
    assert drained[0].data.cell_id == B and drained[0].data.worker_id.startswith(B)
    assert drained[0].data.phases.keys() == {"wait_step_s", "leave_s"}

    # Resharding changes nothing but the layout: the same losses, the same final parameters.
    fixed_steps = by_step(await events_of(store, fixed, "step.completed"))
    assert [steps[s][0].data.metrics["loss"] for s in range(6)] == pytest.approx(
        [fixed_steps[s][0].data.metrics["loss"] for s in range(6)], rel=1e-5, abs=1e-6)
    start, elastic_weights = await final_weights(store, bus, run_id)
    _, fixed_weights = await final_weights(store, bus, fixed)
    assert elastic_weights.keys() == fixed_weights.keys()
    assert max((elastic_weights[k] - start[k]).abs().max().item() for k in start) > 1e-3, "training moved nothing"
    for name, tensor in elastic_weights.items():
        diff = (tensor - fixed_weights[name]).abs().max().item()
        assert diff <= 2e-5, f"{name} differs by {diff}"


@pytest.mark.timeout(900)
async def test_a_rank_killed_mid_step_is_left_out_and_its_step_is_redone_once(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    run_id = unique("killrank")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state", **LOSS)
    relay = RunningRelay(store, bus, infra)
    marker = tmp_path / "blocked"
    a = RankProcess(settings, A, tmp_path / "logs").start()
    b = RankProcess(settings, B, tmp_path / "logs", module="tests.trainer.blocking_rank",
                    extra_env={"GYRE_TEST_BLOCK_STEP": "1", "GYRE_TEST_BLOCKED_FILE": str(marker)}).start()
    coordinator = FastTrainerService(settings, OPTIONS)
    try:
        await coordinator.start()
        for cell in (A, B):
            await assign(store, run_id, cell, Role.TRAIN)
        await wait_for(store, run_id, "trainer.group_formed", 1, where=formed_with(A, B), settle_s=0.0)
        await put_batch(store, run_id, 0)
        await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
        await put_batch(store, run_id, 1)
        await until(marker.exists)  # B is inside step 1; A waits for it in the step's first collective
        b.kill()
        await wait_for(store, run_id, "step.completed", 2, settle_s=0.0)

        b.module, b.extra_env = "services.trainer", {}
        b.start()  # as the cell agent restarts a crashed process: a new rank, which rejoins at a later boundary
        await wait_for(store, run_id, "trainer.group_formed", 2, where=formed_with(A, B), settle_s=0.0)
        await put_batch(store, run_id, 2)
        completed = await wait_for(store, run_id, "step.completed", 3)
    finally:
        await coordinator.stop()
        a.stop()
        b.stop()
        await relay.stop()

    steps = by_step(completed)
    assert sorted(steps) == [0, 1, 2] and all(len(v) == 1 for v in steps.values()), "a step was lost or doubled"
    assert [(steps[s][0].data.world_size, steps[s][0].data.policy_version) for s in range(3)] == [
        (2, 1), (1, 2), (2, 3)]
    state = read_trainer_state(latest_checkpoint(settings.state_dir / "trainer" / run_id / "checkpoints"))
    assert state["step_count"] == 3 and state["last_step"] == 2, "the checkpoint counts a step twice or misses one"
    formed = [e.data for e in await events_of(store, run_id, "trainer.group_formed")]
    formed = formed[[f.members for f in formed].index([A, B]):]  # (A may have formed alone before B's order came)
    assert [(f.members, f.next_step) for f in formed] == [([A, B], 0), ([A], 1), ([A, B], 2)]
    assert formed[1].reason == "failed n-cell1"
    # The abandoned attempt recorded nothing: step 1 has one rank's part, in the group without B.
    ranked = by_step(await events_of(store, run_id, "trainer.rank_stepped"))
    assert [(e.data.cell_id, e.data.world_size, e.data.generation) for e in ranked[1]] == [(A, 1, formed[1].generation)]
    assert sorted(e.data.cell_id for e in ranked[2]) == [A, B]
