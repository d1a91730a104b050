"""The live scheduler: folds its run's event log into a Snapshot, asks the configured policy (the same
objects the simulator drives) what to do on every tick, and turns the answer into `cell.assigned` and
`query.dispatched` events.

The fold tails the log by global position (commit order; a restarted scheduler replays it from the start
and so knows every dispatch); a bus consumer only wakes the tick early when something happened. A query's
dispatch is appended at expected version 0 of its own stream, so it can never be dispatched twice.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.scheduler.plan import PlanError, QueryPlan, query_stream
from services.scheduler.policies import (
    Action,
    AssignCell,
    DispatchQuery,
    FILL,
    SESSION_RESERVE_TOKENS,
    DrainCell,
    ElasticTiming,
    MigrateSession,
    Policy,
    PolicyConfigError,
    PolicyViolation,
    Snapshot,
    apply_actions,
    make_policy,
)
from services.scheduler.run_view import FOLDED_TYPES, RunView
from shared.cells import Role
from shared.events import CellAssigned, Event, KvMigrationOrdered, stream_id_for
from shared.logging import configure_logging
from shared.runtime import Service, utcnow
from shared.settings import NameList, Settings, load_settings
from shared.store import ConcurrencyConflict


class SchedulerConfigError(ValueError):
    """The scheduler was configured with values it cannot run with."""


class SchedulerSettings(BaseSettings):
    """`GYRE_SCHEDULER_…`; the mode, staleness bound and group size are the shared GYRE_MODE,
    GYRE_MAX_STALENESS and GYRE_GROUP_SIZE."""

    model_config = SettingsConfigDict(env_prefix="GYRE_SCHEDULER_", extra="ignore", frozen=True)

    task_ids: NameList = Field(default_factory=list)  # comma-separated or a JSON list
    task_order: Literal["round_robin", "seeded"] = "round_robin"
    queries_per_step: int = Field(default=1, ge=1)
    total_steps: int = Field(default=1, ge=0)
    tick_s: float = Field(default=1.0, gt=0)
    seed: int = 0
    # Which agent runs each query's executions; `builtin` leaves it to the harness service's GYRE_HARNESS_HARNESS.
    harness: Literal["builtin", "claude-code"] = "builtin"
    budget_cells: int = Field(default=0, ge=0)  # 0: every registered cell
    rollout_cells: int = Field(default=0, ge=0)  # async's rollout pool; 0: half the budget
    min_cells: int = Field(default=1, ge=1)  # decide nothing before this many cells registered
    session_reserve_tokens: int = Field(default=SESSION_RESERVE_TOKENS, ge=1)  # KV one session reserves on its cell
    default_kv_tokens: int = Field(default=1 << 20, ge=1)  # a cell that registers capacity 0
    fill: float = Field(default=FILL, gt=0, le=1)
    # An ordered session move the worker has not reported done or refused by then is taken as not made.
    migration_timeout_s: float = Field(default=300.0, gt=0)
    # A rollout cell this long behind the newest published weights stops holding dispatch (its load is stuck).
    weights_wait_s: float = Field(default=300.0, gt=0)
    # Colocate's run-ahead parks in-flight sessions through each training phase. A live engine that is
    # stopped for training (vLLM on CPU has no sleep mode) cannot hold them, and their calls would fail
    # while the pool trains; so live colocate runs synchronously unless asked (the simulator parks).
    colocate_run_ahead: bool = False
    # The elastic policy's hysteresis (policies/elastic.py, ElasticTiming): the defaults suit steps of minutes.
    elastic_min_dwell_s: float = Field(default=300.0, ge=0)
    elastic_train_horizon_s: float = Field(default=1_200.0, gt=0)
    elastic_margin: int = Field(default=2, ge=0)


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, settings: Settings | None = None, scheduler: SchedulerSettings | None = None) -> None:
        super().__init__(settings)
        self.sched = scheduler or SchedulerSettings()
        if not self.sched.task_ids:
            raise SchedulerConfigError("GYRE_SCHEDULER_TASK_IDS must name at least one task to train on")
        self.plan = QueryPlan(
            run_id=self.settings.run_id,
            task_ids=tuple(self.sched.task_ids),
            queries_per_step=self.sched.queries_per_step,
            total_steps=self.sched.total_steps,
            group_size=self.settings.group_size,
            seed=self.sched.seed,
            task_order=self.sched.task_order,
            harness=self.sched.harness,
        )
        self.view = RunView(
            plan=self.plan,
            max_staleness=self.settings.max_staleness,
            session_reserve_tokens=self.sched.session_reserve_tokens,
            default_kv_tokens=self.sched.default_kv_tokens,
            budget_cells=self.sched.budget_cells,
            migration_timeout_s=self.sched.migration_timeout_s,
            weights_wait_s=self.sched.weights_wait_s,
        )
        self.position = 0
        self.ticks = 0
        self._wake = asyncio.Event()
        self._policies: dict[int, Policy] = {}
        self._announced_done = False
        self._last_error = ""
        self._never_fits = ""  # the query last said to need more sessions than the cells can hold
        self._waiting_for: tuple[int, int] | None = None  # (dispatch, trainer) versions last logged as holding dispatch
        self._stuck_logged: set[tuple[str, int]] = set()
        self.log = self.log.bind(mode=self.settings.mode)

    async def setup(self) -> None:
        await self.catch_up()
        self.log.info("scheduler_resumed", position=self.position, dispatched=len(self.view.dispatched_numbers),
                      policy_version=self.view.policy_version, cells=len(self.view.cells))
        # Per run: runs sharing a subject prefix must not split one durable consumer's messages.
        durable = re.sub(r"[^A-Za-z0-9_-]", "-", f"scheduler-{self.settings.run_id}")
        self.on(list(FOLDED_TYPES), self._nudge, durable=durable)
        self.spawn(self._loop(), name="scheduler-tick")

    def health(self) -> dict[str, Any]:
        return {
            "mode": self.settings.mode,
            "policy_version": self.view.policy_version,
            "queries_dispatched": len(self.view.dispatched_numbers),
            "dispatch_version": self.view.dispatch_version(self.view.seconds_at(utcnow())),
            "live_sessions": len(self.view.sessions),
            "cells": {c.cell_id: f"{c.role.value}/{c.state.value}" for c in self.view.cells.values()},
            "done": self.view.done,
            # Folded from kv.migrated: what moving KV saved, and the moves that tried it and recomputed.
            "kv": {"prefill_tokens_avoided": self.view.prefill_tokens_avoided, "fallbacks": self.view.kv_fallbacks},
            "never_fits": self._never_fits,  # a query waiting for more sessions than the cells can hold ("": none)
        }

    async def _nudge(self, event: Event) -> None:
        if event.run_id == self.settings.run_id:
            self._wake.set()

    # ---- the fold ----

    async def catch_up(self) -> int:
        """Fold every event of the run committed since the last call; returns how many were read."""
        assert self.store is not None
        read = 0
        while True:
            page = await self.store.read_after(
                self.position, limit=1000, types=FOLDED_TYPES, run_id=self.settings.run_id
            )
            for stored in page:
                self.view.apply(stored.event)
                self.position = stored.position
            read += len(page)
            if len(page) < 1000:
                return read

    # ---- the loop ----

    async def _loop(self) -> None:
        while not self.stop_event.is_set():
            # Cleared before the tick, so an event that lands while it runs wakes the next one at once.
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # a failed tick (database away, ...) is retried on the next one
                self.log.exception("tick_failed")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.sched.tick_s)
            except asyncio.TimeoutError:
                pass

    def policy(self, budget_cells: int) -> Policy:
        if budget_cells not in self._policies:
            self._policies[budget_cells] = make_policy(
                self.settings.mode,
                budget_cells=budget_cells,
                rollout_cells=self.sched.rollout_cells or None,
                fill=self.sched.fill,
                colocate_run_ahead=self.sched.colocate_run_ahead,
                elastic_timing=ElasticTiming(
                    train_horizon_s=self.sched.elastic_train_horizon_s,
                    min_dwell_s=self.sched.elastic_min_dwell_s,
                    margin=self.sched.elastic_margin,
                ),
            )
        return self._policies[budget_cells]

    async def tick(self) -> list[Event]:
        """Catch up with the log, decide, and emit the decision. Returns the events appended."""
        await self.catch_up()
        self.ticks += 1
        if self.view.done:
            if not self._announced_done:
                self._announced_done = True
                self.log.info("run_complete", steps=self.plan.total_steps,
                              queries_dispatched=len(self.view.dispatched_numbers),
                              prefill_tokens_avoided=self.view.prefill_tokens_avoided,
                              kv_fallbacks=self.view.kv_fallbacks)
            return []
        if len(self.view.cells) < self.sched.min_cells:
            return []
        snapshot = self.view.snapshot(self.view.seconds_at(utcnow()))
        self._log_weight_wait(snapshot.now_s)
        self._log_never_fits(snapshot)
        try:
            policy = self.policy(snapshot.budget_cells)
            actions = policy.decide(snapshot)
            apply_actions(snapshot, actions, allow_parking=policy.allows_parking)
        except (PolicyConfigError, PolicyViolation) as exc:
            if str(exc) != self._last_error:  # once per distinct reason, not every tick
                self.log.error("no_decision", error=str(exc), cells=len(snapshot.cells))
                self._last_error = str(exc)
            return []
        self._last_error = ""
        emitted = await self.execute(snapshot, actions)
        if emitted:
            await self.catch_up()
        return emitted

    def _log_never_fits(self, snapshot: Snapshot) -> None:
        """Say once per query when the next query needs more sessions than the mode's rollout cells could ever
        admit together, at the KV their engines report (the fill, one reserve a session): it would wait for ever.
        The run config refuses such KV before a run starts; settings given some other way reach here."""
        engines = [c.engine_kv for c in self.view.cells.values() if c.engine_kv]
        if not snapshot.queued or not engines or snapshot.queued[0].query_id == self._never_fits:
            return
        pool = snapshot.budget_cells
        if self.settings.mode == "async":
            pool = self.sched.rollout_cells or max(1, pool // 2)
        per_cell = int(max(engines) * self.sched.fill) // self.sched.session_reserve_tokens
        head = snapshot.queued[0]
        if head.group_size > pool * per_cell:
            self._never_fits = head.query_id
            self.log.error("query_never_fits", query_id=head.query_id, group_size=head.group_size,
                           rollout_cells=pool, sessions_per_cell=per_cell, kv_tokens_per_cell=max(engines),
                           session_reserve_tokens=self.sched.session_reserve_tokens, fill=self.sched.fill)

    def _log_weight_wait(self, now_s: float) -> None:
        """Say once per pair of versions when queries wait for a rollout worker to load newer weights, and once
        per cell and version when a cell stuck behind stops holding them (its load does not finish)."""
        view = self.view
        held = view.held_for_weights(now_s)
        versions = (view.dispatch_version(now_s), view.policy_version)
        if held and versions != self._waiting_for:
            behind = {c.cell_id: c.served_version for c in view.cells.values()
                      if c.served_version is not None and c.served_version < view.published_version}
            self.log.info("dispatch_waits_for_weights", dispatch_version=versions[0], policy_version=versions[1],
                          published_version=view.published_version, queries_held=held, cells_behind=behind)
        self._waiting_for = versions if held else None
        for cell_id in view.stuck_cells(now_s):
            key = (cell_id, view.published_version)
            if key not in self._stuck_logged:
                self._stuck_logged.add(key)
                self.log.warning("weights_load_stuck", cell_id=cell_id, published_version=view.published_version,
                                 serves=view.cells[cell_id].served_version, waited_s=view.weights_wait_s,
                                 detail="dispatch no longer waits for this cell; its calls may be left out as stale")

    async def execute(self, snapshot: Snapshot, actions: list[Action]) -> list[Event]:
        """Turn a decision into events, in the decision's order."""
        emitted: list[Event] = []
        for action in actions:
            match action:
                case AssignCell(cell_id=cell_id, role=role):
                    event = self.event(
                        CellAssigned(cell_id=cell_id, role=role, policy=self.settings.mode,
                                     reason=_reason(snapshot, role)),
                        stream_id=stream_id_for("cell", cell_id),
                    )
                    await self.emit([event], expected_version="any")
                    emitted.append(event)
                    self.log.info("cell_assigned", cell_id=cell_id, role=role)
                case DispatchQuery(query_id=query_id, policy_version=version, placements=placements):
                    number = self.plan.number_of(query_id)
                    assert number is not None, f"the policy dispatched {query_id!r}, which the plan never queued"
                    data = self.plan.dispatch(number, policy_version=version, placements=placements)
                    event = self.event(data, stream_id=query_stream(query_id))
                    try:
                        await self.emit([event], expected_version=0)
                    except ConcurrencyConflict:
                        self.log.warning("query_already_dispatched", query_id=query_id)
                        continue
                    emitted.append(event)
                    self.log.info("query_dispatched", query_id=query_id, step=data.step, task_id=data.task_id,
                                  policy_version=version)
                case MigrateSession(execution_id=execution_id, from_cell=src, to_cell=dst):
                    # The source cell's worker moves it (its KV, else a recompute) and reports kv.migrated.
                    event = self.event(
                        KvMigrationOrdered(execution_id=execution_id, from_cell=src, to_cell=dst,
                                           policy=self.settings.mode, reason=_reason(snapshot, Role.ROLLOUT)),
                        stream_id=stream_id_for("cell", src),
                    )
                    await self.emit([event], expected_version="any")
                    emitted.append(event)
                    self.log.info("migration_ordered", execution_id=execution_id, from_cell=src, to_cell=dst)
                case DrainCell():
                    # A cell leaving rollout is drained by its cell agent (cell.draining), whose worker then
                    # moves every session left on it; a drain on its own orders nothing.
                    self.log.info("action_left_to_workers", action=repr(action))
        return emitted


def _reason(snapshot: Snapshot, role: Role) -> str:
    t = snapshot.trainer
    return (f"{role}: version {t.policy_version}/{t.steps_total}, batch complete {t.batch_complete}, "
            f"{len(snapshot.live)} live, {len(snapshot.queued)} queued")


def main() -> None:
    settings = load_settings()
    configure_logging(SchedulerService.name, run_id=settings.run_id)
    try:
        service = SchedulerService(settings)
    except (SchedulerConfigError, PlanError) as exc:
        raise SystemExit(f"scheduler: {exc}") from exc
    asyncio.run(service.run(freeze_heap=True))
