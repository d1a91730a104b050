"""The live scheduler's pure core: the run's query plan, and the fold of the run's events into the
policies' `Snapshot`. No clock and no I/O: time arrives as events' `occurred_at` and as `now_s`.
"""

from __future__ import annotations

import hashlib
import random
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from services.scheduler.policies import (
    CellState,
    CellView,
    FinishedExecution,
    LiveExecution,
    QueuedQuery,
    Role,
    Snapshot,
    SwitchCosts,
    TrainerView,
)
from shared.events import (
    BatchReady,
    CallCompleted,
    CellAssigned,
    CellDraining,
    CellReady,
    CellRegistered,
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

TaskOrder = Literal["round_robin", "seeded"]

# The live side counts KV in tokens, so a migration's rate is in tokens per second: measured from `kv.migrated`
# once a session has moved; before that, about what one 12k-token move took here (docs/rollout.md, "Benchmark").
LIVE_MIGRATION_TOKENS_PER_S = 10_000.0


class PlanError(ValueError):
    """The query plan was configured with values it cannot work with."""


def derive_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed from the run seed and a path of integers; stable across processes and Python versions."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """Which queries a run trains on: `queries_per_step` queries feed each of `total_steps` steps.

    Query number n feeds step n // queries_per_step. Its id, task and seeds are functions of
    (run, step, index) and the run seed, so a restarted scheduler names the same queries again.
    Seeds do not depend on the run id: runs in different modes with one seed see the same samples.
    """

    run_id: str
    task_ids: tuple[str, ...]
    queries_per_step: int
    total_steps: int
    group_size: int
    seed: int = 0
    task_order: TaskOrder = "round_robin"
    harness: str = "builtin"

    def __post_init__(self) -> None:
        if not self.task_ids:
            raise PlanError("expected at least one task id to train on, got none")
        if self.queries_per_step < 1 or self.total_steps < 0 or self.group_size < 1:
            raise PlanError(
                f"expected queries_per_step >= 1, total_steps >= 0 and group_size >= 1, got "
                f"{self.queries_per_step}, {self.total_steps} and {self.group_size}"
            )

    @property
    def total_queries(self) -> int:
        return self.total_steps * self.queries_per_step

    def slot(self, n: int) -> tuple[int, int]:
        """(step, index within the step) of query number n."""
        return divmod(n, self.queries_per_step)

    def query_id(self, n: int) -> str:
        step, index = self.slot(n)
        return f"{self.run_id}-step{step}-q{index}"

    def number_of(self, query_id: str) -> int | None:
        """The query number a planned query id names, or None for a query this plan did not make."""
        match = re.fullmatch(re.escape(self.run_id) + r"-step(\d+)-q(\d+)", query_id)
        if match is None:
            return None
        step, index = int(match.group(1)), int(match.group(2))
        if index >= self.queries_per_step:
            return None
        return step * self.queries_per_step + index

    def task_for(self, n: int) -> str:
        match self.task_order:
            case "round_robin":
                return self.task_ids[n % len(self.task_ids)]
            case "seeded":
                return random.Random(derive_seed(self.seed, n, -1)).choice(self.task_ids)
            case _:
                raise PlanError(f"expected task_order round_robin or seeded, got {self.task_order!r}")

    def seeds_for(self, n: int) -> list[int]:
        step, index = self.slot(n)
        return [derive_seed(self.seed, step, index, sample) for sample in range(self.group_size)]

    def dispatch(self, n: int, *, policy_version: int, placements: tuple[str, ...] = ()) -> QueryDispatched:
        if not 0 <= n < self.total_queries:
            raise PlanError(f"expected a query number in [0, {self.total_queries}), got {n}")
        step, _ = self.slot(n)
        return QueryDispatched(
            query_id=self.query_id(n),
            task_id=self.task_for(n),
            group_size=self.group_size,
            seeds=self.seeds_for(n),
            step=step,
            policy_version=policy_version,
            harness=self.harness,
            placements=list(placements),
            step_queries=self.queries_per_step,
        )


def query_stream(query_id: str) -> str:
    """One stream per query: appending its dispatch at expected version 0 makes a second dispatch impossible."""
    return f"query-{query_id}"


@dataclass(slots=True)
class _Cell:
    cell_id: str
    kv_tokens: int
    role: Role = Role.IDLE
    state: CellState = CellState.ACTIVE
    role_since_s: float = 0.0
    leaving: Role | None = None  # the role a switch in progress started from (for measured switch costs)
    served_version: int | None = None  # the policy its rollout worker serves (cell.ready, weights.loaded)
    behind_since_s: float | None = None  # since when it serves an older version than the newest published


@dataclass(slots=True)
class _Session:
    execution_id: str
    query_id: str
    cell_id: str  # where it was last known to be: its placement, the cell serving its calls, its last migration
    step: int
    dispatch_version: int
    # Per chain, the latest call's (index, prompt + completion tokens): the KV its worker holds for that chain.
    chain_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    moving_to: str | None = None  # a scheduler-ordered move not yet seen done
    ordered_at_s: float = 0.0
    last_call_index: int = -1
    # The cell its last migration left, and the last call index a record from there can be a late one for
    # (a call in flight when it moved, at most one per chain): such a record changes its context, not its cell.
    left_cell: str | None = None
    left_until: int = -1

    def context_tokens(self) -> int:
        return sum(tokens for _, tokens in self.chain_tokens.values())


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

    Sessions are counted live from the dispatch of their query (the harness announces them later) until
    they finish or time out. A session's cell is where the policy placed it (the dispatch's `placements`,
    which the router follows while that cell takes sessions), then where its calls are served
    (`call.completed`) and where it migrates (`kv.migrated`). A dispatch without placements is spread
    over the cells taking sessions, least loaded first, as the router does. A session's context (and KV,
    counted in tokens) is the sum over its chains of the latest call's prompt and completion. A move the
    scheduler ordered (`kv.migration_ordered`) shows the session migrating onto its target until the
    worker reports it moved, or for `migration_timeout_s` (a worker that could not move it keeps it).
    """

    plan: QueryPlan
    max_staleness: int
    session_reserve_tokens: int
    default_kv_tokens: int
    budget_cells: int = 0  # 0: every registered cell
    switch_costs: SwitchCosts = field(
        default_factory=lambda: SwitchCosts(migration_bytes_per_s=LIVE_MIGRATION_TOKENS_PER_S)
    )
    migration_timeout_s: float = 300.0  # an ordered move not reported done or refused by then is taken as not made
    # A rollout cell that has not loaded the newest published weights this long after their publication no
    # longer holds dispatch (its load is stuck; the run goes on, and the trajectory service drops what is stale).
    weights_wait_s: float = 300.0

    origin: datetime | None = None
    cells: dict[str, _Cell] = field(default_factory=dict)
    queries: dict[str, _Query] = field(default_factory=dict)
    sessions: dict[tuple[str, int], _Session] = field(default_factory=dict)
    session_of: dict[str, tuple[str, int]] = field(default_factory=dict)  # execution id -> session key
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
    seen: set[uuid.UUID] = field(default_factory=set)

    # ---- the fold ----

    def apply(self, event: Event) -> bool:
        """Fold one event; False for an event of another run, a type the fold ignores, or a duplicate."""
        if event.run_id != self.plan.run_id or event.event_id in self.seen:
            return False
        self.seen.add(event.event_id)
        if self.origin is None:
            self.origin = event.occurred_at
        at = self.seconds_at(event.occurred_at)
        data = event.data
        match data:
            case CellRegistered():
                self._registered(data)
            case CellAssigned():
                cell = self._cell(data.cell_id)
                role = Role(data.role)
                if role is not cell.role:
                    cell.role, cell.state = role, CellState.SWITCHING
                    cell.served_version = cell.behind_since_s = None  # whatever served there is leaving
                    if role is not Role.ROLLOUT:
                        self._move_sessions_off(cell.cell_id, at)
                elif cell.state is CellState.DRAINING:
                    cell.state = CellState.ACTIVE
            case CellDraining():
                cell = self._cell(data.cell_id)
                cell.leaving = Role(data.from_role)
                if cell.state is not CellState.SWITCHING:
                    cell.state = CellState.DRAINING
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
                self._migrated(data)
            case KvMigrationOrdered():
                if (session := self._session(data.execution_id)) is not None:
                    session.moving_to, session.ordered_at_s = data.to_cell, at
            case KvMigrationRefused():
                session = self._session(data.execution_id)
                if session is not None and session.moving_to == data.to_cell:
                    session.moving_to = None
            case CallCompleted():
                self._served(data)
            case QueryDispatched():
                self._dispatched(data)
            case ExecutionStarted():
                self._started(data)
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
                self._serves(self._cell(data.cell_id), data.version, at)
            case _:
                return False  # cell.released and anything else change nothing the policies see
        return True

    def _registered(self, data: CellRegistered) -> None:
        kv = data.kv_capacity_tokens or self.default_kv_tokens
        cell = self.cells.get(data.cell_id)
        if cell is None:
            self.cells[data.cell_id] = _Cell(data.cell_id, kv)
            return
        cell.kv_tokens = kv
        # A cell agent that registers again has restarted: it brings the cell back into its last
        # assigned role and says so with cell.ready; until then the cell is between roles.
        cell.state = CellState.ACTIVE if cell.role is Role.IDLE else CellState.SWITCHING

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
        taking = [c.cell_id for c in self.cells.values() if c.role is Role.ROLLOUT and c.state is CellState.ACTIVE]
        load = dict.fromkeys(taking or [c.cell_id for c in self.cells.values() if c.role is Role.ROLLOUT], 0)
        if not load:
            load = {c: 0 for c in self.cells} or {"": 0}
        for s in self.sessions.values():
            if s.cell_id in load:
                load[s.cell_id] += 1
        placed = data.placements if len(data.placements) == data.group_size else None
        for sample in range(data.group_size):
            if placed is not None:
                cell_id = placed[sample]
            else:
                cell_id = min(load, key=lambda c: (load[c], c))
                load[cell_id] += 1
            # The harness names executions `<query>-s<i>`; execution.started confirms the real id.
            execution_id = f"{data.query_id}-s{sample}"
            self.sessions[(data.query_id, sample)] = _Session(
                execution_id, data.query_id, cell_id, data.step, data.policy_version
            )
            self.session_of[execution_id] = (data.query_id, sample)

    def _serves(self, cell: _Cell, version: int | None, at: float) -> None:
        """Fold a report that `cell` serves `version` (None: only the newest publication changed). A version
        never goes back (a late report of an older load), and a cell behind the newest publication is timed."""
        if version is not None:
            cell.served_version = version if cell.served_version is None else max(cell.served_version, version)
        if cell.served_version is None or cell.served_version >= self.published_version:
            cell.behind_since_s = None
        elif cell.behind_since_s is None:
            cell.behind_since_s = at

    def _session(self, execution_id: str) -> _Session | None:
        key = self.session_of.get(execution_id)
        return None if key is None else self.sessions[key]

    def _migrated(self, data: KvMigrated) -> None:
        if data.seconds > 0:
            self.migrated_tokens += data.tokens
            self.migrated_s += data.seconds
        session = self._session(data.execution_id)
        if session is None or not data.to_cell:
            return
        session.cell_id, session.moving_to = data.to_cell, None
        session.left_cell = data.from_cell
        session.left_until = session.last_call_index + max(1, len(session.chain_tokens))

    def _served(self, data: CallCompleted) -> None:
        session = self._session(data.execution_id)
        if session is None:
            return
        latest = session.chain_tokens.get(data.chain_id)
        if latest is None or data.call_index >= latest[0]:
            session.chain_tokens[data.chain_id] = (data.call_index, data.prompt_tokens + data.completion_tokens)
        session.last_call_index = max(session.last_call_index, data.call_index)
        # Recorded by the gateway, while kv.migrated comes from the worker: the last call a cell served can land
        # after the session moved off it. A cell that left rollout holds none.
        served_by = self.cells.get(data.cell_id)
        if served_by is None or served_by.role is not Role.ROLLOUT:
            return
        if data.cell_id == session.left_cell and data.call_index <= session.left_until:
            return
        session.cell_id, session.left_cell = data.cell_id, None
        if session.moving_to == data.cell_id:
            session.moving_to = None

    def _move_sessions_off(self, cell_id: str, at: float) -> None:
        """A cell leaving rollout: its worker migrates its sessions to the least loaded other rollout
        cells (mirrored here), or, with none left (a colocate pool turning to training), they stay parked.
        A move ordered onto it will not happen (its worker refuses while draining); one ordered off it
        to a cell still in rollout, and not lapsed, is where the session goes, still migrating."""
        for s in self.sessions.values():
            if s.moving_to == cell_id:
                s.moving_to = None
        rollout = [c for c in self.cells.values() if c.role is Role.ROLLOUT and c.cell_id != cell_id]
        # The worker moves them to workers already serving; a cell still switching in has none yet.
        others = [c.cell_id for c in rollout if c.state is CellState.ACTIVE] or [c.cell_id for c in rollout]
        if not others:
            return
        load = {c: 0 for c in others}
        for s in self.sessions.values():
            if s.cell_id in load:
                load[s.cell_id] += 1
        for key in sorted(k for k, s in self.sessions.items() if s.cell_id == cell_id):
            session = self.sessions[key]
            pending = session.moving_to in load and at - session.ordered_at_s < self.migration_timeout_s
            if not pending:
                session.moving_to = None
            target = session.moving_to or min(load, key=lambda c: (load[c], c))
            session.cell_id, session.left_cell = target, None
            load[target] += 1

    def _started(self, data: ExecutionStarted) -> None:
        key = (data.query_id, data.sample_index)
        session = self.sessions.get(key)
        if session is None or session.execution_id == data.execution_id:
            return
        self.session_of.pop(session.execution_id, None)
        session.execution_id = data.execution_id
        self.session_of[data.execution_id] = key

    def _ended(self, execution_id: str) -> None:
        key = self.session_of.pop(execution_id, None)
        if key is None:
            return  # not a session of this run's queries, or already ended
        session = self.sessions.pop(key)
        self.queries[session.query_id].ended += 1
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
        """Every planned query of `step` was dispatched and all its executions ended (or its batch is built)."""
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
            migration_bytes_per_s=(self.migrated_tokens / self.migrated_s if self.migrated_tokens > 0
                                   else self.switch_costs.migration_bytes_per_s),
        )

    def _live(self, s: _Session, now_s: float) -> LiveExecution:
        moving = s.moving_to is not None and now_s - s.ordered_at_s < self.migration_timeout_s
        context = s.context_tokens()
        # KV is counted in tokens on the live side (cells register their capacity in tokens).
        return LiveExecution(s.execution_id, s.query_id, s.moving_to if moving and s.moving_to else s.cell_id,
                             context, context, s.dispatch_version, s.step, moving)

    def snapshot(self, now_s: float) -> Snapshot:
        version = self.policy_version
        reserve = self.session_reserve_tokens
        cells = tuple(
            CellView(c.cell_id, c.role, c.state, c.kv_tokens, c.role_since_s)
            for c in sorted(self.cells.values(), key=lambda c: c.cell_id)
        )
        live = tuple(self._live(s, now_s) for s in sorted(self.sessions.values(), key=lambda s: s.execution_id))
        finished = tuple(f for _, f in sorted(self.finished.items()) if f.batch >= version)
        backlog = sum(tokens for step, tokens in self.batch_tokens.items() if step >= version)
        trainer = TrainerView(
            policy_version=version,
            backlog_tokens=backlog,
            batch_complete=self.batch_complete(version),
            steps_total=self.plan.total_steps,
            tokens_per_cell_s=self.tokens_per_cell_s,
        )
        return Snapshot(
            now_s=now_s,
            cells=cells,
            live=live,
            queued=tuple(QueuedQuery(self.plan.query_id(n), self.plan.group_size) for n in self.queued(now_s)),
            finished_untrained=finished,
            trainer=trainer,
            max_staleness=self.max_staleness,
            budget_cells=self.budget_cells or len(cells),
            batch_queries=self.plan.queries_per_step,
            queries_dispatched=len(self.dispatched_numbers),
            session_kv_reserve_bytes=reserve,
            switch_costs=self.measured_switch_costs(),
        )
