"""The fold of a run's events into the policies' `Snapshot`: cells and their roles, the live sessions, the
queries, the trainer's progress and the weights each rollout cell serves. Pure: no clock and no I/O; time
arrives as events' `occurred_at` and as `now_s`. The shell (service.py) tails the log and feeds it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from services.scheduler.plan import QueryPlan
from services.scheduler.policies import (
    CellState,
    CellView,
    FinishedExecution,
    QueuedQuery,
    Role,
    Snapshot,
    SwitchCosts,
    TrainerView,
    admitted_kv_tokens,
)
from services.scheduler.sessions import LiveSessions
from shared.events import (
    BatchReady,
    CallCompleted,
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReady,
    CellRegistered,
    CellReleased,
    Event,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
    KvMigrationOrdered,
    KvMigrationRefused,
    QueryDispatched,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
)

# Every event type the fold reads; the shell tails the log for these.
FOLDED_TYPES: tuple[str, ...] = (
    "cell.registered",
    "cell.assigned",
    "cell.draining",
    "cell.drained",
    "cell.released",
    "cell.ready",
    "kv.migrated",
    "kv.migration_ordered",
    "kv.migration_refused",
    "call.completed",
    "query.dispatched",
    "execution.started",
    "execution.finished",
    "execution.timed_out",
    "execution.scored",
    "batch.ready",
    "step.completed",
    "weights.published",
    "weights.loaded",
)


@dataclass(slots=True)
class _Cell:
    cell_id: str
    kv_tokens: int  # what the policies admit against: the smaller of the registered and the engine's
    registered_kv: int = 0  # cell.registered's capacity (0: none given)
    engine_kv: int = 0  # what its rollout worker's engine holds (weights.loaded; 0: not reported)
    role: Role = Role.IDLE
    state: CellState = CellState.ACTIVE
    role_since_s: float = 0.0
    leaving: Role | None = None  # the role a switch in progress started from (for measured switch costs)
    served_version: int | None = None  # the policy its rollout worker serves (cell.ready, weights.loaded)
    behind_since_s: float | None = None  # since when it serves an older version than the newest published


@dataclass(slots=True)
class _Query:
    query_id: str
    step: int
    group_size: int
    number: int | None  # position in the plan, None for a query the plan did not make
    ended: int = 0


@dataclass(slots=True)
class RunView:
    """Everything the scheduler knows about its run, built only from the run's events in log order.

    A cell ordered into a role (`cell.assigned`) shows that role at once, `switching`: the policies count it as
    coming (elastic's incoming rollout room, the size of the train pool) so that they do not order it, or another
    cell, again; it takes no session and counts for nothing served until its `cell.ready`. In between, its old
    role lets go (`cell.drained`, then `cell.released`: only from then may the new role's processes use it; on a
    warm cell the worker wakes, or the trainer lets the rank into its group, on that event).

    Sessions are counted live from the dispatch of their query (the harness announces them later) until
    they finish or time out; where each one is comes from the events that say so (`sessions.py`). A cell
    that leaves rollout is drained by its worker: its sessions show as leaving (migrating) until each one's
    `kv.migrated`, and those the worker keeps are parked there once `cell.drained` ends the drain.
    """

    plan: QueryPlan
    max_staleness: int
    session_reserve_tokens: int
    default_kv_tokens: int
    budget_cells: int = 0  # 0: every registered cell
    # The priors, until measured: switch times per direction, and (SwitchCosts' default) a migration rate in
    # KV tokens per second.
    switch_costs: SwitchCosts = field(default_factory=SwitchCosts)
    migration_timeout_s: float = 300.0  # an ordered move not reported done or refused by then is taken as not made
    # A rollout cell that has not loaded the newest published weights this long after their publication no
    # longer holds dispatch (its load is stuck; the run goes on, and the trajectory service drops what is stale).
    weights_wait_s: float = 300.0

    origin: datetime | None = None
    cells: dict[str, _Cell] = field(default_factory=dict)
    queries: dict[str, _Query] = field(default_factory=dict)
    sessions: LiveSessions = field(init=False)
    finished: dict[str, FinishedExecution] = field(default_factory=dict)
    dispatched_numbers: set[int] = field(default_factory=set)
    batch_tokens: dict[int, int] = field(default_factory=dict)  # step -> unique tokens of its batch
    rewards: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0
    published_version: int = -1  # the newest weights.published version
    tokens_per_cell_s: float = 0.0
    switch_samples: dict[Role, list[float]] = field(default_factory=dict)  # target role -> measured seconds
    migrated_tokens: float = 0.0  # over every kv.migrated: what the measured migration rate is made of
    migrated_s: float = 0.0
    # Prompt tokens targets took from moved KV rather than prefill again; moves that tried KV and recomputed.
    prefill_tokens_avoided: int = 0
    kv_fallbacks: int = 0
    # The trainer's wait for its batch (a train cell ready, the batch incomplete) and the executions that ended in
    # it: the peer policy's measured cost of a sample (TrainerView.sample_wait_s).
    wait_s: float = 0.0
    samples_waited: int = 0
    wait_mark_s: float | None = None  # while the trainer waits: when the wait was last counted up to
    seen: set[uuid.UUID] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sessions = LiveSessions(migration_timeout_s=self.migration_timeout_s)

    # ---- the fold ----

    def apply(self, event: Event) -> bool:
        """Fold one event; False for an event of another run, a type the fold ignores, or a duplicate."""
        if event.run_id != self.plan.run_id or event.event_id in self.seen:
            return False
        self.seen.add(event.event_id)
        if self.origin is None:
            self.origin = event.occurred_at
        at = self.seconds_at(event.occurred_at)
        if self.wait_mark_s is not None:
            self.wait_s += max(0.0, at - self.wait_mark_s)
        data = event.data
        folded = self._fold(data, at)
        self.wait_mark_s = at if self._trainer_waits() else None
        return folded

    def _trainer_waits(self) -> bool:
        ready = any(c.role is Role.TRAIN and c.state is CellState.ACTIVE for c in self.cells.values())
        return ready and not self.done and not self.batch_complete(self.policy_version)

    def _fold(self, data: object, at: float) -> bool:
        match data:
            case CellRegistered():
                self._registered(data)
            case CellAssigned():
                self._assigned(data)
            case CellDraining():
                cell = self._cell(data.cell_id)
                cell.leaving = Role(data.from_role)
                if cell.state is not CellState.SWITCHING:
                    cell.state = CellState.DRAINING
            case CellDrained():
                # The old role let go of the cell: a rollout worker ended its drain (every kv.migrated of it came
                # before), or the trainer let the cell's rank leave its group. The cell stays switching.
                self.sessions.drain_ended(data.cell_id)
            case CellReleased():
                # The old role holds nothing on the cell any more (without a cell.drained, the agent stopped the
                # process: a drain timeout, or it exited first). Its new role's processes take it from now, and it
                # serves that role once its cell.ready says so; until then it stays switching (see snapshot()).
                self.sessions.drain_ended(data.cell_id)
            case CellReady():
                cell = self._cell(data.cell_id)
                role = Role(data.role)
                if cell.leaving is not None and cell.leaving is not role and role is not Role.IDLE:
                    self.switch_samples.setdefault(role, []).append(data.switch_seconds)
                cell.role, cell.state, cell.role_since_s, cell.leaving = role, CellState.ACTIVE, at, None
                if role is Role.ROLLOUT:
                    # Max: the worker may have loaded newer weights (weights.loaded) after its agent read the
                    # version this event reports.
                    self._serves(cell, data.policy_version, at)
                else:
                    cell.served_version = cell.behind_since_s = None
            case KvMigrated():
                if data.method == "kv":
                    self.prefill_tokens_avoided += data.tokens
                self.kv_fallbacks += bool(data.fallback)
                if data.seconds > 0:
                    self.migrated_tokens += data.tokens
                    self.migrated_s += data.seconds
                self.sessions.migrated(data)
            case KvMigrationOrdered():
                self.sessions.ordered(data, at)
            case KvMigrationRefused():
                self.sessions.refused(data)
            case CallCompleted():
                served_by = self.cells.get(data.cell_id)
                self.sessions.served(data, by_rollout_cell=served_by is not None and served_by.role is Role.ROLLOUT)
            case QueryDispatched():
                self._dispatched(data)
            case ExecutionStarted():
                self.sessions.started(data)
            case ExecutionFinished() | ExecutionTimedOut():
                self._ended(data.execution_id)
            case ExecutionScored():
                self.rewards[data.execution_id] = data.reward
            case BatchReady():
                self.batch_tokens[data.step] = data.unique_tokens
            case StepCompleted():
                self.policy_version = max(self.policy_version, data.policy_version)
                tokens = self.batch_tokens.get(data.step, 0)
                if tokens and data.seconds > 0:
                    self.tokens_per_cell_s = tokens / (data.seconds * data.world_size)
            case WeightsPublished():
                self.policy_version = max(self.policy_version, data.version)
                if data.version > self.published_version:
                    self.published_version = data.version
                    for cell in self.cells.values():
                        self._serves(cell, None, at)
            case WeightsLoaded():
                cell = self._cell(data.cell_id)
                if data.kv_capacity_tokens:
                    cell.engine_kv = data.kv_capacity_tokens
                    cell.kv_tokens = self._capacity(cell)
                # A rollout worker standing by on a train cell serves nothing; from its cell's order into rollout
                # on (its wake, after cell.released), what it loaded is what the cell serves.
                if cell.role is Role.ROLLOUT:
                    self._serves(cell, data.version, at)
            case _:
                return False  # anything else changes nothing the policies see
        return True

    def _capacity(self, cell: _Cell) -> int:
        return admitted_kv_tokens(cell.registered_kv, cell.engine_kv, self.default_kv_tokens)

    def _registered(self, data: CellRegistered) -> None:
        cell = self.cells.get(data.cell_id)
        if cell is None:
            cell = self.cells[data.cell_id] = _Cell(data.cell_id, 0, registered_kv=data.kv_capacity_tokens)
            cell.kv_tokens = self._capacity(cell)
            return
        cell.registered_kv = data.kv_capacity_tokens
        cell.kv_tokens = self._capacity(cell)
        # A cell agent that registers again has restarted: it brings the cell back into its last
        # assigned role and says so with cell.ready; until then the cell is between roles. Its processes
        # died with it, so a drain it was waiting for is over.
        cell.state = CellState.ACTIVE if cell.role is Role.IDLE else CellState.SWITCHING
        self.sessions.drain_ended(data.cell_id)

    def _assigned(self, data: CellAssigned) -> None:
        cell = self._cell(data.cell_id)
        role = Role(data.role)
        if role is cell.role:
            if cell.state is CellState.DRAINING:
                cell.state = CellState.ACTIVE
            return
        was_rollout = cell.role is Role.ROLLOUT
        cell.role, cell.state = role, CellState.SWITCHING
        cell.served_version = cell.behind_since_s = None  # whatever served there is leaving
        if was_rollout:
            self.sessions.leave(cell.cell_id)
        elif role is Role.ROLLOUT:
            self.sessions.drain_ended(cell.cell_id)  # sessions parked on it are served there again

    def _cell(self, cell_id: str) -> _Cell:
        # An order or report about a cell whose registration this run has not seen still names a cell.
        if cell_id not in self.cells:
            self.cells[cell_id] = _Cell(cell_id, self.default_kv_tokens)
        return self.cells[cell_id]

    def _dispatched(self, data: QueryDispatched) -> None:
        if data.query_id in self.queries:
            return
        number = self.plan.number_of(data.query_id)
        self.queries[data.query_id] = _Query(data.query_id, data.step, data.group_size, number)
        if number is not None:
            self.dispatched_numbers.add(number)
        self.sessions.dispatched(data)

    def _serves(self, cell: _Cell, version: int | None, at: float) -> None:
        """Fold a report that `cell` serves `version` (None: only the newest publication changed). A version
        never goes back (a late report of an older load), and a cell behind the newest publication is timed."""
        if version is not None:
            cell.served_version = version if cell.served_version is None else max(cell.served_version, version)
        if cell.served_version is None or cell.served_version >= self.published_version:
            cell.behind_since_s = None
        elif cell.behind_since_s is None:
            cell.behind_since_s = at

    def _ended(self, execution_id: str) -> None:
        session = self.sessions.ended(execution_id)
        if session is None:
            return  # not a session of this run's queries, or already ended
        self.queries[session.query_id].ended += 1
        if session.step == self.policy_version and self.wait_mark_s is not None:
            self.samples_waited += 1
        self.finished[execution_id] = FinishedExecution(execution_id, session.query_id, session.step, 0)

    # ---- reading ----

    def seconds_at(self, when: datetime) -> float:
        """Seconds from the run's first event to `when` (the snapshot's time axis)."""
        return 0.0 if self.origin is None else max(0.0, (when - self.origin).total_seconds())

    @property
    def done(self) -> bool:
        """The trainer has completed every planned step."""
        return self.policy_version >= self.plan.total_steps

    def batch_complete(self, step: int) -> bool:
        """Every planned query of `step` was dispatched and all its executions ended (or its batch is built).

        A forecast of the trajectory service's `batch.ready`, made from folded facts (dispatches and execution
        ends) rather than from a rule copied out of that service: the policies must know a batch is complete
        before its tree is built and packed (elastic turns cells to training then, colocate switches its pool),
        and once `batch.ready` is in the log that event decides."""
        if step in self.batch_tokens:
            return True
        of_step = [q for q in self.queries.values() if q.number is not None and q.step == step]
        return len(of_step) == self.plan.queries_per_step and all(q.ended >= q.group_size for q in of_step)

    def _stuck(self, cell: _Cell, now_s: float | None) -> bool:
        return (cell.behind_since_s is not None and now_s is not None
                and now_s - cell.behind_since_s >= self.weights_wait_s)

    def stuck_cells(self, now_s: float) -> list[str]:
        """Active rollout cells behind the newest publication for `weights_wait_s` or longer."""
        return sorted(c.cell_id for c in self.cells.values()
                      if c.role is Role.ROLLOUT and c.state is CellState.ACTIVE and self._stuck(c, now_s))

    def weights_lag(self, now_s: float | None = None) -> int:
        """How many published versions the furthest-behind active rollout cell has still to load.

        Workers load new weights after `weights.published`; until one has, calls it serves are generated by an
        older policy than the trainer's version says. Only *published* versions count: with the trainer's
        `publish_every` above 1 the workers cannot serve the versions in between, and waiting for them would
        wait for ever. Cells whose worker never said what it serves, and (given `now_s`) cells stuck behind for
        `weights_wait_s`, do not count."""
        lags = [
            self.published_version - c.served_version for c in self.cells.values()
            if c.role is Role.ROLLOUT and c.state is CellState.ACTIVE and c.served_version is not None
            and not self._stuck(c, now_s)
        ]
        return max([0, *lags])

    def dispatch_version(self, now_s: float | None = None) -> int:
        """The version the staleness bound counts from: the trainer's, less the weights the rollout cells have
        still to load (a query for step s starts only while s <= this + max_staleness)."""
        return max(0, self.policy_version - self.weights_lag(now_s))

    def queued(self, now_s: float | None = None) -> list[int]:
        """Query numbers not yet dispatched, in order, as far as the staleness bound could reach now (counted
        from `dispatch_version`, so no query starts on a worker still serving weights older than the bound)."""
        horizon = min(
            self.plan.total_queries,
            (self.dispatch_version(now_s) + self.max_staleness + 1) * self.plan.queries_per_step,
        )
        return [n for n in range(horizon) if n not in self.dispatched_numbers]

    def held_for_weights(self, now_s: float | None = None) -> int:
        """Queries the trainer's version would let start that wait for a rollout worker to load newer weights."""
        start = self.dispatch_version(now_s)
        if start >= self.policy_version:
            return 0
        k, b = self.max_staleness, self.plan.queries_per_step
        upto = min(self.plan.total_queries, (self.policy_version + k + 1) * b)
        return sum(1 for n in range((start + k + 1) * b, upto) if n not in self.dispatched_numbers)

    def measured_switch_costs(self) -> SwitchCosts:
        """The configured costs, replaced by what was measured where there is a measurement: the mean switch
        per direction, and the tokens per second of every migration so far."""
        def mean(role: Role, default: float) -> float:
            samples = self.switch_samples.get(role)
            return sum(samples) / len(samples) if samples else default

        return SwitchCosts(
            to_train_s=mean(Role.TRAIN, self.switch_costs.to_train_s),
            to_rollout_s=mean(Role.ROLLOUT, self.switch_costs.to_rollout_s),
            migration_tokens_per_s=(self.migrated_tokens / self.migrated_s if self.migrated_tokens > 0
                                    else self.switch_costs.migration_tokens_per_s),
            prefill_tokens_per_s=self.switch_costs.prefill_tokens_per_s,
        )

    def snapshot(self, now_s: float) -> Snapshot:
        version = self.policy_version
        cells = tuple(
            CellView(c.cell_id, c.role, c.state, c.kv_tokens, c.role_since_s)
            for c in sorted(self.cells.values(), key=lambda c: c.cell_id)
        )
        finished = tuple(f for _, f in sorted(self.finished.items()) if f.batch >= version)
        backlog = sum(tokens for step, tokens in self.batch_tokens.items() if step >= version)
        trainer = TrainerView(
            policy_version=version,
            backlog_tokens=backlog,
            batch_complete=self.batch_complete(version),
            steps_total=self.plan.total_steps,
            tokens_per_cell_s=self.tokens_per_cell_s,
            sample_wait_s=self.wait_s / self.samples_waited if self.samples_waited else 0.0,
        )
        return Snapshot(
            now_s=now_s,
            cells=cells,
            live=self.sessions.live(now_s),
            queued=tuple(QueuedQuery(self.plan.query_id(n), self.plan.group_size) for n in self.queued(now_s)),
            finished_untrained=finished,
            trainer=trainer,
            max_staleness=self.max_staleness,
            budget_cells=self.budget_cells or len(cells),
            batch_queries=self.plan.queries_per_step,
            queries_dispatched=len(self.dispatched_numbers),
            session_kv_reserve_tokens=self.session_reserve_tokens,
            switch_costs=self.measured_switch_costs(),
        )
