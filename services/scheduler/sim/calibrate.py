"""The simulator calibrated on a live run: a preset and a workload fitted from the run's own events, and the
simulator's prediction of each mode's wall-clock for that workload (`gyre sim --from-run`, and what `gyre compare`
sets beside measurement).

Fitted from the log (docs/simulator.md, "Calibration against live runs"):
* the workload — every execution's elapsed time (its nominal duration: the sim replays this trace, query by query
  in dispatch order) and the tokens it trained (its context), and the log-normal fit of those times the presets use;
* the engine — the share of an execution spent waiting on its calls (`gen_fraction`), and how a call's time per
  generated token grows with the sessions its cell holds (the decode law's `kv_half_fill`);
* the cells — their KV capacity, the switch times per direction (medians), the migration rate;
* training — tokens a cell trains per second (`batch.ready` tokens over `step.completed` seconds × world size),
  and the step's fixed part (weights published and loaded).
Everything else (staleness, steps, batch, group, budget) is the run's own config; the policies run with the live
scheduler's time constants.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.scheduler.policies import SwitchCosts
from shared.events import (
    BatchReady,
    CallCompleted,
    CellReady,
    CellRegistered,
    Event,
    ExecutionFinished,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
    QueryDispatched,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
)


class CalibrationError(ValueError):
    """The run's log does not hold what a calibration needs (no finished execution, no trained step)."""


@dataclass(frozen=True)
class Calibration:
    """What was fitted, in the units the simulator's preset takes (seconds for the run's hours)."""

    run_id: str
    executions: int
    gen_fraction: float
    per_token_s: float  # a call's seconds per generated token on an empty cell
    per_token_slope_s: float  # … and what each further session resident on the cell adds
    kv_capacity_tokens: int
    to_train_s: float
    to_rollout_s: float
    migration_tokens_per_s: float | None
    train_tokens_per_cell_s: float
    step_overhead_s: float
    mean_context_tokens: float
    prompt_tokens: float
    duration_log_mean: float  # log-normal fit of executions' seconds (the presets' shape, for reference)
    duration_log_sd: float
    mean_sessions_per_cell: float  # the load the measured durations carry (the decode law's reference)


@dataclass(frozen=True)
class Trace:
    """The run's executions in dispatch order (query-major, `group_size` a query): seconds and trained tokens."""

    duration_s: np.ndarray
    context_tokens: np.ndarray
    group_size: int


