"""The trajectory service against a real nats-server and PostgreSQL: batches per step, and a kill/restart
mid-run that neither loses nor duplicates a batch."""

from __future__ import annotations

import asyncio

import pytest

from services.trajectory.replay import Selection, verify
from services.trajectory.service import TrajectoryService
from services.trajectory.synthetic import SyntheticExecution, stable_uuid, EPOCH
from shared.batch import TrainingBatch
from shared.bus import ConsumerOptions
from shared.events import BatchReady, Event, QueryDispatched, new_event
from shared.settings import Settings
from shared.store import EventStore
from tests.conftest import Infra, RunningRelay, unique

FAST = ConsumerOptions(ack_wait_s=1.0, max_deliver=50, backoff_s=(0.1,), batch=100, fetch_timeout_s=0.2)
SYS = [256, 1, 2, 3, 4, 5]


class FastTrajectoryService(TrajectoryService):
    def on(self, event_types, handler, *, durable=None, options=None):  # noqa: ANN001, ANN201
        super().on(event_types, handler, durable=durable, options=FAST)


def query_events(run_id: str, step: int, group: int) -> tuple[list[Event], dict[str, bytes]]:
    """One query of `group` executions for `step`: retries, a delegation, a timeout, distinct rewards."""
    query_id = f"q-{step}"
    events: list[Event] = [new_event(
        QueryDispatched(query_id=query_id, task_id="t", group_size=group, seeds=list(range(group)), step=step,
                        policy_version=step),
        run_id=run_id, stream_id=f"query-{run_id}-{query_id}", version=1, occurred_at=EPOCH,
        event_id=stable_uuid(run_id, query_id),
    )]
    blobs: dict[str, bytes] = {}
    for i in range(group):
        log = SyntheticExecution(f"{run_id}-s{step}-e{i}", query_id=query_id, run_id=run_id, group_size=group,
                                 sample_index=i, step=step)
        log.start(policy_version=step)
        c = log.call(SYS + [10 + i, 11], [20 + i, 21, 22], policy_version=step)
        if i % 2:
            c = log.call(SYS + [10 + i, 11], [30 + i, 31], policy_version=step)  # retry
        log.call(SYS + [40, 41], [42 + i], chain_id="agent", policy_version=step)  # delegation
        log.call(log.sequence(c.call_index).tolist() + [50, 51], [60 + i, 61], policy_version=step)
        if i == group - 1:
            log.time_out(elapsed_s=100.0)
            log.score(0.25, timed_out=True)
        else:
            log.finish()
            log.score(float(i % 3) / 2)
        events += log.events
        blobs.update(log.blobs)
    return events, blobs


async def write(store: EventStore, events: list[Event], blobs: dict[str, bytes]) -> None:
    for data in blobs.values():
        await store.blobs.put(data)
    await store.append(events)


async def batches_in(store: EventStore, run_id: str) -> list[Event]:
    return [s.event for s in await store.read_all(types=["batch.ready"], run_id=run_id)]


async def wait_for_batches(store: EventStore, run_id: str, n: int, timeout: float = 60.0) -> list[Event]:
    async def until() -> list[Event]:
        while len(found := await batches_in(store, run_id)) < n:
            await asyncio.sleep(0.2)
        return found

    await asyncio.wait_for(until(), timeout)
    await asyncio.sleep(1.5)  # room for a duplicate to show up
    return await batches_in(store, run_id)


