"""Lower bounds on a run's time that hold for every policy under the same staleness bound and budget.

Both parts follow the engine's own decode law (`DecodeLaw`), relaxed only in the policy's favour:
switching and migration are free, any cell can take any role at any instant, and the future is known.
docs/simulator.md ("The lower bound") gives the argument for each part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.scheduler.sim.engine import SimOptions
from services.scheduler.sim.workload import HOUR, Preset, Workload


@dataclass(frozen=True, slots=True)
class DecodeLaw:
    """The engine's decode law: a session on a cell with resident context C advances 1 / w(C) nominal
    seconds per second, with w(C) = (1 - g) + g (1 + C / C½) / (1 + C_nom / C½) × max(1, C / capacity).

    Below capacity w is affine, w(C) = a + beta C, which is what makes the bounds closed-form.
    """

    a: float
    beta: float
    capacity: float
    g: float
    sigma_norm: float
    c_half: float

    @classmethod
    def of(cls, preset: Preset) -> DecodeLaw:
        cap = float(preset.kv_capacity_tokens)
        c_half = preset.kv_half_fill * cap
        sigma_norm = 1.0 + preset.nominal_fill * cap / c_half
        g = preset.gen_fraction
        return cls(
            a=(1.0 - g) + g / sigma_norm,
            beta=g / (sigma_norm * c_half),
            capacity=cap,
            g=g,
            sigma_norm=sigma_norm,
            c_half=c_half,
        )

    def wall_per_nominal(self, context: float) -> float:
        sigma = (1.0 + context / self.c_half) / self.sigma_norm * max(1.0, context / self.capacity)
        return (1.0 - self.g) + self.g * sigma

    def best_token_throughput(self) -> float:
        """max over C of C / w(C): resident token-seconds (nominal) a cell can advance per second.

        Below capacity C / w(C) rises with C; above it C / w(C) = C / (A + B C + E C²) peaks at
        sqrt(A / E), which is past capacity only for decode laws where preempting still pays.
        """
        cap = self.capacity
        best = cap / self.wall_per_nominal(cap)
        e = self.g / (self.sigma_norm * self.c_half * cap)
        peak = math.sqrt((1.0 - self.g) / e)
        if peak > cap:
            best = max(best, peak / self.wall_per_nominal(peak))
        return best


@dataclass(frozen=True, slots=True)
class LowerBound:
    """`hours` = max(resource bound, critical-path bound); both parts kept for the report."""

    hours: float
    resource_h: float
    critical_path_h: float
    rollout_cell_h: float  # rollout work at the best throughput a cell has, in cell-hours
    train_cell_h: float
    slowest_alone_h: float  # mean over steps of the slowest execution's time alone on a cell
    rate_lag_s: float  # longest the engine holds a cell's decode rate between refreshes


def context_lag_nominal_s(preset: Preset, options: SimOptions) -> float:
    """How far (in nominal seconds of progress) the context behind a cell's current decode rate can lag.

    The engine refreshes a cell's rate on every arrival, departure and finish, and every cell's rate
    at least every `decide_interval_s + tick_s` seconds (`Simulation._decide`); in between, a session
    advances at most that long at the fastest rate a session can have, alone at its prompt.
    """
    law = DecodeLaw.of(preset)
    lag_s = options.decide_interval_s + options.tick_s
    return lag_s / (law.a + law.beta * preset.prompt_tokens)


def alone_seconds(preset: Preset, w: Workload, lag_nominal_s: float = 0.0) -> np.ndarray:
    """Each execution's wall time with a cell to itself: no policy runs an execution faster.

    The cell's resident context includes the session's own, which grows linearly from the prompt to
    its final size, so w >= a + beta × L(x). With the engine's rate lag the context behind the rate
    is L(x - lag): integrate a + beta × L(max(0, x - lag)) over the execution's nominal seconds.
    """
    law = DecodeLaw.of(preset)
    d = w.duration_s
    l0 = float(preset.prompt_tokens)
    slope = (w.context_tokens.astype(np.float64) - l0) / d
    grown = np.maximum(0.0, d - lag_nominal_s)
    return np.asarray(d * (law.a + law.beta * l0) + law.beta * slope * grown * grown / 2.0)


def resident_token_seconds(preset: Preset, w: Workload, lag_nominal_s: float = 0.0) -> float:
    """Sum over executions of ∫ L(max(0, x - lag)) dx: the (lagged) context each one keeps resident
    for each nominal second of progress."""
    d = w.duration_s
    l0 = float(preset.prompt_tokens)
    slope = (w.context_tokens.astype(np.float64) - l0) / d
    grown = np.maximum(0.0, d - lag_nominal_s)
    return float((l0 * d + slope * grown * grown / 2.0).sum())


def rollout_cell_seconds(preset: Preset, w: Workload, fill: float | None = None, lag_nominal_s: float = 0.0) -> float:
    """Cell-seconds of rollout if every cell held the context of best throughput (or `fill`) all the time.

    A cell advances its sessions' resident token-seconds at C / w(C) per second; summed over the run
    the rollout cells must cover every execution's resident token-seconds.
    """
    law = DecodeLaw.of(preset)
    if fill is None:
        per_cell = law.best_token_throughput()
    else:
        c = fill * law.capacity
        per_cell = c / law.wall_per_nominal(c)
    return resident_token_seconds(preset, w, lag_nominal_s) / per_cell


def lower_bound(preset: Preset, w: Workload, options: SimOptions | None = None) -> LowerBound:
    """The run cannot end before either bound (docs/simulator.md, "The lower bound").

    * resource: all rollout work at the best per-cell throughput plus all training work, spread over
      the whole budget, plus the last step's optimiser overhead (nothing can overlap it);
    * critical path: batch b starts no earlier than version b - k exists; each of its executions
      takes at least its time alone on a cell; version b + 1 follows the batch's slowest execution
      plus its training on every cell plus the overhead, and follows version b plus that training.

    Under a wall-clock budget an execution may instead be cut `timeout_h` after its dispatch, having
    done as little as nothing (a parked session makes no progress): each batch then either finishes
    all its work as above or has one execution cut, which takes the whole budget and leaves at least
    the prompts to train; the chain takes whichever is shorter, and the resource part only the prompts.
    """
    opts = options or SimOptions()
    lag = context_lag_nominal_s(preset, opts)
    n = preset.cells
    tpc = preset.train_tokens_per_cell_s
    wall_clock = preset.budget == "wall_clock"
    l0 = float(preset.prompt_tokens)
    if wall_clock:
        roll = 0.0
        train = l0 * len(w.duration_s) / tpc
    else:
        roll = rollout_cell_seconds(preset, w, lag_nominal_s=lag)
        train = float(w.context_tokens.sum()) / tpc
    resource = (roll + train) / n + preset.step_overhead_s

    per_batch = preset.batch_queries * preset.group_size
    alone = alone_seconds(preset, w, lag).reshape(preset.steps, per_batch)
    tok = w.context_tokens.reshape(preset.steps, per_batch).astype(np.float64)
    # A scenario gives per batch (training time at full width, earliest ready time after dispatch).
    full_train = tok.sum(axis=1) / (n * tpc)
    if preset.stream_training:
        # Each execution's tokens can be trained as soon as it finishes (from version b on).
        ready = (alone + tok / (n * tpc)).max(axis=1)
    else:
        # Tree packing spans the batch: training starts when its slowest execution has finished.
        ready = alone.max(axis=1) + full_train
    slowest = alone.max(axis=1)
    scenarios = []
    if wall_clock:
        budget_s = preset.timeout_h * HOUR
        # Finishing every execution's work is impossible where one cannot finish even alone.
        ready = np.where(slowest > budget_s, np.inf, ready)
        # Or one execution is cut: the batch ends no earlier than the budget, then trains its prompts
        # (streaming: only the cut one's is left).
        prompts = np.full(preset.steps, per_batch * l0 / (n * tpc))
        after_cut = np.full(preset.steps, l0 / (n * tpc)) if preset.stream_training else prompts
        scenarios.append((prompts, budget_s + after_cut))
        slowest = np.minimum(slowest, budget_s)
    scenarios.append((full_train, ready))
    k = preset.max_staleness
    version_t = [0.0]
    for step in range(preset.steps):
        start = version_t[max(0, step - k)]
        t = min(max(version_t[step] + tr[step], start + rd[step]) for tr, rd in scenarios)
        version_t.append(t + preset.step_overhead_s)
    cp = version_t[-1]
    return LowerBound(
        hours=max(resource, cp) / 3600.0,
        resource_h=resource / 3600.0,
        critical_path_h=cp / 3600.0,
        rollout_cell_h=roll / 3600.0,
        train_cell_h=train / 3600.0,
        slowest_alone_h=float(slowest.mean()) / 3600.0,
        rate_lag_s=opts.decide_interval_s + opts.tick_s,
    )
