"""Hypothesis strategies for random but internally consistent scheduler snapshots."""

from __future__ import annotations

from hypothesis import strategies as st

from services.scheduler.policies import (
    CellState,
    CellView,
    LiveExecution,
    QueuedQuery,
    Role,
    Snapshot,
    TrainerView,
)

RESERVE = 1_000  # bytes an average session reserves; capacities are drawn in multiples of it


@st.composite
def snapshots(draw: st.DrawFn, *, parked: bool = False) -> Snapshot:
    """A snapshot a live scheduler could observe: sessions only on rollout cells (or parked on train
    cells when `parked`), at most `budget` cells holding a role, dispatch counts consistent with the
    trainer's version."""
    n_cells = draw(st.integers(1, 10))
    budget = draw(st.integers(1, n_cells))
    now = draw(st.floats(0, 10_000))
    # Any `budget` cells may hold roles, not only the first by id: a cell that registered late can sort first.
    holders = set(draw(st.permutations(range(n_cells)))[:budget])
    cells = []
    for i in range(n_cells):
        if i in holders:
            role = draw(st.sampled_from([Role.ROLLOUT, Role.TRAIN, Role.IDLE]))
        else:
            role = Role.IDLE
        if role is Role.ROLLOUT:
            state = draw(st.sampled_from([CellState.ACTIVE, CellState.ACTIVE, CellState.SWITCHING, CellState.DRAINING]))
        elif role is Role.TRAIN:
            state = draw(st.sampled_from([CellState.ACTIVE, CellState.ACTIVE, CellState.SWITCHING]))
        else:
            state = CellState.ACTIVE
        cap = RESERVE * draw(st.integers(1, 8))
        since = draw(st.floats(0, now))
        cells.append(CellView(f"c{i:02d}", role, state, cap, since))
    group = draw(st.integers(1, 4))
    batch_q = draw(st.integers(1, 3))
    k = draw(st.integers(0, 3))
    version = draw(st.integers(0, 4))
    steps_total = version + draw(st.integers(1, 5))
    dispatched = draw(st.integers(version * batch_q, (version + k + 1) * batch_q + 2))
    hosts = [c for c in cells if c.role is Role.ROLLOUT and c.state is not CellState.SWITCHING]
    if parked:
        hosts += [c for c in cells if c.role is Role.TRAIN]
    live = []
    if hosts:
        for j in range(draw(st.integers(0, 14))):
            host = draw(st.sampled_from(hosts))
            kv = draw(st.integers(0, 2 * RESERVE))
            batch = draw(st.integers(version, max(version, (dispatched - 1) // batch_q)))
            live.append(
                LiveExecution(
                    execution_id=f"e{j}",
                    query_id=f"old{j}",
                    cell_id=host.cell_id,
                    context_tokens=kv,
                    kv_tokens=kv,
                    dispatch_version=max(0, batch - k),
                    batch=batch,
                    migrating=draw(st.booleans()) and draw(st.booleans()),
                )
            )
    queued = tuple(QueuedQuery(f"q{dispatched + i}", group) for i in range(draw(st.integers(0, 6))))
    trainer = TrainerView(
        policy_version=version,
        backlog_tokens=draw(st.sampled_from([0, 0, 1, 5_000, 2_000_000])),
        batch_complete=draw(st.booleans()),
        steps_total=steps_total,
        tokens_per_cell_s=draw(st.sampled_from([0.0, 100.0, 5_000.0])),
    )
    return Snapshot(
        now_s=now,
        cells=tuple(cells),
        live=tuple(live),
        queued=queued,
        finished_untrained=(),
        trainer=trainer,
        max_staleness=k,
        budget_cells=budget,
        batch_queries=batch_q,
        queries_dispatched=dispatched,
        session_kv_reserve_tokens=RESERVE,
    )
