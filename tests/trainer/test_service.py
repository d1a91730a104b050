"""The trainer service against a real nats-server and PostgreSQL: batch.ready in, step.completed and
weights.published out, and a crash between checkpoint and commit that neither repeats nor skips a step."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors

from services.trainer.distributed import checkpoint_dir, latest_checkpoint, read_trainer_state
from services.trainer.service import TrainerOptions, TrainerService
from shared.batch import BATCH_MEDIA_TYPE
from shared.bus import ConsumerOptions
from shared.events import BatchReady, Event, new_event
from shared.settings import Settings
from shared.store import EventStore
from gyre.tinymodel import create_tiny_model
from tests.conftest import Infra, RunningRelay, unique
from tests.trainer.trainer_trees import make_batch

FAST = ConsumerOptions(ack_wait_s=30.0, max_deliver=1000, backoff_s=(0.2,), batch=10, fetch_timeout_s=0.2)


class FastTrainerService(TrainerService):
    consumer_options = FAST

    def on(self, event_types, handler, *, durable=None, options=None):  # noqa: ANN001, ANN201
        super().on(event_types, handler, durable=durable, options=self.consumer_options)


# A message held by a dead consumer is never redelivered within the test: what the restarted trainer emits for it
# can only come from its checkpoint.
NO_REDELIVERY = dataclasses.replace(FAST, ack_wait_s=3600.0)


class NoRedeliveryTrainerService(FastTrainerService):
    consumer_options = NO_REDELIVERY


class Crash(Exception):
    pass


class CrashBeforeCommit(NoRedeliveryTrainerService):
    """Trains and checkpoints step `crash_at`, then dies before its effects are recorded."""

    crash_at = 2

    async def _step_effects(self, cause, step, metrics, seconds):  # noqa: ANN001, ANN202
        if step == self.crash_at:
            self.stop_event.set()
            # Killed, not failed: the handler neither acks nor naks, so the batch waits out its ack_wait.
            raise asyncio.CancelledError("simulated crash after checkpoint, before commit")
        return await super()._step_effects(cause, step, metrics, seconds)


async def put_batch(store: EventStore, run_id: str, step: int) -> None:
    batch = make_batch(seed=3, step=step, vocab=500)
    ref = await store.blobs.put(batch.encode(), media_type=BATCH_MEDIA_TYPE)
    data = BatchReady(
        step=step, batch=ref, query_ids=[f"q{step}"], executions=len(batch.executions), trees=1,
        micro_batches=len(batch.micro_batches), unique_tokens=sum(mb.num_tokens for mb in batch.micro_batches),
        flat_tokens=0, target_tokens=sum(mb.num_targets for mb in batch.micro_batches),
        min_policy_version=0, max_policy_version=0,
    )
    from datetime import UTC, datetime

    event = new_event(data, run_id=run_id, stream_id=f"batch-{run_id}-{step}", version=1, occurred_at=datetime.now(UTC))
    await store.append([event])


async def events_of(store: EventStore, run_id: str, kind: str) -> list[Event]:
    return [s.event for s in await store.read_all(types=[kind], run_id=run_id)]


async def wait_for(
    store: EventStore, run_id: str, kind: str, n: int, timeout: float = 180.0, settle_s: float = 1.0
) -> list[Event]:
    async def until() -> list[Event]:
        while len(found := await events_of(store, run_id, kind)) < n:
            await asyncio.sleep(0.3)
        return found

    await asyncio.wait_for(until(), timeout)
    await asyncio.sleep(settle_s)  # room for a duplicate to show up
    return await events_of(store, run_id, kind)


@pytest.mark.timeout(600)
async def test_trainer_service_trains_each_step_once_across_a_crash_before_commit(
    store, bus, infra: Infra, tmp_path: Path
) -> None:
    run_id = unique("train")
    model_dir = create_tiny_model(tmp_path / "model", seed=4)
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, model_dir=model_dir, state_dir=tmp_path / "state",
        eps_low=0.2, eps_high=0.28, recompute_old_logprobs=True, max_staleness=1,
    )
    options = TrainerOptions(lr=1e-3, precision="fp32")
    relay = RunningRelay(store, bus, infra)
    try:
        first = CrashBeforeCommit(settings, options)
        await first.start()
        for step in range(3):
            await put_batch(store, run_id, step)
        await wait_for(store, run_id, "step.completed", 2)
        await asyncio.wait_for(first.stop_event.wait(), 120)  # step 2 trained + checkpointed, then "crashed"
        await first.stop()
        state = read_trainer_state(latest_checkpoint(settings.state_dir / "trainer" / run_id / "checkpoints"))
        assert state["last_step"] == 2 and state["step_count"] == 3

        # Batch 3 is there before the restart, batch 2's message still held by the dead consumer: step 2's
        # result must be emitted from the checkpoint, not lost behind step 3.
        await put_batch(store, run_id, 3)
        second = NoRedeliveryTrainerService(settings, options)
        await second.start()
        completed = await wait_for(store, run_id, "step.completed", 4, timeout=300)
        await second.stop()
    finally:
        await relay.stop()

    steps = sorted(e.data.step for e in completed)
    assert steps == [0, 1, 2, 3], "a step was skipped or emitted twice"
    assert [e.data.policy_version for e in sorted(completed, key=lambda e: e.data.step)] == [1, 2, 3, 4]
    state = read_trainer_state(latest_checkpoint(settings.state_dir / "trainer" / run_id / "checkpoints"))
    assert state["step_count"] == 4, "step 2 was trained twice"
    # The re-emitted step 2 carries the metrics recorded in the checkpoint when it was trained.
    by_step = {e.data.step: e.data for e in completed}
    step2_state = read_trainer_state(checkpoint_dir(settings.state_dir / "trainer" / run_id / "checkpoints", 3))
    assert step2_state["last_step"] == 2
    assert by_step[2].metrics == step2_state["metrics"]
    for data in by_step.values():
        assert {"loss", "clip_fraction", "seq_ratio_mean", "is_weight_mean", "unique_tokens", "flat_tokens",
                "staleness_mean"} <= data.metrics.keys()

    published = await events_of(store, run_id, "weights.published")
    assert sorted(e.data.version for e in published) == [0, 1, 2, 3, 4]
    latest = max(published, key=lambda e: e.data.version).data
    blob = await bus.get_object(latest.weights.digest)
    weights = load_safetensors(blob)
    base = load_safetensors((model_dir / "model.safetensors").read_bytes())
    assert weights.keys() == base.keys()


class BlocksInTheStep(FastTrainerService):
    """Its optimiser step waits for the test (`release`) after saying it has started (`training`)."""

    training: threading.Event
    release: threading.Event

    async def setup(self) -> None:
        await super().setup()
        assert self.trainer is not None
        real_step = self.trainer.step

        def step(batch):  # noqa: ANN001, ANN202
            self.training.set()
            if not self.release.wait(120):
                raise TimeoutError("the test never released the step")
            return real_step(batch)

        self.trainer.step = step  # type: ignore[method-assign]


@pytest.mark.timeout(600)
async def test_no_transaction_is_open_while_a_step_trains(store, bus, infra: Infra, tmp_path: Path) -> None:
    """The handler trains outside any transaction; the effects and the tracking row are recorded afterwards in one
    short one. The service's connections carry an application name of their own, so sessions of other tests on
    the same server are not counted."""
    import sqlalchemy as sa

    run_id = unique("trainnotx")
    application = unique("gyre-trainer-test")
    sep = "&" if "?" in infra.database_url else "?"
    settings = Settings(
        database_url=f"{infra.database_url}{sep}application_name={application}", nats_url=infra.nats_url,
        db_schema=store.schema, subject_prefix=bus.prefix, run_id=run_id,
        model_dir=create_tiny_model(tmp_path / "model", seed=4), state_dir=tmp_path / "state", max_staleness=1,
    )
    service = BlocksInTheStep(settings, TrainerOptions(lr=1e-3, precision="fp32"))
    service.training, service.release = threading.Event(), threading.Event()
    relay = RunningRelay(store, bus, infra)
    try:
        await service.start()
        await put_batch(store, run_id, 0)
        assert await asyncio.to_thread(service.training.wait, 120), "the step never started"
        async with store.engine.connect() as conn:
            sessions = (await conn.execute(sa.text(
                "SELECT state, query FROM pg_stat_activity WHERE application_name = :name"
            ), {"name": application})).all()
        assert sessions, "the service's connections do not carry the application name: the check would be vacuous"
        in_transaction = [(state, query) for state, query in sessions if state.startswith("idle in transaction")]
        assert in_transaction == [], "a transaction stays open while the step trains"
        service.release.set()
        completed = await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
        assert [e.data.step for e in completed] == [0]
        assert await store.is_processed(service.name, completed[0].causation_id)
    finally:
        service.release.set()
        await service.stop()
        await relay.stop()


class FailsAfterTheStep(FastTrainerService):
    """Step 1's checkpoint write fails once after the in-memory step (a full disk, say); step 2's gradient norm
    is infinite."""

    async def setup(self) -> None:
        await super().setup()
        assert self.trainer is not None
        trainer, real_save, real_step = self.trainer, self.trainer.save, self.trainer.step
        failed: list[int] = []

        def save(root, keep=2, extra=None):  # noqa: ANN001, ANN202
            if extra and extra.get("last_step") == 1 and not failed:
                failed.append(1)
                raise OSError("no space left on device")
            return real_save(root, keep, extra)

        def step(batch):  # noqa: ANN001, ANN202
            metrics = real_step(batch)
            return {**metrics, "grad_norm": float("inf")} if batch.step == 2 else metrics

        trainer.save = save  # type: ignore[method-assign]
        trainer.step = step  # type: ignore[method-assign]


@pytest.mark.timeout(600)
async def test_a_step_whose_checkpoint_fails_is_rolled_back_and_trained_once(
    store, bus, infra: Infra, tmp_path: Path
) -> None:
    run_id = unique("trainfail")
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, model_dir=create_tiny_model(tmp_path / "model", seed=4),
        state_dir=tmp_path / "state", max_staleness=1,
    )
    relay = RunningRelay(store, bus, infra)
    service = FailsAfterTheStep(settings, TrainerOptions(lr=1e-3, precision="fp32"))
    try:
        await service.start()
        for step in range(3):
            await put_batch(store, run_id, step)
        completed = await wait_for(store, run_id, "step.completed", 3)
        await service.stop()
    finally:
        await relay.stop()
    by_step = {e.data.step: e.data for e in completed}
    assert [by_step[s].policy_version for s in range(3)] == [1, 2, 3], "a batch was applied twice"
    state = read_trainer_state(latest_checkpoint(settings.state_dir / "trainer" / run_id / "checkpoints"))
    assert state["step_count"] == 3
    # An event cannot carry infinity: the metric is left out and counted.
    assert "grad_norm" not in by_step[2].metrics and by_step[2].metrics["nonfinite_metrics"] == 1.0
    assert by_step[1].metrics["grad_norm"] >= 0


@pytest.mark.timeout(600)
async def test_trainer_process_killed_mid_run_resumes_without_repeating_or_skipping(
    store, bus, infra: Infra, tmp_path: Path, repo_root: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    run_id = unique("traink")
    model_dir = create_tiny_model(tmp_path / "model", seed=6)
    state_dir = tmp_path / "state"
    env = {
        **os.environ,
        "GYRE_DATABASE_URL": infra.database_url,
        "GYRE_DB_SCHEMA": store.schema or "",
        "GYRE_NATS_URL": infra.nats_url,
        "GYRE_SUBJECT_PREFIX": bus.prefix,
        "GYRE_RUN_ID": run_id,
        "GYRE_MODEL_DIR": str(model_dir),
        "GYRE_STATE_DIR": str(state_dir),
        "GYRE_EPS_LOW": "0.2",
        "GYRE_EPS_HIGH": "0.28",
        "GYRE_RECOMPUTE_OLD_LOGPROBS": "true",
        "GYRE_BACKOFF_S": "[0.2]",
        "GYRE_TRAINER_LR": "1e-3",
        "GYRE_TRAINER_PRECISION": "fp32",
        "GYRE_TRAINER_ACK_WAIT_S": "5",
    }
    cmd = [sys.executable, "-m", "services.trainer"]
    relay = RunningRelay(store, bus, infra)
    proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for step in range(3):
            await put_batch(store, run_id, step)
        await wait_for(store, run_id, "step.completed", 1, settle_s=0.0)
        proc.send_signal(signal.SIGKILL)  # mid-run: steps 1 and 2 are pending or in flight
        proc.wait()
        await put_batch(store, run_id, 3)  # arrives while no trainer runs
        proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        completed = await wait_for(store, run_id, "step.completed", 4, timeout=300)
    finally:
        proc.terminate()
        proc.wait()
        await relay.stop()
    assert sorted(e.data.step for e in completed) == [0, 1, 2, 3]
    assert sorted(e.data.policy_version for e in completed) == [1, 2, 3, 4]
    state = read_trainer_state(latest_checkpoint(state_dir / "trainer" / run_id / "checkpoints"))
    assert state["step_count"] == 4 and state["last_step"] == 3


async def test_a_service_stopping_during_a_checkpoint_write_does_not_roll_back_under_it(tmp_path: Path) -> None:
    """Cancellation (the service stopping) cannot stop the save's thread; rolling the weights back while it
    writes would mix two states in one checkpoint. Only a failure rolls back."""
    import threading
    from datetime import UTC, datetime

    from shared.blobs import Blobs, InMemoryBlobStore

    blob = make_batch(seed=0, step=0).encode()
    saving, release = threading.Event(), threading.Event()
    log: list[str] = []

    class Trainer:
        policy_version, world_size = 0, 1

        def step(self, batch):  # noqa: ANN001, ANN202
            return {"staleness_max": 0.0}

        def save(self, root, keep, extra):  # noqa: ANN001, ANN202
            saving.set()
            release.wait(10)
            log.append(f"saved step {extra['last_step']}")

        def resume(self, path):  # noqa: ANN001, ANN202
            log.append("rolled back")
            return {}

    service = TrainerService(Settings(run_id="r", max_staleness=1, state_dir=tmp_path), TrainerOptions())
    service.trainer, service.store = Trainer(), object()  # type: ignore[assignment]
    blobs = InMemoryBlobStore()
    ref = await blobs.put(blob)
    service.blobs = Blobs(blobs)
    data = BatchReady(step=0, batch=ref, query_ids=[], executions=0, trees=0, micro_batches=0, unique_tokens=0,
                      flat_tokens=0, target_tokens=0, min_policy_version=0, max_policy_version=0)
    event = new_event(data, run_id="r", stream_id="s", version=1, occurred_at=datetime.now(UTC))
    task = asyncio.create_task(service.handle(event))
    await asyncio.to_thread(saving.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    await asyncio.sleep(0.2)
    assert log == ["saved step 0"]
