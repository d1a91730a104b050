"""The gateway service process wiring: real HTTP, NATS to a worker, calls in Postgres, executions ending."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime

import anthropic
import httpx2
import pytest

from services.rollout.codec import TokenizerCodec
from shared.execution_tokens import derive_execution_token
from services.rollout.service import RolloutGatewayService, RolloutSettings
from services.rollout.transport import WorkerServer
from services.rollout.worker import RolloutWorker
from shared.blobs import Blobs
from shared.bus import Bus
from shared.events import CallCompleted, ExecutionFinished, new_event
from shared.settings import Settings
from gyre.tinymodel import create_tiny_model
from tests.conftest import drop_store, make_store, unique
from tests.rollout.fakes import ScriptedEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


async def test_gateway_service_records_calls_and_forgets_finished_executions(infra, model_dir) -> None:
    store = await make_store(infra.database_url)
    prefix = unique("t")
    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=prefix, model_dir=model_dir, run_id="run-svc")
    port = _free_port()
    service = RolloutGatewayService(settings, RolloutSettings(port=port, token_secret="s3cret", max_model_len=4096))
    worker_bus = await Bus.connect(infra.nats_url, prefix=prefix)
    codec = TokenizerCodec.from_model_dir(model_dir)
    worker = RolloutWorker(ScriptedEngine(codec, lambda p: "all good"), worker_id="w", cell_id="cell-w")
    server = await WorkerServer(worker, worker_bus, heartbeat_s=0.2).start()
    await service.start()
    try:
        while not service.core.router.directory.live():
            await asyncio.sleep(0.05)
        token = derive_execution_token(b"s3cret", "exec-svc")
        client = anthropic.AsyncAnthropic(api_key=token, base_url=f"http://127.0.0.1:{port}", max_retries=0,
                                          http_client=httpx2.AsyncClient())
        for _ in range(50):  # uvicorn binds shortly after start()
            try:
                msg = await client.messages.create(model="gyre-tiny", max_tokens=32,
                                                   messages=[{"role": "user", "content": "hello"}])
                break
            except anthropic.APIConnectionError:
                await asyncio.sleep(0.1)
        assert msg.content[0].text == "all good"
        stored = await store.read_stream("execution-exec-svc")
        assert [type(s.event.data) for s in stored] == [CallCompleted]
        assert stored[0].event.data.cell_id == "cell-w"
        # execution.finished (as the relay would publish it) revokes the token and ends the worker's session.
        finished = new_event(ExecutionFinished(execution_id="exec-svc", elapsed_s=1.0, calls=1), run_id="run-svc",
                             stream_id="execution-exec-svc", version=2, occurred_at=datetime.now(UTC))
        await service.bus.publish(finished)
        for _ in range(100):
            if not worker.sessions:
                break
            await asyncio.sleep(0.05)
        assert not worker.sessions
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="gyre-tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    finally:
        service.stop_event.set()
        await service.stop()
        await server.stop()
        await worker_bus.delete_streams()  # the service created its streams under this test's prefix
        await worker_bus.close()
        await drop_store(store)


async def test_worker_service_loads_published_weights_from_the_blob_store(store) -> None:
    import torch
    from safetensors.torch import save

    from services.rollout.service import RolloutWorkerService
    from shared.events import WeightsPublished
    from tests.rollout.fakes import CharCodec

    class RecordingEngine(ScriptedEngine):
        loaded: dict = {}

        async def load_weights(self, state_dict):
            RecordingEngine.loaded = {k: v.clone() for k, v in state_dict.items()}

    service = RolloutWorkerService(Settings(run_id="run-w"), RolloutSettings(cell_id="cell-9"))
    service.store = store
    service.blobs = Blobs(store.blobs)
    service.worker = RolloutWorker(RecordingEngine(CharCodec()), worker_id="w9", cell_id="cell-9")
    weights = {"layer.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    ref = await store.blobs.put(save(weights), media_type="application/x-safetensors")
    event = new_event(WeightsPublished(version=4, step=3, weights=ref), run_id="run-w", stream_id="step-3",
                      version=1, occurred_at=datetime.now(UTC))
    await service.record(await service.handle(event))
    assert service.worker.policy_version == 4
    assert torch.equal(RecordingEngine.loaded["layer.weight"], weights["layer.weight"])
    # The scheduler learns the cell serves version 4 (it dispatches on the version served).
    loaded = [s.event.data for s in await store.read_stream("cell-9") if s.event.type == "weights.loaded"]
    assert [(w.cell_id, w.worker_id, w.version) for w in loaded] == [("cell-9", "w9", 4)]


async def test_worker_drains_only_on_its_own_rollout_drain_issued_after_it_started() -> None:
    """The per-cell durable outlives the worker: a new worker must not obey the cell's earlier drains, nor
    the order for leaving the train role (rollout → train → rollout)."""
    from datetime import timedelta

    from services.rollout.service import RolloutWorkerService
    from shared.events import CellDraining
    from tests.rollout.fakes import CharCodec

    service = RolloutWorkerService(Settings(run_id="run-d"), RolloutSettings(cell_id="cell-3"))
    service.worker = RolloutWorker(ScriptedEngine(CharCodec()), worker_id="w3", cell_id="cell-3")

    def drain(cell: str, from_role: str, seconds_after_start: float):
        return new_event(CellDraining(cell_id=cell, from_role=from_role, live_sessions=0), run_id="run-d",
                         stream_id=f"cell-{cell}", version=1,
                         occurred_at=service.process_started_at + timedelta(seconds=seconds_after_start))

    assert service._drains_me(drain("cell-3", "rollout", 1.0))  # noqa: SLF001
    assert not service._drains_me(drain("cell-3", "train", 1.0))  # noqa: SLF001
    assert not service._drains_me(drain("cell-3", "rollout", -5.0))  # noqa: SLF001
    assert not service._drains_me(drain("cell-4", "rollout", 1.0))  # noqa: SLF001


async def test_worker_carries_out_only_moves_ordered_off_its_own_cell() -> None:
    from datetime import timedelta

    from services.rollout.service import RolloutWorkerService
    from shared.events import KvMigrationOrdered
    from tests.rollout.fakes import CharCodec

    service = RolloutWorkerService(Settings(run_id="run-o"), RolloutSettings(cell_id="cell-3"))
    service.worker = RolloutWorker(ScriptedEngine(CharCodec()), worker_id="w3", cell_id="cell-3")
    moves: list[tuple[str, str]] = []

    async def move_execution(execution_id: str, to_cell: str) -> list:
        moves.append((execution_id, to_cell))
        return []

    service.worker.move_execution = move_execution  # type: ignore[method-assign]

    def order(from_cell: str, seconds_after_start: float):
        return new_event(KvMigrationOrdered(execution_id="e1", from_cell=from_cell, to_cell="cell-5", policy="elastic"),
                         run_id="run-o", stream_id=f"cell-{from_cell}", version=1,
                         occurred_at=service.process_started_at + timedelta(seconds=seconds_after_start))

    for event in (order("cell-3", 1.0), order("cell-4", 1.0)):
        await service.handle(event)
    await asyncio.sleep(0)  # the move runs as a task of its own
    assert moves == [("e1", "cell-5")]
