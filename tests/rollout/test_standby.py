"""A worker's standby, as the warm switch uses it: worker services (scripted engine) over real NATS and Postgres
that start in standby, sleep after a drain and wake on their cell's release with the newest published weights,
while a router over the same NATS never places on a worker that stands by."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save

from services.rollout.protocol import (
    AdoptRequest,
    GenerateRequest,
    SamplingSpec,
    TokenPayload,
)
from services.rollout.router import NoCapacity, Router, WorkerDirectory
from services.rollout.service import RolloutSettings, RolloutWorkerService
from services.rollout.transport import NatsPeers, NatsWorkerClient, watch_statuses
from shared.bus import Bus
from shared.events import (
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReleased,
    Event,
    EventData,
    KvMigrated,
    WeightsLoaded,
    WeightsPublished,
    new_event,
    stream_id_for,
)
from shared.settings import Settings
from shared.store import EventStore
from tests.conftest import drop_store, make_store, unique
from tests.rollout.fakes import CharCodec, ScriptedEngine

RUN = "run-standby"
PROMPT = np.arange(100, 140, dtype=np.int32)


class WarmEngine(ScriptedEngine):
    async def warm_up(self) -> float:
        return 0.0


@dataclass
class Cluster:
    """Worker services on one test's Postgres schema and NATS prefix, the events other services would write,
    and a router watching the workers' heartbeats."""

    infra: Any
    store: EventStore
    prefix: str
    tmp: Any
    bus: Bus
    directory: WorkerDirectory = field(default_factory=lambda: WorkerDirectory(stale_after_s=1e9))
    services: dict[str, RolloutWorkerService] = field(default_factory=dict)
    engines: dict[str, WarmEngine] = field(default_factory=dict)

    async def start_worker(self, cell: str, *, standby: bool) -> RolloutWorkerService:
        settings = Settings(database_url=self.infra.database_url, nats_url=self.infra.nats_url,
                            db_schema=self.store.schema, subject_prefix=self.prefix, model_dir=self.tmp,
                            state_dir=self.tmp, run_id=RUN)
        service = RolloutWorkerService(settings, RolloutSettings(cell_id=cell, heartbeat_s=0.1, standby=standby))
        await service.start()
        self.services[cell] = service
        self.engines[cell] = service.engine
        return service

    async def append(self, data: EventData, stream_id: str) -> Event:
        """What another service (the cell agent, the trainer) appends; the relay's publication done by hand."""
        event = new_event(data, run_id=RUN, stream_id=stream_id, version=1, occurred_at=datetime.now(UTC))
        await self.store.append([event], expected_version="any")
        await self.bus.publish(event)
        return event

    async def publish_weights(self, version: int) -> Event:
        ref = await self.store.blobs.put(save({"version": torch.tensor([version])}),
                                         media_type="application/x-safetensors")
        return await self.append(WeightsPublished(version=version, step=version - 1, weights=ref), f"step-{version}")

    async def cell_events(self, cell: str) -> list[Event]:
        return [s.event for s in await self.store.read_stream(stream_id_for("cell", cell))]

    async def loaded(self, cell: str) -> list[WeightsLoaded]:
        return [e.data for e in await self.cell_events(cell) if isinstance(e.data, WeightsLoaded)]

    def router(self) -> Router:
        return Router(self.directory, NatsWorkerClient(self.bus))


