"""The cell agent's live test harness: the agent with its outbox relay, orders, reads of a cell's stream, the
processes it started, and a stand-in for the trainer coordinator's side of the cell contract."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nats

from services.scheduler.cell_agent import CellAgent
from services.scheduler.cell_settings import CellSettings
from shared import ports
from shared.cells import Role
from shared.events import (
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReleased,
    Event,
    EventData,
    GroupFormed,
    RankReady,
    new_event,
    parse_event,
)
from shared.relay import OutboxRelay
from shared.runtime import utcnow
from shared.settings import Settings
from tests.conftest import Infra

FAKES = str(Path(__file__).resolve().parent / "fake_cell_processes.py")

# A stand-in for a role's process: writes its pid where the test can see it, then sleeps.
SLEEPER = "import os,sys,time,pathlib; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)"
# A trainer rank that ignores SIGTERM: only SIGKILL stops it.
STUBBORN = ("import os,sys,time,signal,pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)")


def form_subject(prefix: str, cell: str) -> str:
    """Where the fake rank answers the fake coordinator's request to join. Not under `<prefix>.trainer.`: that is
    the `trainer` event family's JetStream stream, which would store the request and answer it with its ack."""
    return f"{prefix}.fake_rank.{cell}.form"


def fake_worker(mode: str, directory: Path) -> str:
    """The command template of a fake rollout worker (fake_cell_processes.py) behaving as `mode`."""
    return f"{{python}} {FAKES} worker {mode} {directory}"


def fake_rank(directory: Path) -> str:
    return f"{{python}} {FAKES} rank {directory}"


def launches(directory: Path, cell: str, role: str) -> list[tuple[int, bool | None]]:
    """What the agent started for `role` on `cell`, in order: (pid, standby) per launch of a fake process (None
    for a rank, which starts the same either way)."""
    path = directory / f"{cell}-{role}.launches"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(int(pid), {"standby=1": True, "standby=0": False}.get(flag)) for pid, flag in rows]


def agent(infra: Infra, store, bus, run_id: str, tmp_path: Path, **cell) -> CellAgent:
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, state_dir=tmp_path / "state",
    )
    base = dict(
        # The first assignment starts the role's process (standby_from_start, the default, is tested on its own).
        count=2, node_id="n1", rollout_ready="started", train_ready="started", start_grace_s=0.2,
        standby_from_start=False,
        stop_timeout_s=0.5, restart_backoff_s=0.1, health_port_base=0,
        rollout_command=f"{{python}} -c '{SLEEPER}' {tmp_path}/{{cell_id}}-rollout.pid",
        train_command=f"{{python}} -c '{STUBBORN}' {tmp_path}/{{cell_id}}-train.pid",
    )
    return CellAgent(settings, CellSettings(**{**base, **cell}))


class Running:
    """The agent plus the outbox relay that carries the scheduler's orders to it over NATS."""

    def __init__(self, store, bus, infra: Infra, svc: CellAgent) -> None:
        self.svc = svc
        self.stop = asyncio.Event()
        self.relay = OutboxRelay(store, bus, dsn=infra.database_url, idle_wait_s=0.05)
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> CellAgent:
        self.task = asyncio.create_task(self.relay.run(self.stop))
        await self.svc.start()
        return self.svc

    async def __aexit__(self, *exc) -> None:
        await self.svc.stop()
        self.stop.set()
        assert self.task is not None
        await self.task


async def assign(store, run_id: str, cell: str, role: str) -> None:
    event = new_event(CellAssigned(cell_id=cell, role=role, policy="test"), run_id=run_id,  # type: ignore[arg-type]
                      stream_id=f"cell-{cell}", version=1, occurred_at=utcnow())
    await store.append([event], expected_version="any")


async def cell_log(store, run_id: str, cell: str) -> list:
    return [s.event for s in await store.read_stream(f"cell-{cell}") if s.event.run_id == run_id]


async def wait_for(store, run_id: str, cell: str, etype: str, count: int, timeout: float = 60) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = await cell_log(store, run_id, cell)
        if sum(1 for e in events if e.type == etype) >= count:
            return events
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"expected {count} {etype} on {cell}; have {[e.type for e in events]}")
        await asyncio.sleep(0.05)


