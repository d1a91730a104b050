"""Where each live session of a run is and how much KV it holds there, folded from the events that say so.

Pure: no clock and no I/O. `RunView` (run_view.py) feeds it the session events in log order and reads the
sessions out as the policies' `LiveExecution`s. Nothing here predicts another service's choice: a session is
where the policy placed it, then where a worker or the gateway reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.policies import LiveExecution
from shared.events import (
    CallCompleted,
    ExecutionStarted,
    KvMigrated,
    KvMigrationOrdered,
    KvMigrationRefused,
    QueryDispatched,
    execution_id_for,
)


@dataclass(slots=True)
class Session:
    """One live execution of a dispatched query."""

    execution_id: str
    query_id: str
    step: int
    dispatch_version: int
    # Where it was last known to be: its placement, the cell serving its calls, its last migration. None: not
    # placed yet (a dispatch without placements, until its first call says where it runs).
    cell_id: str | None
    # Per chain, the latest call's (index, prompt + completion tokens): the KV its worker holds for that chain.
    chain_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    moving_to: str | None = None  # a scheduler-ordered move not yet seen done
    ordered_at_s: float = 0.0
    # Its cell left rollout and the drain there has not ended: its worker is moving it somewhere (its own
    # choice, reported by kv.migrated) or will keep it parked (reported by cell.drained).
    leaving: bool = False
    last_call_index: int = -1
    # The cell its last migration left, and the last call index a record from there can be a late one for
    # (a call in flight when it moved, at most one per chain): such a record changes its context, not its cell.
    left_cell: str | None = None
    left_until: int = -1
    # A move the worker refused (it held no session of the execution yet, say: placed, no call made) is not
    # ordered again until the session's next call: the policies see it as migrating (not movable) until then.
    refused_at_call: int | None = None

    def context_tokens(self) -> int:
        return sum(tokens for _, tokens in self.chain_tokens.values())


@dataclass(slots=True)
class LiveSessions:
    """The run's live sessions, keyed by (query id, sample index) from their query's dispatch until they end.

    A session is named by `shared.events.execution_id_for` from its dispatch on (the harness names executions
    by the same rule; `execution.started` confirms the id). A move the scheduler ordered
    (`kv.migration_ordered`) shows the session migrating onto its target until the worker reports it moved
    (`kv.migrated`) or refused (`kv.migration_refused`), or for `migration_timeout_s`. A refused session stays
    where it is, shown migrating (not to be moved) until its next call: the worker refused for a reason that
    holds until then (most often it had no session of the execution yet), and ordering it again every tick
    only repeats the refusal.
    """

    migration_timeout_s: float = 300.0
    by_key: dict[tuple[str, int], Session] = field(default_factory=dict)
    key_of: dict[str, tuple[str, int]] = field(default_factory=dict)  # execution id -> session key

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, execution_id: str) -> Session | None:
        key = self.key_of.get(execution_id)
        return None if key is None else self.by_key[key]

    # ---- the fold ----

    def dispatched(self, data: QueryDispatched) -> None:
        """A query's group starts: each sample on the cell the policy placed it on. The router follows the
        placement while that cell takes sessions, and `call.completed` says otherwise if it did not."""
        placed = data.placements if len(data.placements) == data.group_size else None
        for sample in range(data.group_size):
            execution_id = execution_id_for(data.query_id, sample)
            cell_id = placed[sample] if placed is not None else None
            self.by_key[(data.query_id, sample)] = Session(
                execution_id, data.query_id, data.step, data.policy_version, cell_id
            )
            self.key_of[execution_id] = (data.query_id, sample)

    def started(self, data: ExecutionStarted) -> None:
        """The harness's id for a sample is the one that counts (it follows the same rule, so this is a no-op
        unless the rule changed between the dispatch and the start)."""
        key = (data.query_id, data.sample_index)
        session = self.by_key.get(key)
        if session is None or session.execution_id == data.execution_id:
            return
        self.key_of.pop(session.execution_id, None)
        session.execution_id = data.execution_id
        self.key_of[data.execution_id] = key

    def ended(self, execution_id: str) -> Session | None:
        """The execution finished or timed out: the session leaves the view (None if it was not live)."""
        key = self.key_of.pop(execution_id, None)
        return None if key is None else self.by_key.pop(key)

    def served(self, data: CallCompleted, *, by_rollout_cell: bool) -> None:
        """A call of the session completed on `data.cell_id`: its context, and where it runs now."""
        session = self.get(data.execution_id)
        if session is None:
            return
        latest = session.chain_tokens.get(data.chain_id)
        if latest is None or data.call_index >= latest[0]:
            session.chain_tokens[data.chain_id] = (data.call_index, data.prompt_tokens + data.completion_tokens)
        session.last_call_index = max(session.last_call_index, data.call_index)
        if session.refused_at_call is not None and data.call_index > session.refused_at_call:
            session.refused_at_call = None
        # Recorded by the gateway, while kv.migrated comes from the worker: the last call a cell served can land
        # after the session moved off it. A cell that left rollout holds none.
        if not by_rollout_cell:
            return
        if data.cell_id == session.left_cell and data.call_index <= session.left_until:
            return
        session.cell_id, session.left_cell, session.leaving = data.cell_id, None, False
        if session.moving_to == data.cell_id:
            session.moving_to = None

    def ordered(self, data: KvMigrationOrdered, at: float) -> None:
        if (session := self.get(data.execution_id)) is not None:
            session.moving_to, session.ordered_at_s = data.to_cell, at

    def refused(self, data: KvMigrationRefused) -> None:
        session = self.get(data.execution_id)
        if session is not None and session.moving_to == data.to_cell:
            session.moving_to = None
            session.refused_at_call = session.last_call_index

    def migrated(self, data: KvMigrated) -> None:
        """The worker moved the session (an ordered move, or a drain's own choice of target)."""
        session = self.get(data.execution_id)
        if session is None or not data.to_cell:
            return
        session.cell_id, session.moving_to, session.leaving = data.to_cell, None, False
        session.left_cell = data.from_cell
        session.left_until = session.last_call_index + max(1, len(session.chain_tokens))

    def leave(self, cell_id: str) -> None:
        """`cell_id` left rollout (`cell.assigned`): its worker drains it. A move ordered onto it will not
        happen (its worker refuses while draining); its own sessions are leaving until the worker reports
        each move (`kv.migrated`) or the end of the drain. A move ordered off it, not lapsed, still shows the
        session migrating to that target (the worker carries out orders it has taken)."""
        for session in self.by_key.values():
            if session.moving_to == cell_id:
                session.moving_to = None
            if session.cell_id == cell_id:
                session.leaving = True

    def drain_ended(self, cell_id: str) -> None:
        """The drain of `cell_id` is over (`cell.drained`; or `cell.released`, the worker stopped; or the cell's
        agent restarted, its processes with it): every `kv.migrated` of the drain came before, so the sessions
        still leaving it stay parked there (colocate's parking, or moves that failed)."""
        for session in self.by_key.values():
            if session.cell_id == cell_id and session.leaving:
                session.leaving, session.moving_to = False, None

    # ---- reading ----

    def live(self, now_s: float) -> tuple[LiveExecution, ...]:
        """The placed sessions as the policies see them, by execution id. A session not placed yet is on no
        cell and holds no KV anywhere: it is left out until its first call places it."""
        views = []
        for s in sorted(self.by_key.values(), key=lambda s: s.execution_id):
            if s.cell_id is None:
                continue
            ordered = s.moving_to is not None and now_s - s.ordered_at_s < self.migration_timeout_s
            cell_id = s.moving_to if ordered and s.moving_to is not None else s.cell_id
            context = s.context_tokens()
            # The KV a worker holds for a session is its context: every chain's latest prompt and completion.
            views.append(LiveExecution(s.execution_id, s.query_id, cell_id, context, context, s.dispatch_version,
                                       s.step, ordered or s.leaving or s.refused_at_call is not None))
        return tuple(views)

    def unplaced(self) -> int:
        """Sessions no event has placed on a cell yet."""
        return sum(1 for s in self.by_key.values() if s.cell_id is None)