@pytest.mark.timeout(240)
async def test_service_emits_one_batch_per_step_across_a_kill_and_restart(store, bus, infra: Infra, monkeypatch):
    run_id = unique("traj")
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, micro_batch_tokens=48, cap_k=2, max_staleness=1,
        drop_zero_variance=True,
    )
    relay = RunningRelay(store, bus, infra)
    step0, blobs0 = query_events(run_id, 0, 4)
    step1, blobs1 = query_events(run_id, 1, 4)
    try:
        # First incarnation: it commits its effects but dies before acking anything (kill -9 semantics:
        # JetStream redelivers every message to the next incarnation).
        from nats.aio.msg import Msg

        original_ack = Msg.ack

        async def lost(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            return None  # the ack never reaches the server

        monkeypatch.setattr(Msg, "ack", lost)
        first = FastTrajectoryService(settings)
        await first.start()
        await write(store, step0, blobs0)
        await write(store, step1[: len(step1) // 2], blobs1)  # step 1 half-way when the service dies
        await wait_for_batches(store, run_id, 1, timeout=20)
        await first.stop()

        # Second incarnation: redelivered events are skipped or folded idempotently; step 1 completes.
        monkeypatch.setattr(Msg, "ack", original_ack)
        second = FastTrajectoryService(settings)
        await second.start()
        await write(store, step1[len(step1) // 2:], {})
        found = await wait_for_batches(store, run_id, 2)
        await second.stop()
    finally:
        await relay.stop()

    assert sorted(e.data.step for e in found) == [0, 1], "a batch is missing or was emitted twice"
    # The live batches are exactly what a pure replay of the log rebuilds (same digests).
    history = [s.event for s in await store.read_all(run_id=run_id)]

    async def fetch(events: list[Event]) -> dict[str, bytes]:
        out = {}
        for e in events:
            for ref in [getattr(e.data, "record", None), getattr(e.data, "batch", None)]:
                if ref is not None:
                    out[ref.digest] = await store.blobs.get(ref)
        return out

    blobs = await fetch(history)
    report = verify(history, lambda ref: blobs[ref.digest], Selection(run=run_id))
    assert [b.step for b in report.batches] == [0, 1]
    for b in report.batches:
        assert b.live_digest == b.rebuilt_digest
        batch = TrainingBatch.decode(blobs[b.live_digest])
        assert len(batch.executions) == 4
        assert batch.meta["stale_executions"] == 0
        assert max(mb.num_tokens for mb in batch.micro_batches) <= 48
    ready = {e.data.step: e.data for e in found}
    assert isinstance(ready[1], BatchReady) and ready[1].query_ids == ["q-1"]


@pytest.mark.timeout(300)
async def test_service_process_killed_mid_run_resumes_without_missing_or_duplicating(
    store, bus, infra: Infra, repo_root
) -> None:
    import os
    import signal
    import subprocess
    import sys

    run_id = unique("trajk")
    env = {
        **os.environ,
        "GYRE_DATABASE_URL": infra.database_url,
        "GYRE_DB_SCHEMA": store.schema or "",
        "GYRE_NATS_URL": infra.nats_url,
        "GYRE_SUBJECT_PREFIX": bus.prefix,
        "GYRE_RUN_ID": run_id,
        "GYRE_MICRO_BATCH_TOKENS": "48",
        "GYRE_CAP_K": "2",
        "GYRE_ACK_WAIT_S": "2",
        "GYRE_BACKOFF_S": "[0.1]",
    }
    cmd = [sys.executable, "-m", "services.trajectory"]
    relay = RunningRelay(store, bus, infra)
    steps = [query_events(run_id, s, 3) for s in range(3)]
    proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        await write(store, *steps[0])
        await wait_for_batches(store, run_id, 1)
        events1, blobs1 = steps[1]
        await write(store, events1, blobs1)
        await asyncio.sleep(0.3)  # mid-way through step 1's events
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await write(store, *steps[2])  # arrives while no service runs
        proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        found = await wait_for_batches(store, run_id, 3, timeout=120)
    finally:
        proc.terminate()
        proc.wait()
        await relay.stop()
    assert sorted(e.data.step for e in found) == [0, 1, 2]
    history = [s.event for s in await store.read_all(run_id=run_id)]
    blobs = {}
    for e in history:
        for ref in [getattr(e.data, "record", None), getattr(e.data, "batch", None)]:
            if ref is not None:
                blobs[ref.digest] = await store.blobs.get(ref)
    report = verify(history, lambda ref: blobs[ref.digest], Selection(run=run_id))
    assert all(b.live_digest == b.rebuilt_digest for b in report.batches) and len(report.batches) == 3


@pytest.mark.timeout(120)
async def test_a_later_end_event_rebuilds_the_tree_its_batch_trains(store, bus, infra: Infra) -> None:
    """A crash mark ends an execution at one call; the agent then records a second call and ends on its own,
    which outranks the mark (`RunLog._end`). The batch must train both calls, as replay does, not the tree
    built when the mark arrived."""
    run_id = unique("trajend")
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, micro_batch_tokens=64, cap_k=4, drop_zero_variance=False,
    )
    events: list[Event] = [new_event(
        QueryDispatched(query_id="q", task_id="t", group_size=2, seeds=[0, 1], step=0, policy_version=0),
        run_id=run_id, stream_id=f"query-{run_id}-q", version=1, occurred_at=EPOCH, event_id=stable_uuid(run_id, "q"),
    )]
    blobs: dict[str, bytes] = {}
    for i in range(2):
        log = SyntheticExecution(f"{run_id}-e{i}", query_id="q", run_id=run_id, group_size=2, sample_index=i, step=0)
        log.start()
        first = log.call(SYS + [10 + i], [20 + i, 21])
        if i == 1:
            log.time_out(elapsed_s=5.0, budget="crash")  # calls=1: the tree can be built from here
            log.call(log.sequence(first.call_index).tolist() + [30], [31, 32])
        log.finish()
        log.score(float(i))
        events += log.events
        blobs.update(log.blobs)
    relay = RunningRelay(store, bus, infra)
    service = FastTrajectoryService(settings)
    try:
        await service.start()
        await write(store, events, blobs)
        found = await wait_for_batches(store, run_id, 1)
    finally:
        await service.stop()
        await relay.stop()
    assert len(found) == 1
    history = [s.event for s in await store.read_all(run_id=run_id)]
    blobs[found[0].data.batch.digest] = await store.blobs.get(found[0].data.batch)
    report = verify(history, lambda ref: blobs[ref.digest], Selection(run=run_id))
    (only,) = report.batches
    assert only.live_digest == only.rebuilt_digest
    batch = TrainingBatch.decode(blobs[only.live_digest])
    trained = {e.execution_id: e for e in batch.executions}
    assert trained[f"{run_id}-e1"].num_targets == 4  # both calls' completion tokens, not the first call's 2
