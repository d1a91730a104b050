"""The trainer coordinator: batch.ready in, one GSPO step per batch driven on the ranks of the training cells,
step.completed, trainer.rank_stepped and weights.published out. It holds no model: the ranks (rank.py) do.

Members follow the cells (membership.py, a fold of their events); the group re-forms only at step boundaries (the
group lock is held for a step, a form or a leave): at once when no step runs, else right after the running one.
Exactly once per step: the ranks checkpoint a step before the coordinator returns its events as `Effects` (recorded
with the batch's tracking row afterwards), and every form reports the trainer state the members resumed, so a batch
delivered again finds its step trained and is only re-emitted. A step a member fails (a rank dies, a collective
errors) is abandoned and redone on a group re-formed from the latest checkpoint: never lost, never applied twice.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from functools import partial
from pathlib import Path
from collections.abc import Awaitable
from typing import Any, TypeVar

from services.trainer.group import Group, GroupBroken, RankClient
from services.trainer.cell_facts import CellFacts
from services.trainer.membership import CELL_FACTS, Decision, DrainOrder, decide
from services.trainer.options import TrainerOptions
from services.trainer.protocol import OBJECT_SCHEME, FormRequest, StepReply, StepRequest, TrainerSpec, TrainerState
from services.trainer.publications import Publications
from shared.bus import ConsumerOptions
from shared.effects import Effects
from shared.events import (BatchReady, BlobRef, CellDrained, Event, GroupFormed, RankStepped, StepCompleted,
                           WeightsPublished, stream_id_for)
from shared.runtime import Service
from shared.settings import Settings
from shared.store import ConcurrencyConflict


T = TypeVar("T")
LEAVE_TIMEOUT_S = 30.0  # a leave destroys a process group without a barrier: quick, or the rank is stuck


class TrainerServiceError(Exception):
    pass


class StepOutOfOrder(TrainerServiceError):
    """A batch arrived before the one for the step before it; raised so the bus redelivers it later."""


class NoTrainingCells(TrainerServiceError):
    """No cell trains: the batch is handed back and retried (a cell may be switched to training later)."""


def step_stream_id(run_id: str, step: int) -> str:
    return stream_id_for("step", f"{run_id}-{step}")


def weights_stream_id(run_id: str, version: int) -> str:
    return stream_id_for("weights", f"{run_id}-{version}")


def trainer_stream_id(run_id: str) -> str:
    return stream_id_for("trainer", run_id)


class TrainerService(Service):
    name = "trainer"

    def __init__(self, settings: Settings | None = None, options: TrainerOptions | None = None) -> None:
        super().__init__(settings)
        self.options = options or TrainerOptions()
        self.client: RankClient | None = None
        self.cells: CellFacts | None = None
        self.failed: set[str] = set()  # rank ids found gone; a new process on the cell has another id
        self.group: Group | None = None
        self.intact = True  # False after a member left or a step failed: re-form before the next step
        self.generation = 0
        self.state: TrainerState | None = None  # what the members hold (learnt at each form, moved by each step)
        self.lock = asyncio.Lock()  # held for a step, a form, a leave: what makes a step boundary
        self.changed = asyncio.Event()  # the cells changed: converge at the next boundary
        self.formed = asyncio.Event()  # set while a group is formed
        self._initial_published = False
        self._recovered = False  # the checkpointed step's events recorded after a restart
        self._tcp_store: Any = None
        self.publications: Publications  # what it published, and retention (set up: needs the store)

    @property
    def checkpoint_root(self) -> str:  # where the ranks keep the checkpoints: the Object Store or a shared folder
        if self.options.checkpoint_store == "object":
            return OBJECT_SCHEME + self.settings.run_id
        return str(self.options.checkpoint_dir or Path(self.settings.state_dir) / "trainer" / self.settings.run_id
                   / "checkpoints")

    def trainer_spec(self) -> TrainerSpec:
        s, o = self.settings, self.options
        return TrainerSpec(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip, precision=o.precision,
                           eps_low=s.eps_low, eps_high=s.eps_high, is_cap=s.is_cap,
                           recompute_old_logprobs=s.recompute_old_logprobs, publish_dtype=o.publish_dtype,
                           shard_bytes=o.shard_bytes)

    async def setup(self) -> None:
        assert self.store is not None and self.bus is not None
        self.client = RankClient(self.bus, self.options.probe_every_s)
        window = max(self.options.keep_versions, self.settings.max_staleness)
        self.publications = Publications(self.store, self.blobs, run_id=self.settings.run_id, log=self.log,
                                         event=self.event, window=window)
        self._tcp_store = await asyncio.to_thread(_tcp_store, self.options.store_port)
        run_id = self.settings.run_id
        formed = await self.store.read_all(types=["trainer.group_formed"], run_id=run_id)
        # Generations only grow, across restarts too: a rank still formed by an earlier incarnation is never
        # mistaken for a member of a new group.
        self.generation = max((s.event.data.generation for s in formed if isinstance(s.event.data, GroupFormed)),
                              default=0)
        self.cells = CellFacts(self.store, run_id)
        await self.cells.load()
        options = ConsumerOptions(
            ack_wait_s=self.options.ack_wait_s or self.settings.ack_wait_s,
            # Out-of-order waits and waits for a training cell are retries, not failures.
            max_deliver=max(self.settings.max_deliver, 1000),
            backoff_s=tuple(self.settings.backoff_s),
        )
        self.on(["batch.ready"], self.handle, options=options)
        # One consumer per run: every coordinator must see every fact of its run's cells.
        self.on(list(CELL_FACTS), self.on_cell_fact, durable=re.sub(r"[^A-Za-z0-9_-]", "-", f"trainer-cells-{run_id}"))
        self.spawn(self._converge_on_change(), name="group")
        self.changed.set()
        self.log.info("coordinator_ready", store_port=self._tcp_store.port, generation=self.generation,
                      cells=sorted(self.cells.views))

    def stopping(self) -> None:
        self.changed.set()  # the re-forming loop wakes, sees the stop and ends

    async def teardown(self) -> None:
        self._tcp_store = None

    def health(self) -> dict[str, Any]:
        g, st = self.group, self.state
        return {
            "generation": g.generation if g else None,
            "members": [m.cell_id for m in g.members] if g else [],
            "world_size": g.world_size if g else 0,
            "last_step": st.last_step if st else None,
            "policy_version": st.policy_version if st else None,
        }

    # ------------------------------------------------------------------------------------ membership

    async def on_cell_fact(self, event: Event) -> None:
        """A fact of a cell: fold its stream again at the next boundary (the store holds it in order)."""
        cell_id = getattr(event.data, "cell_id", None)
        if isinstance(cell_id, str) and self.cells is not None:
            self.cells.touch(cell_id)
            self.changed.set()

    async def _converge_on_change(self) -> None:
        """Re-form whenever the cells change and no step runs (eagerly: a cell switched to training joins without
        waiting for a batch, and a leaving one is let go at once)."""
        while True:
            await self.changed.wait()
            if self.stop_event.is_set():  # woken by `stopping`
                return
            self.changed.clear()
            try:
                async with self.lock:
                    await self.converge()
            except Exception as exc:  # a form failed: try again on the next change, or after a pause
                self.log.warning("converge_failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(min(self.settings.backoff_s or [1.0]))
                self.changed.set()

    async def converge(self) -> None:
        """(Lock held.) Answer the drains of training cells (their ranks leave first), then re-form the group from
        the current cells if its members changed or it is not intact."""
        assert self.cells is not None
        await self.cells.refresh()
        decision = self._decide()
        for order in decision.drains:
            await self._answer_drain(order)
        if decision.drains:
            decision = self._decide()
        if decision.reform:
            await self._form(decision)

    async def _on_group(self, work: Awaitable[T]) -> T:
        """(Lock held.) Group-wide work; when a member fails it, the group is no longer intact (its members' weights
        may have moved without a checkpoint) and the members found gone are left out of the next one."""
        try:
            return await work
        except GroupBroken as exc:
            self.failed.update(m.rank_id for m in exc.gone)
            self.intact = False
            raise

    def _decide(self) -> Decision:
        current = self.group.members if self.group is not None else ()
        assert self.cells is not None
        return decide(list(self.cells.views.values()), self.failed, current, self.intact)

    async def _answer_drain(self, order: DrainOrder) -> None:
        """Let the draining cell's rank go (no barrier, at this boundary) and say so with `cell.drained`, caused by the
        `cell.draining` it answers."""
        assert self.client is not None and self.cells is not None
        waited = self.cells.waited(order.draining_id)
        leave_s = 0.0
        if order.member is not None and self.group is not None:
            # The group keeps naming it until it re-forms (which then says who left); it is no longer whole.
            left = await self.client.leave([order.member], self.group.generation, LEAVE_TIMEOUT_S)
            leave_s = left[order.member]
            self.intact = False
        cause = await self.cells.draining_event(order.cell_id, order.draining_id)
        rank_id = order.member.rank_id if order.member else self.cells.views[order.cell_id].rank_id
        drained = CellDrained(cell_id=order.cell_id, worker_id=rank_id or "",
                              migrated_sessions=0, parked_sessions=0, seconds=waited + leave_s,
                              phases={"wait_step_s": waited, "leave_s": leave_s})
        event = self.event(drained, stream_id=stream_id_for("cell", order.cell_id), cause=cause)
        await self.emit([event], expected_version="any")
        self.cells.answered(order.cell_id, event)  # not answered again
        self.log.info("rank_left", cell_id=order.cell_id, member=order.member is not None,
                      wait_step_s=round(waited, 3), leave_s=round(leave_s, 3))

    async def _form(self, decision: Decision) -> None:
        """(Lock held.) Form the group `decision` names: the old members that are not in it leave, the new ones join
        generation g+1 through the store and load the latest checkpoint. A member found gone meanwhile is left out
        and the group formed without it."""
        assert self.client is not None
        members, reason = decision.members, decision.reason
        had_group = self.group is not None
        while True:
            started = time.monotonic()
            old = self.group
            if old is not None:
                await self.client.leave([m for m in old.members if m not in members], old.generation, LEAVE_TIMEOUT_S)
            self.group, self.intact = None, True
            self.formed.clear()
            if not members:
                if had_group:  # dissolved: no cell trains now
                    await self._group_formed(Group(self.generation + 1, ()), started, {}, reason)
                return
            alive = await asyncio.gather(*(self.client.alive(m) for m in members))
            gone = [m for m, ok in zip(members, alive, strict=True) if not ok]
            if not gone:
                group = Group(self.generation + 1, members)
                self.generation = group.generation
                try:
                    replies = await self.client.form(group, self._form_requests(group), self.options.form_timeout_s)
                except GroupBroken as exc:
                    gone = list(exc.gone)
                    if not gone:
                        raise
                else:
                    self._take_state([r.state for r in replies])
                    self.group = group
                    self.formed.set()
                    slowest = max(replies, key=lambda r: sum(r.phases.values()))
                    await self._group_formed(group, started, slowest.phases, reason)
                    await self._after_form()
                    return
            self.failed.update(m.rank_id for m in gone)
            self.log.warning("members_gone", cells=[m.cell_id for m in gone])
            decision = self._decide()
            members, reason = decision.members, decision.reason

    def _form_requests(self, group: Group) -> list[FormRequest]:
        return [
            FormRequest(
                generation=group.generation, rank_id=m.rank_id, rank=rank, world_size=group.world_size,
                store_host=self.options.store_host, store_port=self._tcp_store.port,
                checkpoint_root=self.checkpoint_root, keep_checkpoints=self.options.keep_checkpoints,
                first_step=self.options.first_step, timeout_s=self.options.collective_timeout_s,
                trainer=self.trainer_spec(),
            )
            for rank, m in enumerate(group.members)
        ]

    def _take_state(self, states: list[TrainerState]) -> None:
        if any(s != states[0] for s in states[1:]):
            raise TrainerServiceError(f"the members resumed different checkpoints: {states} (is the checkpoint "
                                      "directory shared by every rank?)")
        self.state = states[0]

    async def _group_formed(self, group: Group, started: float, phases: dict[str, float], reason: str) -> None:
        next_step = self.state.last_step + 1 if self.state is not None else self.options.first_step
        data = GroupFormed(generation=group.generation, members=[m.cell_id for m in group.members],
                           world_size=group.world_size, next_step=next_step, seconds=time.monotonic() - started,
                           phases=phases, reason=reason)
        self.generation = group.generation
        await self.emit([self.event(data, stream_id=trainer_stream_id(self.settings.run_id))], expected_version="any")
        self.log.info("group_formed", generation=group.generation, members=data.members, next_step=next_step,
                      seconds=round(data.seconds, 3), reason=reason, **{k: round(v, 3) for k, v in phases.items()})

    async def _after_form(self) -> None:
        """The first group of this incarnation publishes the initial weights (once per run) and records the
        checkpointed step's events if a crash lost them (before any later batch: one can arrive first, while the
        crashed consumer's message waits out its ack_wait)."""
        assert self.state is not None
        if not self._initial_published and self.state.policy_version == 0:
            await self._publish_initial()
        self._initial_published = True
        if not self._recovered:
            if self.state.last_step >= self.options.first_step:
                await self.record(await self._step_effects(None, self.state, None, []))
            self._recovered = True

    # ------------------------------------------------------------------------------------------ steps

    async def handle(self, event: Event) -> Effects | None:
        """Drive the batch's step on the group (outside any transaction: the runtime records the returned effects
        with the event's tracking row once every member has trained and checkpointed it)."""
        data = event.data
        if not isinstance(data, BatchReady):
            return None
        if self.state is not None and data.step > self.state.last_step + 1:
            raise StepOutOfOrder(f"batch for step {data.step} arrived, expected step {self.state.last_step + 1} first")
        deadline = time.monotonic() + self.options.idle_wait_s
        attempts = 0
        while True:
            async with self.lock:
                try:
                    await self.converge()
                    if self.group is not None:
                        return await self._step_on_group(event, data)
                except GroupBroken as exc:
                    attempts += 1
                    self.log.warning("step_abandoned", step=data.step, attempt=attempts, error=str(exc))
                    if attempts >= self.options.step_attempts:
                        raise
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoTrainingCells(f"no cell trains; step {data.step} waits for one")
            try:
                await asyncio.wait_for(self.formed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    async def _step_on_group(self, event: Event, data: BatchReady) -> Effects | None:
        """(Lock held, a group formed.) Train the batch's step, or re-emit it when the members' checkpoint holds it."""
        assert self.group is not None and self.state is not None
        if data.step <= self.state.last_step:
            # Trained before a crash or a failed record: the checkpoint has the result; emit it.
            self.log.info("batch_already_trained", step=data.step, last_step=self.state.last_step)
            return await self._step_effects(event, self.state, None, []) if data.step == self.state.last_step else None
        if data.step != self.state.last_step + 1:
            raise StepOutOfOrder(f"batch for step {data.step} arrived, expected step {self.state.last_step + 1} first")
        return await self._train(event, data, self.group, self.state)

    async def _train(self, event: Event, data: BatchReady, group: Group, state: TrainerState) -> Effects:
        assert self.client is not None
        n = data.step - self.options.first_step + 1
        request = StepRequest(step=data.step, generation=group.generation, batch=data.batch,
                              publish=n == 1 or n % self.options.publish_every == 0,
                              max_staleness=self.settings.max_staleness)
        started = time.monotonic()
        replies = await self._on_group(self.client.step(group, request, self.options.step_timeout_s))
        lead = replies[0]
        self.state = TrainerState(last_step=data.step, step_count=lead.step_count, policy_version=lead.policy_version,
                                  metrics=lead.metrics, seconds=lead.seconds, world_size=group.world_size)
        published = None if lead.weights is None else (lead.weights, lead.publish_s)
        effects = await self._step_effects(event, self.state, published, [
            RankStepped(step=data.step, generation=group.generation, cell_id=m.cell_id, rank=r.rank,
                        world_size=group.world_size, micro_batches=r.micro_batches, tokens=r.tokens, seconds=r.seconds)
            for m, r in zip(group.members, replies, strict=True)
        ])
        wall = time.monotonic() - started
        self.log.info("step_completed", step=data.step, world_size=group.world_size, seconds=round(wall, 3),
                      overhead_s=round(wall - max(r.seconds + r.checkpoint_s for r in replies), 3),
                      **_headline(lead))
        return effects

    async def _step_effects(
        self, cause: Event | None, state: TrainerState, weights: tuple[BlobRef, float] | None,
        ranks: list[RankStepped],
    ) -> Effects:
        """`step.completed` (and each rank's `trainer.rank_stepped`) for the trained step `state.last_step`, and
        `weights.published` when it publishes (the weights stored by rank 0, or now by the group that holds them):
        nothing when an earlier incarnation recorded them already."""
        assert self.store is not None
        effects = Effects()
        step = state.last_step
        stream = step_stream_id(self.settings.run_id, step)
        if await self.store.read_stream(stream):
            return effects  # emitted and committed already
        metrics = state.metrics
        # An event cannot hold NaN or infinity (JSON); a diverged step says so by name and count instead.
        nonfinite = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if nonfinite:
            self.log.warning("nonfinite_metrics", step=step, metrics=nonfinite)
            metrics = {**{k: v for k, v in metrics.items() if k not in nonfinite},
                       "nonfinite_metrics": float(len(nonfinite))}
        completed = StepCompleted(step=step, policy_version=state.policy_version, world_size=state.world_size,
                                  seconds=state.seconds, metrics=metrics)
        effects.append([self.event(completed, stream_id=stream, version=1, cause=cause)], expected_version=0)
        if ranks:
            trainer_stream = trainer_stream_id(self.settings.run_id)
            effects.append([self.event(r, stream_id=trainer_stream, cause=cause) for r in ranks],
                           expected_version="any")
        n = step - self.options.first_step + 1
        if n == 1 or n % self.options.publish_every == 0:
            published = await self.publications.published(state.policy_version, step,
                                                          *(weights or await self._publish()))
            stream = weights_stream_id(self.settings.run_id, state.policy_version)
            effects.append([self.event(published, stream_id=stream, version=1, cause=cause)], expected_version=0)
            effects.after_commit(lambda: self.publications.retire(partial(weights_stream_id, self.settings.run_id)))
        return effects

    async def _publish(self) -> tuple[BlobRef, float]:
        """The weights the group holds, stored now: the manifest's reference and the seconds it took."""
        assert self.client is not None
        if self.group is None:
            raise TrainerServiceError("no group holds the weights to publish")
        reply = await self._on_group(self.client.publish(self.group, self.options.step_timeout_s))
        assert reply.weights is not None
        return reply.weights, reply.publish_s

    async def _publish_initial(self) -> None:
        assert self.store is not None
        stream = weights_stream_id(self.settings.run_id, 0)
        if await self.store.read_stream(stream):
            return
        event = self.event(await self.publications.published(0, -1, *await self._publish()), stream_id=stream)
        try:
            await self.emit([event], expected_version=0)
        except ConcurrencyConflict as exc:  # another incarnation published it first: same weights
            self.log.info("initial_weights_already_published", detail=str(exc))


def _tcp_store(port: int) -> Any:
    """The rendezvous store the members meet in (each generation under a prefix of its own)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True)


def _headline(reply: StepReply) -> dict[str, float]:
    return {k: round(v, 6) for k, v in reply.metrics.items() if k in ("loss", "clip_fraction", "grad_norm")}


__all__ = [
    "NoTrainingCells",
    "StepOutOfOrder",
    "TrainerOptions",
    "TrainerService",
    "TrainerServiceError",
    "step_stream_id",
    "trainer_stream_id",
    "weights_stream_id",
]
