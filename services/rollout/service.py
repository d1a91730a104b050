"""Process entry points of the rollout service: a worker process per rollout cell (loads published weights and
says so with `weights.loaded`, at start-up too; carries out drains, reporting each as `cell.drained`, and ordered
moves), and the gateway process (takes executions up from `execution.started`, ends them on their end).

`main(["worker"])` / `main(["gateway"])` (what `python -m services.rollout` calls); settings come from
`GYRE_…` (shared) and `GYRE_ROLLOUT_…` (below).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from services.rollout.protocol import DrainRequest
from services.rollout.router import Router, WorkerDirectory
from shared.effects import Effects
from shared.events import (
    CellDrained,
    CellDraining,
    Event,
    EventData,
    ExecutionFinished,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrationOrdered,
    WeightsLoaded,
    WeightsPublished,
    stream_id_for,
)
from shared.logging import configure_logging
from shared.runtime import Service
from shared.settings import Settings, load_settings

DRAIN_DETAIL_CHARS = 2000  # a drain's detail as `cell.drained` keeps it (one line per session left behind)


class TokenSecretMissing(RuntimeError):
    """The gateway was started without the run's execution-token secret."""


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_ROLLOUT_", extra="ignore", frozen=True)

    # worker
    worker_id: str = ""  # default: the cell id
    cell_id: str = "cell-0"
    capacity: int = 64  # live sessions this worker accepts
    max_model_len: int = 8192
    dtype: str = "float32"
    kv_storage: Path | None = None  # shared folder for KV migration; unset: migrate by recompute
    heartbeat_s: float = 1.0
    # gateway
    host: str = "127.0.0.1"
    port: int = 8400
    uds: str | None = None  # also serve on this Unix socket (sandboxes reach the gateway through it)
    model_name: str = "gyre-tiny"
    # The run's execution-token secret (shared.execution_tokens), shared with the harness: required by the gateway.
    token_secret: str = ""
    max_body_bytes: int = 32 * 1024 * 1024


