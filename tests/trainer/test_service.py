"""The trainer coordinator and its ranks against a real nats-server and PostgreSQL: batch.ready in, step.completed
and weights.published out; a crash between checkpoint and commit, a failed checkpoint write, a coordinator killed or
stopped mid-run: no step repeated, none skipped.

The ranks here are real rank processes (`python -m services.trainer rank`), or a `RankService` in the test's
process where the test reaches into its step (to block it, or to fail its checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors

from services.trainer.checkpoints import checkpoint_dir, latest_checkpoint, read_trainer_state
from services.trainer.options import RankOptions, TrainerOptions
from services.trainer.protocol import StepRequest
from services.trainer.rank import RankService
from services.trainer.rank_work import RankWork
from shared.cells import Role
from shared.objects import ObjectBlobStore
from tests.conftest import Infra, RunningRelay, unique
from tests.trainer.cluster import (
    FAST,
    REPO,
    FastTrainerService,
    RankProcess,
    assign,
    events_of,
    published_weights,
    put_batch,
    service_env,
    settings_for,
    wait_for,
)
from tests.trainer.trainer_trees import tiny_model

OPTIONS = TrainerOptions(lr=1e-3, precision="fp32", idle_wait_s=2.0)
CELL = "n-cell0"


# A message held by a dead consumer is never redelivered within the test: what the restarted coordinator emits for
# it can only come from the members' checkpoint.
NO_REDELIVERY = dataclasses.replace(FAST, ack_wait_s=3600.0)


class NoRedeliveryTrainerService(FastTrainerService):
    consumer_options = NO_REDELIVERY


class CrashBeforeCommit(NoRedeliveryTrainerService):
    """Drives step `crash_at` (trained and checkpointed on the rank), then dies before its effects are recorded."""

    crash_at = 2

    async def _step_effects(self, cause, state, weights, ranks):  # noqa: ANN001, ANN202
        if state.last_step == self.crash_at and cause is not None:
            self.stop_event.set()
            # Killed, not failed: the handler neither acks nor naks, so the batch waits out its ack_wait.
            raise asyncio.CancelledError("simulated crash after checkpoint, before commit")
        return await super()._step_effects(cause, state, weights, ranks)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    tiny_model("qwen3", seed=4).save_pretrained(d)
    return d


def checkpoints(settings) -> Path:  # noqa: ANN001
    return settings.state_dir / "trainer" / settings.run_id / "checkpoints"


@pytest.mark.timeout(600)
async def test_each_step_is_trained_once_across_a_coordinator_crash_before_commit(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    run_id = unique("train")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state",
                            eps_low=0.2, eps_high=0.28, recompute_old_logprobs=True)
    relay = RunningRelay(store, bus, infra)
    rank = RankProcess(settings, CELL, tmp_path / "logs").start()
    try:
        first = CrashBeforeCommit(settings, OPTIONS)
        await first.start()
        await assign(store, run_id, CELL, Role.TRAIN)
        for step in range(3):
            await put_batch(store, run_id, step)
        await wait_for(store, run_id, "step.completed", 2)
        await asyncio.wait_for(first.stop_event.wait(), 120)  # step 2 trained + checkpointed, then "crashed"
        await first.stop()
        state = read_trainer_state(latest_checkpoint(checkpoints(settings)))
        assert state["last_step"] == 2 and state["step_count"] == 3

        # Batch 3 is there before the restart, batch 2's message still held by the dead consumer: step 2's result
        # must be emitted from the checkpoint the re-formed group resumes, not lost behind step 3.
        await put_batch(store, run_id, 3)
        second = NoRedeliveryTrainerService(settings, OPTIONS)
        await second.start()
        completed = await wait_for(store, run_id, "step.completed", 4)
        await second.stop()
    finally:
        rank.stop()
        await relay.stop()

    assert sorted(e.data.step for e in completed) == [0, 1, 2, 3], "a step was skipped or emitted twice"
    by_step = {e.data.step: e.data for e in completed}
    assert [by_step[s].policy_version for s in range(4)] == [1, 2, 3, 4]
    state = read_trainer_state(latest_checkpoint(checkpoints(settings)))
    assert state["step_count"] == 4, "step 2 was trained twice"
    # The re-emitted step 2 carries the metrics recorded in the checkpoint when it was trained.
    step2_state = read_trainer_state(checkpoint_dir(checkpoints(settings), 3))
    assert step2_state["last_step"] == 2 and by_step[2].metrics == step2_state["metrics"]
    for data in by_step.values():
        assert data.world_size == 1
        assert {"loss", "clip_fraction", "seq_ratio_mean", "is_weight_mean", "unique_tokens", "flat_tokens",
                "staleness_mean", "staleness_bound_violations"} <= data.metrics.keys()
    # Each rank's part is recorded with the step it trained; a step re-emitted from the checkpoint has none.
    assert sorted(e.data.step for e in await events_of(store, run_id, "trainer.rank_stepped")) == [0, 1, 3]

    published = await events_of(store, run_id, "weights.published")
    assert sorted(e.data.version for e in published) == [0, 1, 2, 3, 4]
    by_version = {e.data.version: e.data for e in published}
    latest = by_version[4]
    weights = await published_weights(bus, latest)
    assert latest.format == "shards" and latest.dtype == "float32"
    assert weights.keys() == load_safetensors((model_dir / "model.safetensors").read_bytes()).keys()
    # Retention: the newest and the staleness window before it stay; the rest is deleted, and said so.
    retired = await wait_for(store, run_id, "weights.retired", 3)
    assert sorted(e.data.version for e in retired) == [0, 1, 2]
    gone = [p.data for p in published if p.data.version <= 2]
    objects = ObjectBlobStore(bus.objects)
    assert not any([await objects.has(p.weights) for p in gone]), "a retired manifest stayed"
    assert (await published_weights(bus, by_version[3])).keys() == weights.keys()
    formed = await events_of(store, run_id, "trainer.group_formed")
    assert [e.data.generation for e in formed] == [1, 2], "each incarnation forms a generation of its own"


class BlockingWork(RankWork):
    """Its steps wait for the test (`release`) after saying they have started (`training`)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.training, self.release = threading.Event(), threading.Event()

    def step(self, request: StepRequest, batch_bytes: bytes, rank_id: str):  # noqa: ANN201
        self.training.set()
        if not self.release.wait(120):
            raise TimeoutError("the test never released the step")
        return super().step(request, batch_bytes, rank_id)


