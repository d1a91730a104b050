"""Test helpers for the coordinator and its ranks on real NATS and Postgres: rank processes
(`python -m services.trainer rank`, or a test module that wraps it), the cell facts the cell agent and the scheduler
would write, batches, and waiting for events."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.trainer.service import TrainerService
from shared.batch import BATCH_MEDIA_TYPE, TrainingBatch
from shared.blobs import Blobs
from shared.bus import Bus, ConsumerOptions
from shared.cells import Role
from shared.events import (
    BatchReady,
    CellAssigned,
    CellDraining,
    CellReleased,
    Event,
    EventData,
    WeightsPublished,
    new_event,
    stream_id_for,
)
from shared.objects import ObjectBlobStore
from shared.settings import Settings
from shared.store import EventStore
from tests.conftest import Infra
from tests.trainer.trainer_trees import make_batch

REPO = Path(__file__).resolve().parents[2]
FAST = ConsumerOptions(ack_wait_s=30.0, max_deliver=1000, backoff_s=(0.2,), batch=10, fetch_timeout_s=0.2)


class FastTrainerService(TrainerService):
    """The coordinator with consumers that retry and fetch quickly (a test's batches wait less)."""

    consumer_options = FAST

    def on(self, event_types, handler, *, durable=None, options=None):  # noqa: ANN001, ANN201
        super().on(event_types, handler, durable=durable, options=self.consumer_options)


def settings_for(store: EventStore, bus: object, infra: Infra, run_id: str, model_dir: Path, state_dir: Path,
                 **overrides: object) -> Settings:
    return Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, model_dir=model_dir, state_dir=state_dir,  # type: ignore[attr-defined]
        max_staleness=1, backoff_s=[0.2], **overrides,  # type: ignore[arg-type]
    )


def service_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment a service process of `settings`' run gets (as the cell agent or the launcher gives it)."""
    env = {
        **os.environ,
        "GYRE_DATABASE_URL": settings.database_url,
        "GYRE_DB_SCHEMA": settings.db_schema or "",
        "GYRE_NATS_URL": settings.nats_url,
        "GYRE_SUBJECT_PREFIX": settings.subject_prefix,
        "GYRE_RUN_ID": settings.run_id,
        "GYRE_MODEL_DIR": str(settings.model_dir),
        "GYRE_STATE_DIR": str(settings.state_dir),
        "GYRE_BACKOFF_S": "[0.2]",
        "OMP_NUM_THREADS": "1",  # two ranks and the test share two cores
    }
    env.pop("GYRE_HEALTH_PORT", None)
    env.update(extra)
    return env


@dataclass
class RankProcess:
    """A rank process on one cell; `module` may be a test wrapper that adds a fault to the real rank."""

    settings: Settings
    cell_id: str
    log_dir: Path
    module: str = "services.trainer"
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> RankProcess:
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{self.cell_id}-{self.starts}.log", "wb")  # noqa: SIM115
        env = service_env(self.settings, GYRE_TRAINER_CELL_ID=self.cell_id, **self.extra_env)
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, "rank"], cwd=REPO, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.cell_id}-*.log")))


async def append_cell(store: EventStore, run_id: str, data: EventData, cell_id: str) -> Event:
    event = new_event(data, run_id=run_id, stream_id=stream_id_for("cell", cell_id), version=1,
                      occurred_at=datetime.now(UTC))
    await store.append([event], expected_version="any")
    return event


async def assign(store: EventStore, run_id: str, cell_id: str, role: Role) -> Event:
    """What the scheduler writes: the cell's new role."""
    return await append_cell(store, run_id, CellAssigned(cell_id=cell_id, role=role, policy="test"), cell_id)


async def drain_from_train(store: EventStore, run_id: str, cell_id: str) -> Event:
    """What the cell agent writes when a training cell switches away."""
    return await append_cell(store, run_id, CellDraining(cell_id=cell_id, from_role=Role.TRAIN), cell_id)


async def release(store: EventStore, run_id: str, cell_id: str, from_role: Role) -> Event:
    return await append_cell(
        store, run_id, CellReleased(cell_id=cell_id, from_role=from_role, migrated_sessions=0, seconds=0.0), cell_id)


def batch_of(step: int) -> TrainingBatch:
    return make_batch(seed=3, step=step)


async def put_batch(store: EventStore, run_id: str, step: int) -> None:
    """What the trajectory service writes: the step's batch and its `batch.ready`."""
    batch = batch_of(step)
    ref = await store.blobs.put(batch.encode(), media_type=BATCH_MEDIA_TYPE)
    data = BatchReady(
        step=step, batch=ref, query_ids=[f"q{step}"], executions=len(batch.executions), trees=1,
        micro_batches=len(batch.micro_batches), unique_tokens=sum(mb.num_tokens for mb in batch.micro_batches),
        flat_tokens=0, target_tokens=sum(mb.num_targets for mb in batch.micro_batches),
        min_policy_version=0, max_policy_version=0,
    )
    event = new_event(data, run_id=run_id, stream_id=f"batch-{run_id}-{step}", version=1, occurred_at=datetime.now(UTC))
    await store.append([event])


async def published_weights(bus: Bus, published: WeightsPublished) -> dict[str, Any]:
    """A publication's full state dict, read from the Object Store as a rollout worker reads it."""
    from services.rollout.weights_fetch import fetch_weights

    return (await fetch_weights(Blobs(ObjectBlobStore(bus.objects)), published)).state_dict


async def events_of(store: EventStore, run_id: str, kind: str) -> list[Event]:
    return [s.event for s in await store.read_all(types=[kind], run_id=run_id)]


async def wait_for(
    store: EventStore, run_id: str, kind: str, n: int, timeout: float = 300.0, settle_s: float = 1.0,
    where: object = None,
) -> list[Event]:
    """At least `n` events of `kind` (those `where(event)` accepts), after `settle_s` more for a duplicate to show."""

    def matching(events: list[Event]) -> list[Event]:
        return [e for e in events if where is None or where(e)]  # type: ignore[operator]

    async def until() -> list[Event]:
        while len(found := matching(await events_of(store, run_id, kind))) < n:
            await asyncio.sleep(0.3)
        return found

    await asyncio.wait_for(until(), timeout)
    await asyncio.sleep(settle_s)
    return matching(await events_of(store, run_id, kind))


async def until(predicate: Callable[[], bool], timeout: float = 300.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.2)

    await asyncio.wait_for(poll(), timeout)


def formed_with(*cells: str) -> object:
    """A `where` for `trainer.group_formed` events listing exactly `cells`."""
    return lambda e: e.data.members == list(cells)