async def pid_in(path: Path, *, not_pid: int | None = None, timeout: float = 30) -> int:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if path.exists() and path.read_text():
            pid = int(path.read_text())
            if pid != not_pid:
                return pid
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no pid in {path}")
        await asyncio.sleep(0.05)


def free_port_pair() -> int:
    """A port p with p and p + 1 free now (a cell's rollout and train health ports, with one cell)."""
    return ports.free_port_block(2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until(check, what: str, timeout: float = 60):
    """Poll `check()` (sync or async) until it returns something truthy; that value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.05)


class FakeCoordinator:
    """The trainer coordinator's side of the cell contract (design: docs/trainer.md), on real NATS and Postgres:
    a cell is a member candidate when its latest order is `train`, it was released from its previous role since
    (or was idle), and its rank stood by (`trainer.rank_ready`) and answers the request to join; a member leaves on `cell.draining` from train,
    answered with `cell.drained` (no step runs here, so at once; a non-member is answered at once too). Whenever
    the members change it appends `trainer.group_formed`."""

    def __init__(self, store, bus, infra: Infra, run_id: str) -> None:
        self.store, self.bus, self.infra, self.run_id = store, bus, infra, run_id
        self.role: dict[str, Role] = {}
        self.released: dict[str, bool] = {}
        self.ranks: dict[str, str] = {}
        self.left: set[str] = set()
        self.members: list[str] = []
        self.generation = 0
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.nc: nats.NATS | None = None
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> FakeCoordinator:
        self.nc = await nats.connect(self.infra.nats_url)

        async def received(msg) -> None:
            self.queue.put_nowait(parse_event(msg.data))

        for subject in ("cell.>", "trainer.rank_ready"):
            await self.nc.subscribe(f"{self.bus.prefix}.{subject}", cb=received)
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.task is not None and self.nc is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.nc.close()

    async def _run(self) -> None:
        while True:
            event = await self.queue.get()
            if event.run_id == self.run_id:
                await self._fold(event)

    async def _fold(self, event: Event) -> None:
        data = event.data
        match data:
            case CellAssigned():
                before = self.role.get(data.cell_id, Role.IDLE)
                self.role[data.cell_id] = Role(data.role)
                self.released[data.cell_id] = before is Role.IDLE
                if data.role == Role.TRAIN:
                    self.left.discard(data.cell_id)
            case CellReleased():
                self.released[data.cell_id] = True
            case RankReady():
                self.ranks[data.cell_id] = data.rank_id
            case CellDraining(from_role=Role.TRAIN):
                self.left.add(data.cell_id)
                await self._append(CellDrained(
                    cell_id=data.cell_id, worker_id=self.ranks.get(data.cell_id, data.cell_id), migrated_sessions=0,
                    parked_sessions=0, seconds=0.01, phases={"wait_step_s": 0.0, "leave_s": 0.01},
                ), stream=f"cell-{data.cell_id}", cause=event)
            case _:
                return
        members = sorted(c for c in self.role if (c in self.members and c not in self.left) or (
            self.role[c] is Role.TRAIN and self.released.get(c) and c in self.ranks))
        for cell in [c for c in members if c not in self.members]:
            # Joining takes the rank's answer: a rank that died since its trainer.rank_ready is not listed.
            try:
                assert self.nc is not None
                await self.nc.request(form_subject(self.bus.prefix, cell), b"{}", timeout=10)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                del self.ranks[cell]
                members.remove(cell)
        if members != self.members:
            self.generation += 1
            reason = "joined" if len(members) > len(self.members) else "left"
            self.members = members
            await self._append(GroupFormed(
                generation=self.generation, members=members, world_size=len(members), next_step=0, seconds=0.06,
                phases={"group_s": 0.01, "build_s": 0.02, "load_s": 0.03}, reason=reason,
            ), stream=f"trainer-{self.run_id}")

    async def _append(self, data: EventData, *, stream: str, cause: Event | None = None) -> None:
        event = new_event(data, run_id=self.run_id, stream_id=stream, version=1, occurred_at=utcnow(),
                          causation_id=cause.event_id if cause else None)
        await self.store.append([event], expected_version="any")
