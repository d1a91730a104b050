"""Process entry points of the rollout service: a worker process per rollout cell (loads published weights and
says so with `weights.loaded`, at start-up and on waking too; carries out drains, then sleeps in standby, reporting
each as `cell.drained`; wakes on its cell's release from another role; carries out ordered moves), and the
gateway process (takes executions up from `execution.started`, ends them on their end).

`main(["worker"])` / `main(["gateway"])` (what `python -m services.rollout` calls); settings come from
`GYRE_…` (shared) and `GYRE_ROLLOUT_…` (below).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
import uuid
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from services.rollout.lifecycle import (
    drains_me,
    latest_assignment,
    newest_publication,
    orders_me,
    release_while_starting,
    wakes_me,
)
from services.rollout.protocol import DrainRequest
from services.rollout.router import Router, WorkerDirectory
from services.rollout.settings import RolloutSettings, served_dtype
from shared.cells import Role
from shared.effects import Effects
from shared.events import (
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReleased,
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
from shared.weights_stream import StreamRefused

DRAIN_DETAIL_CHARS = 2000  # a drain's detail as `cell.drained` keeps it (one line per session left behind)


class TokenSecretMissing(RuntimeError):
    """The gateway was started without the run's execution-token secret."""


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
        # Drains (with the sleep after them), wakes and weight loads one at a time: each changes what the engine
        # serves, and a publication must not load into an engine going to sleep or still waking.
        self._lifecycle = asyncio.Lock()
        self._woken_by: tuple[uuid.UUID, dict[str, float]] | None = None  # the release that last woke it, its phases
        self._loaded_by: uuid.UUID | None = None  # the publication event it last loaded from its consumer
        # When the latest drain order (or the process start) put it to sleep: only a release after it wakes it.
        self._asleep_since = self.process_started_at
        self._cell_role: Role | None = None  # the cell's latest assignment (None: its log has none yet)
        self._weights_stage: Path | None = None  # set up: where shards wait for the swap (None: in memory)

    async def setup(self) -> None:
        from services.rollout.engine import VllmConfig, VllmEngine
        from services.rollout.engine_environment import default_kv_storage, prepare_cpu_environment
        from services.rollout.transport import NatsKvTransport, NatsPeers, WorkerServer, watch_statuses
        from services.rollout.worker import RolloutWorker

        assert self.bus is not None and self.store is not None
        if self.settings.model_dir is None:
            raise RuntimeError("GYRE_MODEL_DIR must name the model the worker serves")
        r = self.rollout
        prepare_cpu_environment(Path(self.settings.state_dir) / "vllm")
        t0 = time.perf_counter()
        worker_id = r.worker_id or r.cell_id
        kv_storage = None
        # The peer policy's mode moves sessions as verl does, by recompute (scheduling.mode reprefill).
        carries_kv = r.kv_transport != "none" and self.settings.mode != "reprefill"
        if carries_kv and r.kv_connector == "gyre":
            state = Path(self.settings.state_dir)
            kv_storage = r.kv_storage or default_kv_storage(state, self.settings.run_id, worker_id)
            shutil.rmtree(kv_storage, ignore_errors=True)  # what a dead process left in transit is no one's now
        self._weights_stage = r.weights_staging or Path(self.settings.state_dir) / "weights" / worker_id
        shutil.rmtree(self._weights_stage, ignore_errors=True)  # shards a dead process never swapped in
        self.engine = VllmEngine.start(
            VllmConfig(model=self.settings.model_dir, max_model_len=r.max_model_len,
                       dtype=served_dtype(r.dtype, self.settings.model_dir),
                       kv_storage=kv_storage, sleep_mode=r.sleep_mode, kv_capacity_tokens=r.kv_capacity_tokens,
                       kv_connector=r.kv_connector if carries_kv else "gyre")
        )
        directory = WorkerDirectory()
        self._watch = await watch_statuses(self.bus, directory)
        cell = r.cell_id
        self.worker = RolloutWorker(
            self.engine,
            worker_id=worker_id,
            cell_id=cell,
            capacity=r.capacity,
            emit=self._emit_data,
            peers=NatsPeers(self.bus, directory),
            kv_transport=NatsKvTransport(self.bus.kv_objects) if carries_kv else None,
            kv_staging_bytes=r.kv_staging_bytes,
        )
        t1 = time.perf_counter()
        await self._load_newest()
        t2 = time.perf_counter()
        await self.engine.warm_up()
        t3 = time.perf_counter()
        phases = {"engine_s": t1 - t0, "load_s": t2 - t1, "warm_up_s": t3 - t2}
        if r.standby:
            # Asleep before its first heartbeat: no router or draining peer ever sees it active.
            phases["sleep_s"] = (await self.worker.sleep()).seconds
        self.log.info("worker_started", standby=r.standby, version=self.worker.policy_version,
                      **{k: round(v, 3) for k, v in phases.items()})
        self.server = await WorkerServer(self.worker, self.bus, heartbeat_s=r.heartbeat_s).start()
        cell_log = [s.event for s in await self.store.read_stream(stream_id_for("cell", cell))]
        self._cell_role = latest_assignment(cell_log, cell)
        if not r.standby:
            # Serving now: the cell agent learns readiness and the version served from the log, not a heartbeat.
            await self.record(self._weights_loaded(phases=phases))
        elif (missed := release_while_starting(cell_log, cell)) is not None:
            # Released to rollout while this process was still starting: wake now, as that release asked.
            effects = await self.wake(missed, missed=True)
            if effects is not None:
                await self.record(effects)
        # Every worker must see every publication: one durable consumer per worker.
        self.on(["weights.published", "cell.assigned", "cell.draining", "cell.released", "kv.migration_ordered"],
                self.handle, durable=f"rollout-worker-{self.worker.worker_id}")

    def _weights_loaded(self, cause: Event | None = None, phases: dict[str, float] | None = None) -> Effects:
        w = self.worker
        loaded = WeightsLoaded(cell_id=w.cell_id, worker_id=w.worker_id, version=w.policy_version,
                               phases=dict(phases or {}), kv_capacity_tokens=w.engine.kv_capacity_tokens)
        effects = Effects()
        effects.append([self.event(loaded, stream_id=stream_id_for("cell", w.cell_id), cause=cause)],
                       expected_version="any")
        return effects

    async def _emit_data(self, data: list[EventData] | Any) -> None:
        await self.emit([self.event(d, stream_id=stream_id_for("cell", self.worker.cell_id)) for d in data])

    async def _load(self, published: WeightsPublished) -> dict[str, float] | None:
        """Load a publication newer than what the worker serves; returns its phases when it did (`fetch_s`:
        download and decoding while the worker served; `pause_s`, `swap_s`: see `apply_weights`). A publication
        retention has deleted meanwhile is passed over for the newest."""
        from services.rollout.weights_fetch import WeightsGone, fetch_weights

        if not self.worker.wants(published.version):
            return None  # an older publication delivered late, or one loaded at start: not worth its download
        fetch = partial(fetch_weights, self.blobs, published, stage_dir=self._weights_stage,
                        node=self.settings.node_id, log=self.log)
        r = self.rollout
        try:
            fetched = await fetch(stream_timeout_s=r.weights_stream_timeout_s if r.weights_stream else None)
        except WeightsGone as exc:
            newest = await self._newest_publication()
            if newest is None or newest.version <= published.version:
                raise
            self.log.info("weights_superseded", version=published.version, newest=newest.version, detail=str(exc))
            return await self._load(newest)
        try:
            swap = await self.worker.apply_weights(published.version, fetched.weights)
        except StreamRefused as exc:  # the old weights still serve: the path of record brings the new ones
            self.log.warning("weights_stream_refused", version=published.version, detail=str(exc))
            fetched = await fetch()
            swap = await self.worker.apply_weights(published.version, fetched.weights)
        finally:
            fetched.discard()
        return None if swap is None else {"fetch_s": round(fetched.fetch_s, 4),
                                          **{k: round(v, 4) for k, v in swap.items()}}

    async def _newest_publication(self) -> WeightsPublished | None:
        """The run's newest published weights, read from the log (which the bus's delivery may lag behind)."""
        assert self.store is not None
        stored = await self.store.read_all(types=["weights.published"], run_id=self.settings.run_id)
        return newest_publication(s.event.data for s in stored if isinstance(s.event.data, WeightsPublished))

    async def _load_newest(self) -> None:
        """Load the run's newest published weights when they are newer than what the worker serves."""
        newest = await self._newest_publication()
        if newest is not None:
            await self._load(newest)

    async def handle(self, event: Event) -> Effects | None:
        data, w = event.data, self.worker
        if isinstance(data, KvMigrationOrdered):
            if orders_me(data, cell_id=w.cell_id):
                # Spawned: a move waits for the session's in-flight call, which must not hold up the consumer.
                self.spawn(w.move_execution(data.execution_id, data.to_cell), name="move")
        elif isinstance(data, WeightsPublished):
            async with self._lifecycle:
                if w.state == "standby":
                    # Not loaded into a sleeping engine: the wake loads the newest (one load, not one per step).
                    self.log.info("weights_deferred", version=data.version, serving=w.policy_version)
                    return None
                phases = await self._load(data)
                if phases is not None:
                    self._loaded_by = event.event_id
                elif self._loaded_by != event.event_id:
                    return None  # not news (older, or loaded at start or on a wake, which said so)
                # Loaded now, or by this very event before its record was lost (a redelivery): the log says so.
                return self._weights_loaded(cause=event, phases=phases)
        elif isinstance(data, CellDraining) and self._drains_me(event):
            # Spawned: a drain waits for in-flight calls and moves every session, far longer than a handler.
            self.spawn(self.drain(event), name="drain")
        elif isinstance(data, CellReleased):
            return await self.wake(event)
        elif isinstance(data, CellAssigned) and data.cell_id == w.cell_id:
            self._cell_role = data.role  # where a later release sends the cell
        return None

    def _drains_me(self, event: Event) -> bool:
        assert isinstance(event.data, CellDraining) and self.worker is not None
        return drains_me(event.data, issued_at=event.occurred_at, cell_id=self.worker.cell_id,
                         started_at=self.process_started_at)

    async def wake(self, release: Event, *, missed: bool = False) -> Effects | None:
        """Wake on the release of this worker's cell from another role to rollout: the engine resumes, loads the
        newest published weights, and the worker serves; `weights.loaded` (caused by the release, phases `wake_s`,
        `load_s`) is how the cell agent learns the cell is ready. `missed`: a release from before this process
        could hear it, which the cell's log says is still waiting for a rollout worker."""
        assert isinstance(release.data, CellReleased)
        w = self.worker
        async with self._lifecycle:
            if self._woken_by is not None and self._woken_by[0] == release.event_id and w.state == "active":
                # Woken by this release already, its record lost (the runtime redelivers): say it again.
                return self._weights_loaded(cause=release, phases=self._woken_by[1])
            if not (missed and w.state == "standby") and not wakes_me(
                    release.data, issued_at=release.occurred_at, cell_id=w.cell_id, asleep_since=self._asleep_since,
                    state=w.state, assigned=self._cell_role):
                return None
            phases = await w.wake(self._load_newest)
            if not missed:  # a missed release's wake is recorded by the start, not as this handler's effects
                self._woken_by = (release.event_id, phases)
        return self._weights_loaded(cause=release, phases=phases)

    async def drain(self, order: Event) -> CellDrained:
        """Carry out a drain order (`cell.draining`), put the engine to sleep (standby) and report both as
        `cell.drained` (phases `drain_s`, `sleep_s`), caused by the order and appended after every `kv.migrated`
        of the drain (each is appended as its session moves). Sessions that could not move are dropped with the
        sleep: their next call is refused and the router sends it, whole, to another worker."""
        w = self.worker
        async with self._lifecycle:
            reply = await w.drain(DrainRequest())
            slept = await w.sleep()
            self._asleep_since = max(self._asleep_since, order.occurred_at)
        stayed = len(reply.parked) + len(reply.failed)
        detail = reply.detail + (f"; {stayed} dropped when the engine slept" if stayed else "")
        drained = CellDrained(
            cell_id=w.cell_id,
            worker_id=w.worker_id,
            migrated_sessions=len(reply.migrated),
            parked_sessions=stayed,
            seconds=max(0.0, reply.seconds) + slept.seconds,
            detail=detail[:DRAIN_DETAIL_CHARS],
            phases={"drain_s": max(0.0, reply.seconds), "sleep_s": slept.seconds},
        )
        self.log.info("cell_drained", migrated=drained.migrated_sessions, parked=len(reply.parked),
                      failed=len(reply.failed), **{k: round(v, 3) for k, v in drained.phases.items()})
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
            codec=TokenizerCodec.from_model_dir(self.settings.model_dir, tool_format=r.tool_call_format),
            router=Router(directory, NatsWorkerClient(self.bus)),
            recorder=PostgresCallRecorder(self.store, run_id=self.settings.run_id),
            tokens=TokenVerifier(r.token_secret.encode()),
            max_model_len=r.max_model_len, model_name=r.model_name, max_reply_tokens=r.max_reply_tokens,
        )
        self.metrics.also(self.core.metrics.registry)  # its call metrics on the health port too
        app = create_app(self.core, max_body_bytes=r.max_body_bytes, body_timeout_s=r.body_timeout_s)
        configs = [uvicorn.Config(app, host=r.host, port=r.port, log_level="warning", lifespan="off")]
        if r.uds:
            configs.append(uvicorn.Config(app, uds=r.uds, log_level="warning", lifespan="off"))
        for config in configs:
            server = uvicorn.Server(config)
            # The Service owns SIGTERM/SIGINT; uvicorn must not capture and re-raise them.
            server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
            self._servers.append(server)
            self.spawn(server.serve(), name="http")
        self.on(["execution.started", "execution.finished", "execution.timed_out"], self.handle,
                durable=f"{self.name}-{r.gateway_id}" if r.gateway_id else None)

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

    def stopping(self) -> None:
        for server in self._servers:
            server.should_exit = True  # uvicorn finishes the requests in flight, then its task ends

    async def teardown(self) -> None:
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