class RolloutWorkerService(Service):
    name = "rollout-worker"

    def __init__(self, settings: Settings | None = None, rollout: RolloutSettings | None = None) -> None:
        super().__init__(settings)
        self.rollout = rollout or RolloutSettings()
        self.worker: Any = None
        self.server: Any = None
        self.engine: Any = None
        self._watch: Any = None
        self.process_started_at = datetime.now(UTC)

    async def setup(self) -> None:
        from services.rollout.engine import (
            VllmConfig,
            VllmEngine,
            prepare_cpu_environment,
        )
        from services.rollout.transport import NatsPeers, WorkerServer, watch_statuses
        from services.rollout.worker import RolloutWorker

        assert self.bus is not None and self.store is not None
        if self.settings.model_dir is None:
            raise RuntimeError("GYRE_MODEL_DIR must name the model the worker serves")
        r = self.rollout
        prepare_cpu_environment(Path(self.settings.state_dir) / "vllm")
        self.engine = VllmEngine.start(
            VllmConfig(model=self.settings.model_dir, max_model_len=r.max_model_len, dtype=r.dtype,
                       kv_storage=r.kv_storage)
        )
        directory = WorkerDirectory()
        self._watch = await watch_statuses(self.bus, directory)
        cell = r.cell_id
        self.worker = RolloutWorker(
            self.engine,
            worker_id=r.worker_id or cell,
            cell_id=cell,
            capacity=r.capacity,
            emit=self._emit_data,
            peers=NatsPeers(self.bus, directory),
        )
        latest = await self.store.read_all(types=["weights.published"], run_id=self.settings.run_id)
        if latest:
            await self._load(latest[-1].event)
        self.log.info("engine_warmed_up", seconds=round(await self.engine.warm_up(), 3))
        self.server = await WorkerServer(self.worker, self.bus, heartbeat_s=r.heartbeat_s).start()
        # Serving now: the cell agent learns readiness and the version served from the log, not a heartbeat.
        await self.record(self._weights_loaded())
        # Every worker must see every publication: one durable consumer per worker.
        self.on(["weights.published", "cell.draining", "kv.migration_ordered"], self.handle,
                durable=f"rollout-worker-{self.worker.worker_id}")

    def _weights_loaded(self, cause: Event | None = None) -> Effects:
        w = self.worker
        loaded = WeightsLoaded(cell_id=w.cell_id, worker_id=w.worker_id, version=w.policy_version)
        effects = Effects()
        effects.append([self.event(loaded, stream_id=stream_id_for("cell", w.cell_id), cause=cause)],
                       expected_version="any")
        return effects

    async def _emit_data(self, data: list[EventData] | Any) -> None:
        await self.emit([self.event(d, stream_id=stream_id_for("cell", self.worker.cell_id)) for d in data])

    async def _load(self, event: Event) -> None:
        from safetensors.torch import load as load_safetensors

        assert isinstance(event.data, WeightsPublished) and self.store is not None
        if not self.worker.wants(event.data.version):
            return  # an older publication delivered late: not worth its download
        blob = await self.blobs.get(event.data.weights)
        await self.worker.apply_weights(event.data.version, load_safetensors(blob))

    def _drains_me(self, event: Event) -> bool:
        """A drain order for this worker: its cell, leaving the rollout role, issued after this process began.

        The per-cell durable consumer outlives the worker process, so a new worker on a cell that switched
        (rollout → train → rollout) is also handed the cell's earlier drains, and the one for leaving the
        train role; those are not for it. The cell agent issuing the order runs on the same node, so the
        clocks agree.
        """
        data = event.data
        assert isinstance(data, CellDraining) and self.worker is not None
        return (
            data.cell_id == self.worker.cell_id
            and data.from_role == "rollout"
            and event.occurred_at >= self.process_started_at
        )

    def _orders_me(self, event: Event) -> bool:
        """A session move ordered off this worker's cell. Unlike a drain it is not dated against this process's
        start (the scheduler's clock is another node's): an order for an earlier worker on the cell names
        sessions this one does not hold, and `move_execution` moves only sessions it holds."""
        data = event.data
        assert isinstance(data, KvMigrationOrdered) and self.worker is not None
        return data.from_cell == self.worker.cell_id

    async def handle(self, event: Event) -> Effects | None:
        if isinstance(event.data, KvMigrationOrdered):
            if self._orders_me(event):
                # Spawned: a move waits for the session's in-flight call, which must not hold up the consumer.
                self.spawn(self.worker.move_execution(event.data.execution_id, event.data.to_cell), name="move")
        elif isinstance(event.data, WeightsPublished):
            await self._load(event)
            return self._weights_loaded(cause=event)
        elif isinstance(event.data, CellDraining) and self._drains_me(event):
            # Spawned: a drain waits for in-flight calls and moves every session, far longer than a handler.
            self.spawn(self.drain(event), name="drain")
        return None

    async def drain(self, order: Event) -> CellDrained:
        """Carry out a drain order (`cell.draining`) and report its end as `cell.drained`, caused by the order
        and appended after every `kv.migrated` of the drain (each is appended as its session moves)."""
        w = self.worker
        reply = await w.drain(DrainRequest())
        drained = CellDrained(
            cell_id=w.cell_id,
            worker_id=w.worker_id,
            migrated_sessions=len(reply.migrated),
            parked_sessions=len(reply.parked) + len(reply.failed),
            seconds=max(0.0, reply.seconds),
            detail=reply.detail[:DRAIN_DETAIL_CHARS],
        )
        self.log.info("cell_drained", migrated=drained.migrated_sessions, parked=len(reply.parked),
                      failed=len(reply.failed), seconds=round(drained.seconds, 3))
        await self.emit([self.event(drained, stream_id=stream_id_for("cell", w.cell_id), cause=order)])
        return drained

    def health(self) -> dict[str, Any]:
        return {} if self.worker is None else {"worker": self.worker.status().model_dump()}

    async def teardown(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self._watch is not None:
            await self._watch.unsubscribe()
        if self.engine is not None:
            await self.engine.close()


class RolloutGatewayService(Service):
    name = "rollout-gateway"

    def __init__(self, settings: Settings | None = None, rollout: RolloutSettings | None = None) -> None:
        super().__init__(settings)
        self.rollout = rollout or RolloutSettings()
        if not self.rollout.token_secret:
            raise TokenSecretMissing(
                "GYRE_ROLLOUT_TOKEN_SECRET must be set: the gateway recognises an execution by the token the "
                "harness derives from this secret (shared.execution_tokens); `gyre run` makes one per run")
        self.core: Any = None
        self._servers: list[Any] = []
        self._watch: Any = None

    async def setup(self) -> None:
        import uvicorn

        from services.rollout.codec import TokenizerCodec
        from services.rollout.credentials import TokenVerifier
        from services.rollout.gateway import create_app
        from services.rollout.gateway_core import GatewayCore
        from services.rollout.recorder_postgres import PostgresCallRecorder
        from services.rollout.transport import NatsWorkerClient, watch_statuses

        assert self.bus is not None and self.store is not None
        if self.settings.model_dir is None:
            raise RuntimeError("GYRE_MODEL_DIR must name the served model (its tokenizer and chat template)")
        r = self.rollout
        directory = WorkerDirectory()
        self._watch = await watch_statuses(self.bus, directory)
        self.core = GatewayCore(
            codec=TokenizerCodec.from_model_dir(self.settings.model_dir),
            router=Router(directory, NatsWorkerClient(self.bus)),
            recorder=PostgresCallRecorder(self.store, run_id=self.settings.run_id),
            tokens=TokenVerifier(r.token_secret.encode()),
            max_model_len=r.max_model_len,
            model_name=r.model_name,
        )
        app = create_app(self.core, max_body_bytes=r.max_body_bytes)
        configs = [uvicorn.Config(app, host=r.host, port=r.port, log_level="warning", lifespan="off")]
        if r.uds:
            configs.append(uvicorn.Config(app, uds=r.uds, log_level="warning", lifespan="off"))
        for config in configs:
            server = uvicorn.Server(config)
            # The Service owns SIGTERM/SIGINT; uvicorn must not capture and re-raise them.
            server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
            self._servers.append(server)
            self.spawn(server.serve(), name="http")
        self.on(["execution.started", "execution.finished", "execution.timed_out"], self.handle)

    async def handle(self, event: Event) -> None:
        """An execution's start is taken up (its log read, its cell preferred) before its first call; its end
        revokes its token and ends its sessions wherever they may be."""
        data = event.data
        if isinstance(data, ExecutionStarted):
            self.core.take_up(data)
            return
        if not isinstance(data, ExecutionFinished | ExecutionTimedOut):
            return
        execution_id = data.execution_id
        workers = self.core.router.holders(execution_id)  # a drain may have moved its sessions on
        self.core.end_execution(execution_id)
        from services.rollout.transport import NatsWorkerClient

        assert self.bus is not None
        client = NatsWorkerClient(self.bus)
        for worker in workers:
            try:
                await client.end_sessions(worker, execution_id)
            except Exception:  # the worker may be gone; its sessions went with it
                self.log.warning("end_sessions_failed", execution_id=execution_id, worker_id=worker)
        # And every other worker: a session may sit where the router does not know of it, and a call or a
        # migration still on its way must not start one after the end.
        await client.announce_end(execution_id)

    async def teardown(self) -> None:
        for server in self._servers:
            server.should_exit = True
        if self._watch is not None:
            await self._watch.unsubscribe()


def main(argv: list[str] | None = None) -> None:
    """`python -m services.rollout worker|gateway`."""
    args = list(sys.argv[1:] if argv is None else argv)
    role = args[0] if args else os.environ.get("GYRE_ROLLOUT_ROLE", "gateway")
    services = {"worker": RolloutWorkerService, "gateway": RolloutGatewayService}
    if role not in services:
        raise SystemExit(f"expected a role of {sorted(services)}, got {role!r}")
    settings = load_settings()
    cls = services[role]
    configure_logging(cls.name, run_id=settings.run_id)
    asyncio.run(cls(settings).run(freeze_heap=True))