def fit(run_id: str, events: Sequence[Event], *, group_size: int) -> tuple[Calibration, Trace]:
    """Fit the engine, the cells, training and the workload from one run's events (in log order). Pure."""
    t0 = events[0].occurred_at if events else None
    order: list[str] = []  # query ids in dispatch order
    of_query: dict[str, dict[int, str]] = defaultdict(dict)
    elapsed: dict[str, float] = {}
    gen: dict[str, float] = defaultdict(float)
    per_token: list[float] = []  # each call's seconds per generated token
    load_samples: list[int] = []  # … and the sessions its cell held then
    live_on: dict[str, set[str]] = defaultdict(set)
    cell_of: dict[str, str] = {}
    registered_kv: dict[str, int] = {}  # per cell: what cell.registered states, and what its engine reported
    engine_kv: dict[str, int] = {}
    switch: dict[str, list[float]] = defaultdict(list)
    started_cells: set[str] = set()
    moved_tokens = moved_s = 0.0
    trained = 0
    step_cell_s = 0.0
    batch_tokens: dict[int, int] = {}
    batch_execs: dict[int, int] = {}
    published: dict[int, float] = {}
    syncs: list[float] = []
    prompt_first: list[int] = []

    def seconds(e: Event) -> float:
        assert t0 is not None
        return (e.occurred_at - t0).total_seconds()

    for event in events:
        d = event.data
        if isinstance(d, QueryDispatched):
            order.append(d.query_id)
        elif isinstance(d, ExecutionStarted):
            of_query[d.query_id][d.sample_index] = d.execution_id
        elif isinstance(d, (ExecutionFinished, ExecutionTimedOut)):
            elapsed[d.execution_id] = d.elapsed_s
            if (cell := cell_of.pop(d.execution_id, None)) is not None:
                live_on[cell].discard(d.execution_id)
        elif isinstance(d, CallCompleted):
            gen[d.execution_id] += d.latency_s
            if d.call_index == 0:
                prompt_first.append(d.prompt_tokens)
            old = cell_of.get(d.execution_id)
            if old is not None and old != d.cell_id:
                live_on[old].discard(d.execution_id)
            cell_of[d.execution_id] = d.cell_id
            live_on[d.cell_id].add(d.execution_id)
            if d.completion_tokens > 0 and d.latency_s > 0:
                per_token.append(d.latency_s / d.completion_tokens)
                load_samples.append(len(live_on[d.cell_id]))
        elif isinstance(d, CellRegistered) and d.kv_capacity_tokens:
            registered_kv[d.cell_id] = d.kv_capacity_tokens
        elif isinstance(d, CellReady):
            # A cell's first ready is its engine's cold start (from idle), not a switch between roles.
            if d.cell_id in started_cells and d.switch_seconds > 0:
                switch[d.role].append(d.switch_seconds)
            started_cells.add(d.cell_id)
        elif isinstance(d, KvMigrated) and d.seconds > 0:
            moved_tokens += d.tokens
            moved_s += d.seconds
        elif isinstance(d, BatchReady):
            batch_tokens[d.step] = d.unique_tokens
            batch_execs[d.step] = d.executions
        elif isinstance(d, StepCompleted):
            if d.step in batch_tokens:
                trained += batch_tokens[d.step]
                step_cell_s += d.seconds * d.world_size
        elif isinstance(d, WeightsPublished):
            published[d.version] = seconds(event) - (d.publish_s or 0.0)
        elif isinstance(d, WeightsLoaded):
            if d.kv_capacity_tokens:
                engine_kv[d.cell_id] = d.kv_capacity_tokens
            if d.version in published and d.version > 0:
                syncs.append(seconds(event) - published.pop(d.version))
    if not elapsed or not order:
        raise CalibrationError(f"run {run_id}: no finished execution in its log to fit a workload to")
    if step_cell_s <= 0 or trained <= 0:
        raise CalibrationError(f"run {run_id}: no trained step in its log to fit training to")
    prior = SwitchCosts()  # the published switch times, where the run measured no switch
    per_exec_tokens = sum(batch_tokens.values()) / max(1, sum(batch_execs.values()))
    durations, contexts = [], []
    fallback = statistics.median(elapsed.values())
    for query in order:
        samples = of_query.get(query, {})
        for j in range(group_size):
            eid = samples.get(j)
            durations.append(elapsed.get(eid, fallback) if eid else fallback)
            contexts.append(per_exec_tokens)
    gen_fraction = min(0.99, sum(gen[e] for e in elapsed) / max(1e-9, sum(elapsed.values())))
    a, slope = _line(load_samples, per_token)
    logs = [math.log(max(1e-3, x)) for x in elapsed.values()]
    cal = Calibration(
        run_id=run_id,
        executions=len(elapsed),
        gen_fraction=gen_fraction,
        per_token_s=a,
        per_token_slope_s=slope,
        kv_capacity_tokens=_cell_capacity(registered_kv, engine_kv),
        to_train_s=statistics.median(switch["train"]) if switch["train"] else prior.to_train_s,
        to_rollout_s=statistics.median(switch["rollout"]) if switch["rollout"] else prior.to_rollout_s,
        migration_tokens_per_s=moved_tokens / moved_s if moved_s > 0 else None,
        train_tokens_per_cell_s=trained / step_cell_s,
        step_overhead_s=statistics.median(syncs) if syncs else 0.0,
        mean_context_tokens=per_exec_tokens,
        prompt_tokens=statistics.median(prompt_first) if prompt_first else per_exec_tokens / 4,
        duration_log_mean=statistics.fmean(logs),
        duration_log_sd=statistics.pstdev(logs) if len(logs) > 1 else 0.0,
        mean_sessions_per_cell=statistics.fmean(load_samples) if load_samples else 1.0,
    )
    trace = Trace(np.asarray(durations, dtype=float), np.asarray(contexts, dtype=np.int64), group_size)
    return cal, trace