def in_process_rank(settings, work_type: type[RankWork]) -> RankService:  # noqa: ANN001
    rank = RankService(settings, RankOptions(cell_id=CELL))
    rank.work = work_type(settings.model_dir)
    return rank


@pytest.mark.timeout(600)
async def test_no_transaction_is_open_while_a_step_trains(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    """The coordinator drives a step outside any transaction; the effects and the tracking row are recorded
    afterwards in one short one. The coordinator's connections carry an application name of their own, so sessions
    of other tests (and of the rank) on the same server are not counted."""
    import sqlalchemy as sa

    run_id = unique("trainnotx")
    application = unique("gyre-trainer-test")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state")
    sep = "&" if "?" in infra.database_url else "?"
    named = settings.model_copy(update={"database_url": f"{infra.database_url}{sep}application_name={application}"})
    rank = in_process_rank(settings, BlockingWork)
    service = FastTrainerService(named, OPTIONS)
    relay = RunningRelay(store, bus, infra)
    work = rank.work
    assert isinstance(work, BlockingWork)
    try:
        await rank.start()
        await service.start()
        await assign(store, run_id, CELL, Role.TRAIN)
        await put_batch(store, run_id, 0)
        assert await asyncio.to_thread(work.training.wait, 120), "the step never started"
        async with store.engine.connect() as conn:
            sessions = (await conn.execute(sa.text(
                "SELECT state, query FROM pg_stat_activity WHERE application_name = :name"
            ), {"name": application})).all()
        assert sessions, "the service's connections do not carry the application name: the check would be vacuous"
        in_transaction = [(state, query) for state, query in sessions if state.startswith("idle in transaction")]
        assert in_transaction == [], "a transaction stays open while the step trains"
        work.release.set()
        completed = await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
        assert [e.data.step for e in completed] == [0]
        assert await store.is_processed(service.name, completed[0].causation_id)
    finally:
        work.release.set()
        await service.stop()
        await rank.stop()
        await relay.stop()


class FailingWork(RankWork):
    """Step 1's checkpoint write fails once after the in-memory step (a full disk, say); step 2's gradient norm is
    infinite."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.failed: list[int] = []

    def form(self, request):  # noqa: ANN001, ANN201
        reply = super().form(request)
        trainer = self.trainer
        assert trainer is not None
        real_save, real_step = trainer.save, trainer.step

        def save(root, keep=2, extra=None):  # noqa: ANN001, ANN202
            if extra and extra.get("last_step") == 1 and not self.failed:
                self.failed.append(1)
                raise OSError("no space left on device")
            return real_save(root, keep, extra)

        def step(batch):  # noqa: ANN001, ANN202
            metrics = real_step(batch)
            return {**metrics, "grad_norm": float("inf")} if batch.step == 2 else metrics

        trainer.save = save  # type: ignore[method-assign]
        trainer.step = step  # type: ignore[method-assign]
        return reply


@pytest.mark.timeout(600)
async def test_a_step_whose_checkpoint_fails_is_redone_once_on_a_reformed_group(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    run_id = unique("trainfail")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state")
    relay = RunningRelay(store, bus, infra)
    rank = in_process_rank(settings, FailingWork)
    service = FastTrainerService(settings, OPTIONS)
    try:
        await rank.start()
        await service.start()
        await assign(store, run_id, CELL, Role.TRAIN)
        for step in range(3):
            await put_batch(store, run_id, step)
        completed = await wait_for(store, run_id, "step.completed", 3)
    finally:
        await service.stop()
        await rank.stop()
        await relay.stop()
    by_step = {e.data.step: e.data for e in completed}
    assert [by_step[s].policy_version for s in range(3)] == [1, 2, 3], "a batch was applied twice"
    state = read_trainer_state(latest_checkpoint(checkpoints(settings)))
    assert state["step_count"] == 3
    # The weights moved in memory without a checkpoint: the group re-formed (from the checkpoint) to redo the step.
    formed = await events_of(store, run_id, "trainer.group_formed")
    assert [e.data.reason for e in formed] == ["joined n-cell0", "re-formed after a failed step"]
    assert formed[1].data.next_step == 1
    # An event cannot carry infinity: the metric is left out and counted.
    assert "grad_norm" not in by_step[2].metrics and by_step[2].metrics["nonfinite_metrics"] == 1.0
    assert by_step[1].metrics["grad_norm"] >= 0


@pytest.mark.timeout(600)
async def test_a_coordinator_stopped_mid_step_leaves_the_step_to_the_ranks_and_the_next_one_emits_it_once(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    """Stopping cancels the coordinator's wait, not the ranks' step: they finish it and checkpoint it, and the next
    coordinator finds it trained and only emits it (the rank's checkpoint write is never cut short or undone)."""
    run_id = unique("trainstop")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state")
    relay = RunningRelay(store, bus, infra)
    rank = in_process_rank(settings, BlockingWork)
    work = rank.work
    assert isinstance(work, BlockingWork)
    try:
        await rank.start()
        first = NoRedeliveryTrainerService(settings, OPTIONS)
        await first.start()
        await assign(store, run_id, CELL, Role.TRAIN)
        await put_batch(store, run_id, 0)
        assert await asyncio.to_thread(work.training.wait, 120), "the step never started"
        await first.stop()
        work.release.set()

        async def checkpointed() -> None:
            while (read_trainer_state(latest_checkpoint(checkpoints(settings))).get("last_step")) != 0:
                await asyncio.sleep(0.2)

        await asyncio.wait_for(checkpointed(), 120)
        second = NoRedeliveryTrainerService(settings, OPTIONS)
        await second.start()
        await put_batch(store, run_id, 1)
        completed = await wait_for(store, run_id, "step.completed", 2)
        await second.stop()
    finally:
        work.release.set()
        await rank.stop()
        await relay.stop()
    assert sorted((e.data.step, e.data.policy_version) for e in completed) == [(0, 1), (1, 2)]
    assert read_trainer_state(latest_checkpoint(checkpoints(settings)))["step_count"] == 2


@pytest.mark.timeout(600)
async def test_coordinator_process_killed_mid_run_resumes_without_repeating_or_skipping(
    store, bus, infra: Infra, tmp_path: Path, model_dir: Path
) -> None:
    run_id = unique("traink")
    settings = settings_for(store, bus, infra, run_id, model_dir, tmp_path / "state",
                            eps_low=0.2, eps_high=0.28, recompute_old_logprobs=True)
    env = service_env(settings, GYRE_EPS_LOW="0.2", GYRE_EPS_HIGH="0.28", GYRE_RECOMPUTE_OLD_LOGPROBS="true",
                      GYRE_TRAINER_LR="1e-3", GYRE_TRAINER_PRECISION="fp32", GYRE_TRAINER_ACK_WAIT_S="5")
    cmd = [sys.executable, "-m", "services.trainer"]
    relay = RunningRelay(store, bus, infra)
    rank = RankProcess(settings, CELL, tmp_path / "logs").start()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await assign(store, run_id, CELL, Role.TRAIN)
        for step in range(3):
            await put_batch(store, run_id, step)
        await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
        proc.send_signal(signal.SIGKILL)  # mid-run: steps 1 and 2 are pending or in flight on the rank
        proc.wait()
        await put_batch(store, run_id, 3)  # arrives while no coordinator runs
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        completed = await wait_for(store, run_id, "step.completed", 4)
    finally:
        proc.terminate()
        proc.wait()
        rank.stop()
        await relay.stop()
    assert sorted(e.data.step for e in completed) == [0, 1, 2, 3]
    assert sorted(e.data.policy_version for e in completed) == [1, 2, 3, 4]
    state = read_trainer_state(latest_checkpoint(checkpoints(settings)))
    assert state["step_count"] == 4 and state["last_step"] == 3
