"""The rollout service processes' wiring: the gateway (real HTTP, NATS to a worker, calls and refusals in Postgres,
executions taken up from their start and ended by their end) and the worker service (weights, drains and what
it reports of them in the log)."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta

import anthropic
import httpx2
import numpy as np
import pytest

from gyre.tinymodel import create_tiny_model
from services.rollout.codec import TokenizerCodec
from services.rollout.protocol import GenerateRequest, SamplingSpec, TokenPayload
from services.rollout.service import (
    RolloutGatewayService,
    RolloutSettings,
    RolloutWorkerService,
    TokenSecretMissing,
)
from services.rollout.transport import WorkerServer
from services.rollout.worker import RolloutWorker
from shared.blobs import Blobs
from shared.bus import Bus
from shared.calls import call_seed
from shared.events import (
    CallCompleted,
    CallRefused,
    CellDrained,
    CellDraining,
    ExecutionFinished,
    ExecutionStarted,
    KvMigrated,
    WeightsLoaded,
    new_event,
)
from shared.execution_tokens import derive_execution_token
from shared.settings import Settings
from tests.conftest import drop_store, make_store, unique
from tests.rollout.fakes import CharCodec, LocalWorkers, ScriptedEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


async def test_gateway_service_takes_up_started_executions_records_calls_and_refusals_and_ends_them(
    infra, model_dir
) -> None:
    store = await make_store(infra.database_url)
    prefix = unique("t")
    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=prefix, model_dir=model_dir, run_id="run-svc")
    port = _free_port()
    service = RolloutGatewayService(settings, RolloutSettings(port=port, token_secret="s3cret", max_model_len=4096))
    worker_bus = await Bus.connect(infra.nats_url, prefix=prefix)
    codec = TokenizerCodec.from_model_dir(model_dir)
    engine = ScriptedEngine(codec, lambda p: "all good")
    worker = RolloutWorker(engine, worker_id="w", cell_id="cell-w")
    server = await WorkerServer(worker, worker_bus, heartbeat_s=0.2).start()
    await service.start()
    try:
        while not service.core.router.directory.live():
            await asyncio.sleep(0.05)
        # The harness appends execution.started (the relay publishes it): the gateway takes the execution up
        # before its agent calls, reading its log and preferring the cell it was placed on.
        started = new_event(ExecutionStarted(execution_id="exec-svc", query_id="q", task_id="t", group_size=1,
                                             sample_index=0, seed=5, call_budget=3, cell_id="cell-w"),
                            run_id="run-svc", stream_id="execution-exec-svc", version=1, occurred_at=datetime.now(UTC))
        await store.append([started])
        await service.bus.publish(started)
        for _ in range(100):
            if "exec-svc" in service.core.executions:
                break
            await asyncio.sleep(0.05)
        assert "exec-svc" in service.core.executions and "exec-svc" in service.core.recorder._lines
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
        assert [s.seed for s in engine.samplings] == [call_seed(5, 0)]  # the seed its start gave
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.create(model="gyre-tiny", max_tokens=8, messages=[])
        stored = await store.read_stream("execution-exec-svc")
        assert [type(s.event.data) for s in stored] == [ExecutionStarted, CallCompleted, CallRefused]
        assert stored[1].event.data.cell_id == "cell-w"
        assert stored[2].event.data.status == 400 and stored[2].event.data.answered == 1
        async with httpx2.AsyncClient() as http:  # what Prometheus scrapes, on the gateway's own port
            scraped = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        assert 'gyre_gateway_calls_total{api="anthropic"} 1.0' in scraped
        assert 'gyre_gateway_refusals_total{api="anthropic",kind="invalid_request_error",status="400"} 1.0' in scraped
        # execution.finished (as the relay would publish it) revokes the token and ends the worker's session.
        finished = new_event(ExecutionFinished(execution_id="exec-svc", elapsed_s=1.0, calls=1), run_id="run-svc",
                             stream_id="execution-exec-svc", version=4, occurred_at=datetime.now(UTC))
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


def test_the_gateway_will_not_start_without_the_token_secret() -> None:
    with pytest.raises(TokenSecretMissing, match="GYRE_ROLLOUT_TOKEN_SECRET"):
        RolloutGatewayService(Settings(run_id="run-x"), RolloutSettings(token_secret=""))


async def test_worker_service_loads_published_weights_from_the_blob_store(store) -> None:
    import torch
    from safetensors.torch import save

    from shared.events import WeightsPublished

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
    from shared.events import KvMigrationOrdered

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


def _generate(execution_id: str) -> GenerateRequest:
    prompt = np.arange(100, 140, dtype=np.int32)
    return GenerateRequest(request_id="r", execution_id=execution_id, base_len=0,
                           delta=TokenPayload(count=len(prompt)), sampling=SamplingSpec(max_tokens=5))


async def test_a_drain_order_is_reported_as_cell_drained_after_every_kv_migrated(store) -> None:
    """The cell agent learns a drain's end from the log: `cell.drained`, caused by the order, after the
    `kv.migrated` of each session it moved, with the counts; the worker then stands by with its engine asleep
    (the drain and the sleep timed apart)."""
    service = RolloutWorkerService(Settings(run_id="run-d"), RolloutSettings(cell_id="cell-0"))
    service.store = store
    local = LocalWorkers()
    source = local.add(RolloutWorker(ScriptedEngine(CharCodec()), worker_id="w0", cell_id="cell-0",
                                     emit=service._emit_data))
    local.add(RolloutWorker(ScriptedEngine(CharCodec()), worker_id="w1", cell_id="cell-1"))
    service.worker = source
    prompt = np.arange(100, 140, dtype=np.int32)
    for execution_id in ("e1", "e2"):
        assert (await source.generate(_generate(execution_id), prompt)).status == "ok"
    order = new_event(CellDraining(cell_id="cell-0", from_role="rollout", live_sessions=2), run_id="run-d",
                      stream_id="cell-0", version=1, occurred_at=service.process_started_at + timedelta(seconds=1))
    assert await service.handle(order) is None  # the drain runs as a task of its own, not in the handler
    await asyncio.wait_for(asyncio.gather(*service._tasks), 10)
    stored = [s.event for s in await store.read_stream("cell-0")]
    assert [e.type for e in stored] == ["kv.migrated", "kv.migrated", "cell.drained"]
    assert {e.data.execution_id for e in stored if isinstance(e.data, KvMigrated)} == {"e1", "e2"}
    drained = stored[-1]
    assert isinstance(drained.data, CellDrained) and drained.causation_id == order.event_id
    assert (drained.data.worker_id, drained.data.migrated_sessions, drained.data.parked_sessions) == ("w0", 2, 0)
    assert set(drained.data.phases) == {"drain_s", "sleep_s"}
    assert source.state == "standby" and source.engine.asleep and not source.sessions


async def test_a_drain_with_no_worker_to_take_its_sessions_reports_them_parked_and_drops_them_asleep(store) -> None:
    """A session no active worker takes is reported parked; the engine then sleeps and the session goes with it
    (its next call is refused, and the router sends it whole to a worker that serves)."""
    service = RolloutWorkerService(Settings(run_id="run-p"), RolloutSettings(cell_id="cell-0"))
    service.store = store
    local = LocalWorkers()
    alone = local.add(RolloutWorker(ScriptedEngine(CharCodec()), worker_id="w0", cell_id="cell-0",
                                    emit=service._emit_data))
    service.worker = alone
    assert (await alone.generate(_generate("e1"), np.arange(100, 140, dtype=np.int32))).status == "ok"
    order = new_event(CellDraining(cell_id="cell-0", from_role="rollout", live_sessions=1), run_id="run-p",
                      stream_id="cell-0", version=1, occurred_at=service.process_started_at + timedelta(seconds=1))
    drained = await service.drain(order)
    assert (drained.migrated_sessions, drained.parked_sessions) == (0, 1)
    assert "parked (no active worker" in drained.detail and "failed" not in drained.detail
    assert "1 dropped when the engine slept" in drained.detail
    assert alone.state == "standby" and not alone.sessions and alone.engine.asleep
    late = await alone.generate(_generate("e1").model_copy(update={"base_len": 0}), np.arange(100, 150, dtype=np.int32))
    assert late.status == "draining" and "standby" in late.detail
    assert [s.event.type for s in await store.read_stream("cell-0")] == ["cell.drained"]


async def test_the_worker_service_says_it_serves_its_weights_once_it_is_serving(infra, tmp_path, monkeypatch) -> None:
    """`weights.loaded` at start-up, after the worker has its first weights and answers requests: how the cell
    agent learns from the log that the cell is ready, and which version it serves."""
    import services.rollout.engine as engine_module
    import services.rollout.engine_environment as engine_environment

    class WarmEngine(ScriptedEngine):
        async def warm_up(self) -> float:
            return 0.0

    monkeypatch.setattr(engine_environment, "prepare_cpu_environment", lambda work_dir: None)
    monkeypatch.setattr(engine_module.VllmEngine, "start", classmethod(lambda cls, config: WarmEngine(CharCodec())))
    store = await make_store(infra.database_url)
    prefix = unique("t")
    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=prefix, model_dir=tmp_path, state_dir=tmp_path, run_id="run-ready")
    service = RolloutWorkerService(settings, RolloutSettings(cell_id="cell-7", heartbeat_s=0.2))
    await service.start()
    try:
        loaded = [s.event.data for s in await store.read_stream("cell-7")]
        assert [(w.cell_id, w.worker_id, w.version) for w in loaded if isinstance(w, WeightsLoaded)] == [
            ("cell-7", "cell-7", 0)] and len(loaded) == 1
        assert set(loaded[0].phases) == {"engine_s", "load_s", "warm_up_s"}  # what its start took, part by part
        assert service.server is not None and service.server.subscriptions  # serving before it said so
    finally:
        service.stop_event.set()
        await service.stop()
        bus = await Bus.connect(infra.nats_url, prefix=prefix)
        await bus.delete_streams()  # the service created its streams under this test's prefix
        await bus.close()
        await drop_store(store)


async def test_a_release_or_publication_handled_again_after_its_record_was_lost_is_reported_again(store) -> None:
    """The runtime runs a handler again when recording its effects failed: the worker, already woken (or already
    on those weights), reports the same `weights.loaded` again rather than nothing, and does not wake twice."""
    import torch
    from safetensors.torch import save

    from shared.events import CellReleased, WeightsPublished

    service = RolloutWorkerService(Settings(run_id="run-r"), RolloutSettings(cell_id="cell-5"))
    service.store = store
    service.blobs = Blobs(store.blobs)
    engine = ScriptedEngine(CharCodec())
    service.worker = RolloutWorker(engine, worker_id="w5", cell_id="cell-5")
    await service.worker.sleep()
    release = new_event(CellReleased(cell_id="cell-5", from_role="train", migrated_sessions=0, seconds=0.1),
                        run_id="run-r", stream_id="cell-5", version=1,
                        occurred_at=service.process_started_at + timedelta(seconds=1))
    first, again = await service.handle(release), await service.handle(release)
    assert first is not None and again is not None and engine.wakes == 1
    assert [e.data for e in first.appends[0].events] == [e.data for e in again.appends[0].events]
    assert set(first.appends[0].events[0].data.phases) == {"wake_s", "load_s"}

    ref = await store.blobs.put(save({"version": torch.tensor([4])}), media_type="application/x-safetensors")
    published = new_event(WeightsPublished(version=4, step=3, weights=ref), run_id="run-r", stream_id="step-3",
                          version=1, occurred_at=datetime.now(UTC))
    older = new_event(WeightsPublished(version=2, step=1, weights=ref), run_id="run-r", stream_id="step-1",
                      version=1, occurred_at=datetime.now(UTC))
    loaded, reloaded = await service.handle(published), await service.handle(published)
    assert loaded is not None and reloaded is not None and engine.weights_version == 4
    assert [e.data.version for e in reloaded.appends[0].events] == [4]
    assert await service.handle(older) is None  # not news: no word, and no step back


async def test_two_gateways_serve_one_run_each_execution_sticking_to_one_and_every_end_reaching_both(
    infra, model_dir
) -> None:
    """Several gateway processes for one run: the harness sticks each execution to one (shared.gateways), each
    gateway records the calls it serves, an execution that turns up at the other gateway (its own gone) goes on
    from its log there, and each gateway's own durable consumer sees every end, so a token is revoked on both."""
    from shared.gateways import gateway_for

    store = await make_store(infra.database_url)
    prefix = unique("t")
    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=prefix, model_dir=model_dir, run_id="run-two")
    ports = [_free_port(), _free_port()]
    gateways = [RolloutGatewayService(settings, RolloutSettings(port=port, token_secret="s3cret", max_model_len=4096,
                                                                gateway_id=str(i)))
                for i, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    worker_bus = await Bus.connect(infra.nats_url, prefix=prefix)
    codec = TokenizerCodec.from_model_dir(model_dir)
    worker = RolloutWorker(ScriptedEngine(codec, lambda p: f"reply {len(p)}"), worker_id="w", cell_id="cell-w",
                           capacity=64)
    server = await WorkerServer(worker, worker_bus, heartbeat_s=0.2).start()
    for gateway in gateways:
        await gateway.start()
    http = httpx2.AsyncClient()
    try:
        while not all(g.core.router.directory.live() for g in gateways):
            await asyncio.sleep(0.05)
        ids = [f"exec-{i}" for i in range(12)]
        home = {e: gateway_for(e, urls) for e in ids}
        assert set(home.values()) == set(urls)  # both gateways serve some

        async def call(execution_id: str, url: str, messages: list[dict]) -> anthropic.types.Message:
            client = anthropic.AsyncAnthropic(api_key=derive_execution_token(b"s3cret", execution_id), base_url=url,
                                              max_retries=0, http_client=http)
            for _ in range(50):  # uvicorn binds shortly after start()
                try:
                    return await client.messages.create(model="gyre-tiny", max_tokens=16, messages=messages)
                except anthropic.APIConnectionError:
                    await asyncio.sleep(0.1)
            raise AssertionError(f"{url} never answered")

        talks = {e: [{"role": "user", "content": f"task of {e}"}] for e in ids}
        for _ in range(2):
            for e in ids:
                answer = await call(e, home[e], talks[e])
                talks[e] += [{"role": "assistant", "content": answer.content[0].text},
                             {"role": "user", "content": "go on"}]
        for e in ids:
            serving = [g for g, url in zip(gateways, urls, strict=True) if e in g.core.executions]
            assert [urls[gateways.index(g)] for g in serving] == [home[e]]  # sticky: one gateway holds it
        # exec-0's gateway is gone for it: its next call at the other one goes on from the log (third call,
        # continuing its chain), not from nothing.
        other = next(u for u in urls if u != home["exec-0"])
        await call("exec-0", other, talks["exec-0"])
        stored = [s.event.data for s in await store.read_stream("execution-exec-0")]
        calls = [d for d in stored if isinstance(d, CallCompleted)]
        assert [c.call_index for c in calls] == [0, 1, 2] and calls[2].branch_hint == "continuation"
        # The end of every execution reaches both gateways (a durable consumer each): revoked everywhere.
        for e in ids:
            end = new_event(ExecutionFinished(execution_id=e, elapsed_s=1.0, calls=2), run_id="run-two",
                            stream_id=f"execution-{e}", version=10, occurred_at=datetime.now(UTC))
            await gateways[0].bus.publish(end)
        for _ in range(100):
            if all(g.core.tokens.revoked(e) for g in gateways for e in ids):
                break
            await asyncio.sleep(0.05)
        assert all(g.core.tokens.revoked(e) for g in gateways for e in ids)
        for url in urls:
            with pytest.raises(anthropic.AuthenticationError):
                await call("exec-1", url, talks["exec-1"])
    finally:
        await http.aclose()
        for gateway in gateways:
            gateway.stop_event.set()
            await gateway.stop()
        await server.stop()
        await worker_bus.delete_streams()
        await worker_bus.close()
        await drop_store(store)