def _cell_capacity(registered: dict[str, int], engine: dict[str, int]) -> int:
    """A cell's KV as the live scheduler admitted against it (the smaller of the registered capacity and the
    engine's, either where the other is unknown), the median over the cells; the scheduler's default (1 Mi
    tokens) where the log has neither."""
    from services.scheduler.policies import admitted_kv_tokens

    caps = [admitted_kv_tokens(registered.get(c, 0), engine.get(c, 0), 0) for c in {*registered, *engine}]
    return int(statistics.median(caps)) if caps else 1 << 20


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a + b·x (b clipped at 0: more sessions never speed a call up)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return (statistics.fmean(ys) if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(0.0, b)
    return max(1e-6, my - b * mx), b


def preset_for(cal: Calibration, config: dict[str, Any], *, steps: int) -> Any:
    """The simulator preset for the run: fitted values where there are, the run's config for the rest.

    The decode law: a call's time per token is a + b·n with n sessions on the cell; the sim's is proportional to
    1 + C/C½ with C the resident context, so C½ = (a / b) sessions' worth of context, and the measured durations
    hold at the mean load seen (`nominal_fill`)."""
    from services.scheduler.policies import SESSION_RESERVE_TOKENS
    from services.scheduler.sim.workload import Preset

    s, budgets = config["scheduling"], config["budgets"]
    capacity = cal.kv_capacity_tokens
    ctx = max(1.0, cal.mean_context_tokens)
    half = (cal.per_token_s / cal.per_token_slope_s) * ctx if cal.per_token_slope_s > 0 else 1e6 * capacity
    tokens_per_s = cal.migration_tokens_per_s or 1e6
    return Preset(
        name=f"calibrated-{cal.run_id}",
        description=f"fitted from run {cal.run_id}'s events ({cal.executions} executions)",
        steps=steps,
        batch_queries=s["queries_per_step"],
        group_size=s["group_size"],
        max_staleness=s["max_staleness"],
        timeout_h=(budgets.get("wall_s") or 1e6) / 3600.0,
        budget="work",
        prompt_tokens=int(cal.prompt_tokens),
        mean_context_tokens=int(ctx),
        max_context_tokens=max(int(ctx) * 8, config["model"]["max_model_len"]),
        cells=s["cells"],
        kv_capacity_tokens=capacity,
        kv_bytes_per_token=1,
        # Admission as the live scheduler's: its reserve a session (not the capacity's share at a whole number
        # of sessions, which at a capacity of 2.25 reserves would admit one fewer than live did).
        max_sessions_per_cell=max(1, capacity // SESSION_RESERVE_TOKENS),
        session_reserve_tokens=SESSION_RESERVE_TOKENS,
        gen_fraction=cal.gen_fraction,
        nominal_fill=min(4.0, cal.mean_sessions_per_cell * ctx / capacity),
        kv_half_fill=half / capacity,
        migration_bytes_per_s=tokens_per_s,
        to_train_s=cal.to_train_s,
        to_rollout_s=cal.to_rollout_s,
        train_tokens_per_cell_s=cal.train_tokens_per_cell_s,
        step_overhead_s=cal.step_overhead_s,
        async_rollout_share=None,
    )


def simulate_modes(cal: Calibration, trace: Trace, config: dict[str, Any], modes: Sequence[str],
                   *, steps: int) -> dict[str, float]:
    """Each mode's simulated seconds from the first dispatch to the last step, on the run's own workload trace,
    with the live scheduler's time constants (its tick, the elastic policy's dwell and horizon, async's split)."""
    from services.scheduler.policies import ElasticTiming, make_policy
    from services.scheduler.sim.engine import SimOptions, Simulation
    from services.scheduler.sim.workload import Workload

    preset = preset_for(cal, config, steps=steps)
    s = config["scheduling"]
    rows = steps * preset.batch_queries * preset.group_size
    if len(trace.duration_s) < rows:  # a mode that ran further than the calibration run: repeat its trace
        reps = math.ceil(rows / len(trace.duration_s))
        durations, contexts = np.tile(trace.duration_s, reps)[:rows], np.tile(trace.context_tokens, reps)[:rows]
    else:
        durations, contexts = trace.duration_s[:rows], trace.context_tokens[:rows]
    workload = Workload(duration_s=durations, context_tokens=contexts, timed_out=np.zeros(rows, bool),
                        group_size=preset.group_size)
    timing = ElasticTiming(train_horizon_s=s["elastic_train_horizon_s"], min_dwell_s=s["elastic_min_dwell_s"],
                           margin=s["elastic_margin"])
    tick = float(s.get("tick_s", 0.5))
    out = {}
    for mode in modes:
        policy = make_policy(mode, budget_cells=preset.cells, rollout_cells=max(1, preset.cells // 2),
                             fill=preset.fill, colocate_run_ahead=False, elastic_timing=timing)
        sim = Simulation(preset, workload, policy, SimOptions(decide_interval_s=tick, tick_s=max(tick, 2.0),
                                                              record_timeline=False))
        out[mode] = round(sim.run(), 3)
    return out


async def load_run_events(run_id: str, database_url: str = "") -> list[Event]:
    """Every event of the run, in log order, from `database_url` or else the configured PostgreSQL."""
    from shared.settings import load_settings
    from shared.store import EventStore

    settings = load_settings()
    database_url = database_url or settings.database_url
    if not database_url:
        raise CalibrationError("no database configured (GYRE_DATABASE_URL) and none running: run `gyre up` first")
    store = await EventStore.connect(database_url, schema=settings.db_schema)
    try:
        return [s.event for s in await store.read_all(run_id=run_id)]
    finally:
        await store.close()