async def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await _truth(predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def _truth(value: Any) -> bool:
    return bool(await value) if asyncio.iscoroutine(value) else bool(value)


@pytest.fixture
async def cluster(infra, tmp_path, monkeypatch) -> AsyncIterator[Cluster]:
    import services.rollout.engine as engine_module
    import services.rollout.engine_environment as engine_environment

    monkeypatch.setattr(engine_environment, "prepare_cpu_environment", lambda work_dir: None)
    monkeypatch.setattr(engine_module.VllmEngine, "start", classmethod(lambda cls, config: WarmEngine(CharCodec())))
    store = await make_store(infra.database_url)
    prefix = unique("t")
    bus = await Bus.connect(infra.nats_url, prefix=prefix)
    await bus.ensure_streams()
    c = Cluster(infra, store, prefix, tmp_path, bus)
    watch = await watch_statuses(bus, c.directory)
    try:
        yield c
    finally:
        await watch.unsubscribe()
        for service in c.services.values():
            service.stop_event.set()
            await service.stop()
        await bus.delete_streams()
        await bus.close()
        await drop_store(store)


def generate(execution_id: str, *, base_len: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=f"r-{execution_id}", execution_id=execution_id, base_len=base_len,
                           base_digest="sha256:" + "0" * 64 if base_len else "",
                           delta=TokenPayload(count=len(PROMPT)), sampling=SamplingSpec(max_tokens=8))


def state_of(c: Cluster, worker: str) -> str | None:
    status = c.directory.get(worker)
    return None if status is None else status.state


async def test_a_worker_started_in_standby_is_asleep_says_nothing_and_refuses_work(cluster) -> None:
    """Standby start: engine and weights loaded, then asleep; no `weights.loaded` (the cell is not ready for
    rollout); its status says standby, so the router places nothing on it even where the scheduler placed the
    execution, and it refuses a generate or an adopt sent to it all the same, saying why."""
    c = cluster
    await c.publish_weights(1)
    await c.start_worker("cell-a", standby=False)
    standby = await c.start_worker("cell-b", standby=True)
    assert standby.worker.policy_version == 1 and c.engines["cell-b"].asleep  # loaded, then slept
    await wait_for(lambda: state_of(c, "cell-a") == "active" and state_of(c, "cell-b") == "standby")
    assert await c.loaded("cell-b") == []
    assert [w.version for w in await c.loaded("cell-a")] == [1]

    router = c.router()
    for i in range(5):
        router.prefer(f"e{i}", "cell-b")
        reply = await router.generate(execution_id=f"e{i}", chain_id="main", prompt=PROMPT,
                                      sampling=SamplingSpec(max_tokens=8), request_id=f"r{i}")
        assert reply.status == "ok" and reply.worker_id == "cell-a"
    client = NatsWorkerClient(c.bus)
    refused = await client.generate("cell-b", generate("direct"), PROMPT)
    assert refused.status == "draining" and "standby" in refused.detail
    adopt = await NatsPeers(c.bus, c.directory).adopt(
        "cell-b", AdoptRequest(execution_id="e0", chain_id="main", history=TokenPayload(count=len(PROMPT)),
                               from_worker="cell-a"), PROMPT)
    assert not adopt.ok and "standby" in adopt.detail
    assert standby.worker.sessions == {} and c.engines["cell-b"].prompts == []  # nothing reached its engine

    # A publication while it stands by is not loaded into the sleeping engine, and says nothing for the cell.
    await c.publish_weights(2)
    await wait_for(lambda: standby.processed == 2)  # both publications handled
    assert standby.worker.policy_version == 1 and await c.loaded("cell-b") == []

    # With only the standby worker left serving nothing, there is no capacity rather than a call on it.
    c.services["cell-a"].worker.state = "draining"
    c.services["cell-a"].server._changed.set()
    await wait_for(lambda: state_of(c, "cell-a") == "draining")
    with pytest.raises(NoCapacity):
        await c.router().generate(execution_id="late", chain_id="main", prompt=PROMPT,
                                  sampling=SamplingSpec(max_tokens=8), request_id="late")


async def test_a_standby_worker_wakes_on_its_cells_release_with_the_newest_published_weights(cluster) -> None:
    """The release of its cell from training wakes it: the engine resumes, the newest publication (published
    while it slept) is loaded, and `weights.loaded` (caused by the release, phases `wake_s`, `load_s`) says so;
    only then does the router place on it. A release from rollout (its own drain's), of another cell, or of a
    cell assigned to idle does not wake it."""
    c = cluster
    await c.publish_weights(1)
    standby = await c.start_worker("cell-b", standby=True)
    await c.publish_weights(2)
    await c.publish_weights(3)
    await c.append(CellReleased(cell_id="cell-b", from_role="rollout", migrated_sessions=0, seconds=0.1), "cell-b")
    await c.append(CellReleased(cell_id="cell-c", from_role="train", migrated_sessions=0, seconds=0.1), "cell-c")
    await c.append(CellAssigned(cell_id="cell-b", role="idle", policy="test"), "cell-b")
    await c.append(CellReleased(cell_id="cell-b", from_role="train", migrated_sessions=0, seconds=0.1), "cell-b")
    await wait_for(lambda: standby.processed == 7)  # three publications, an assignment, three releases
    assert standby.worker.state == "standby" and c.engines["cell-b"].asleep

    await c.append(CellAssigned(cell_id="cell-b", role="rollout", policy="test"), "cell-b")
    release = await c.append(CellReleased(cell_id="cell-b", from_role="train", migrated_sessions=0, seconds=0.2),
                             "cell-b")
    await wait_for(lambda: c.loaded("cell-b"))
    loaded_event = next(e for e in await c.cell_events("cell-b") if isinstance(e.data, WeightsLoaded))
    assert loaded_event.causation_id == release.event_id
    assert loaded_event.data.version == 3 and set(loaded_event.data.phases) == {"wake_s", "load_s"}
    assert standby.worker.state == "active" and not c.engines["cell-b"].asleep
    assert c.engines["cell-b"].weights_version == 3 and c.engines["cell-b"].wakes == 1

    await wait_for(lambda: state_of(c, "cell-b") == "active")
    reply = await c.router().generate(execution_id="after", chain_id="main", prompt=PROMPT,
                                      sampling=SamplingSpec(max_tokens=8), request_id="after")
    assert reply.status == "ok" and reply.worker_id == "cell-b" and reply.policy_version == 3


async def test_a_drained_worker_sleeps_reports_its_phases_and_wakes_without_stale_sessions(cluster) -> None:
    """Rollout → train → rollout on one warm worker: the drain moves its sessions (`kv.migrated`), the engine
    sleeps, `cell.drained` carries `drain_s` and `sleep_s`; woken again it holds no session (a call of a moved
    execution is sent on, one it never saw resyncs), serves the newest weights, and the versions it reported
    never went back."""
    c = cluster
    await c.publish_weights(1)
    await c.start_worker("cell-a", standby=False)
    b = await c.start_worker("cell-b", standby=False)
    await wait_for(lambda: state_of(c, "cell-a") == state_of(c, "cell-b") == "active")
    router = c.router()
    for i in range(3):
        router.prefer(f"s{i}", "cell-b")
        reply = await router.generate(execution_id=f"s{i}", chain_id="main", prompt=PROMPT,
                                      sampling=SamplingSpec(max_tokens=8), request_id=f"s{i}")
        assert reply.worker_id == "cell-b"

    # The drain picks its target from its own view of the heartbeats.
    await wait_for(lambda: [p.worker_id for p in b.worker.peers.candidates("cell-b")] == ["cell-a"])
    order = await c.append(CellDraining(cell_id="cell-b", from_role="rollout"), "cell-b")

    async def drained_yet() -> bool:
        return any(isinstance(e.data, CellDrained) for e in await c.cell_events("cell-b"))

    await wait_for(drained_yet)
    events = await c.cell_events("cell-b")
    drained = next(e for e in events if isinstance(e.data, CellDrained))
    assert drained.causation_id == order.event_id
    assert drained.data.migrated_sessions == 3 and drained.data.parked_sessions == 0
    assert set(drained.data.phases) == {"drain_s", "sleep_s"}
    kinds = [e.type for e in events if e.type in ("kv.migrated", "cell.drained")]
    assert kinds == ["kv.migrated"] * 3 + ["cell.drained"]
    assert {e.data.to_cell for e in events if isinstance(e.data, KvMigrated)} == {"cell-a"}
    assert b.worker.state == "standby" and c.engines["cell-b"].asleep and not b.worker.sessions
    await wait_for(lambda: state_of(c, "cell-b") == "standby")

    # While it trains, a publication; then the cell comes back to rollout.
    await c.publish_weights(2)
    await wait_for(lambda: c.services["cell-a"].worker.policy_version == 2)
    await c.append(CellReleased(cell_id="cell-b", from_role="rollout", migrated_sessions=3, seconds=0.1), "cell-b")
    await c.append(CellReleased(cell_id="cell-b", from_role="train", migrated_sessions=0, seconds=0.1), "cell-b")
    await wait_for(lambda: b.worker.state == "active")
    assert not b.worker.sessions and b.worker.policy_version == 2
    client = NatsWorkerClient(c.bus)
    moved = await client.generate("cell-b", generate("s0", base_len=len(PROMPT) - 1), PROMPT[-1:])
    assert moved.status == "moved" and moved.moved_to == "cell-a"
    unknown = await client.generate("cell-b", generate("never-here", base_len=len(PROMPT) - 1), PROMPT[-1:])
    assert unknown.status == "resync"
    # The router follows the move to where the session lives; a new execution lands on the woken worker.
    again = await router.generate(execution_id="s1", chain_id="main",
                                  prompt=np.concatenate([PROMPT, np.arange(200, 210, dtype=np.int32)]),
                                  sampling=SamplingSpec(max_tokens=8), request_id="s1-again")
    assert again.status == "ok" and again.worker_id == "cell-a"
    await wait_for(lambda: state_of(c, "cell-b") == "active")
    router.prefer("fresh", "cell-b")
    fresh = await router.generate(execution_id="fresh", chain_id="main", prompt=PROMPT,
                                  sampling=SamplingSpec(max_tokens=8), request_id="fresh")
    assert fresh.worker_id == "cell-b" and fresh.policy_version == 2

    versions = [w.version for w in await c.loaded("cell-b")]
    assert versions == [1, 2] and versions == sorted(versions)
    woken = (await c.loaded("cell-b"))[-1]
    assert set(woken.phases) == {"wake_s", "load_s"}


async def test_a_worker_starting_in_standby_after_its_cell_was_released_to_rollout_wakes_at_once(cluster) -> None:
    """The cell agent released the cell to rollout while the standby worker was still starting (importing,
    building its engine), before it could hear of it: it wakes at the end of its start, once, for that release."""
    c = cluster
    await c.publish_weights(1)
    await c.append(CellAssigned(cell_id="cell-b", role="train", policy="test"), "cell-b")
    await c.append(CellAssigned(cell_id="cell-b", role="rollout", policy="test"), "cell-b")
    await c.append(CellDraining(cell_id="cell-b", from_role="train"), "cell-b")
    release = await c.append(CellReleased(cell_id="cell-b", from_role="train", migrated_sessions=0, seconds=0.2),
                             "cell-b")
    worker = await c.start_worker("cell-b", standby=True)
    assert worker.worker.state == "active" and not c.engines["cell-b"].asleep and c.engines["cell-b"].wakes == 1
    await wait_for(lambda: worker.processed == 5)  # the consumer hands it the same events again: no second wake
    loaded = [e for e in await c.cell_events("cell-b") if isinstance(e.data, WeightsLoaded)]
    assert [(e.causation_id, e.data.version) for e in loaded] == [(release.event_id, 1)]
    assert set(loaded[0].data.phases) == {"wake_s", "load_s"} and c.engines["cell-b"].wakes == 1
