"""Lower bounds on a run's time: the same work perfectly packed onto the budget with free switches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.sim.workload import Preset, Workload


@dataclass(frozen=True, slots=True)
class LowerBound:
    """`hours` = max(resource bound, critical-path bound); both parts kept for the report."""

    hours: float
    resource_h: float
    critical_path_h: float
    rollout_cell_h: float
    train_cell_h: float


def session_rate(preset: Preset, fill: float) -> float:
    """Nominal seconds of progress per second for a session on a cell at KV `fill` (the engine's law)."""
    nominal = 1.0 + preset.nominal_fill / preset.kv_half_fill
    sigma = (1.0 + fill / preset.kv_half_fill) / nominal * max(1.0, fill)
    g = preset.gen_fraction
    return 1.0 / ((1.0 - g) + g * sigma)


def rollout_cell_seconds(preset: Preset, w: Workload, fill: float = 1.0) -> float:
    """Cell-seconds of rollout if every cell held `fill` of its KV all the time.

    Per cell, throughput in session-seconds is (sessions held) × (rate), and sessions held = fill ×
    capacity / mean resident context; it rises with fill up to capacity, so fill = 1 is the best case.
    """
    mean_ctx = (preset.prompt_tokens + w.context_tokens.astype(np.float64)) / 2.0
    resident = float((w.duration_s * mean_ctx).sum())  # token-seconds (nominal)
    return resident / (fill * preset.kv_capacity_tokens * session_rate(preset, fill))


def lower_bound(preset: Preset, w: Workload) -> LowerBound:
    n = preset.cells
    tpc = preset.train_tokens_per_cell_s
    roll = rollout_cell_seconds(preset, w, 1.0)
    train = float(w.context_tokens.sum()) / tpc
    resource = (roll + train) / n + preset.step_overhead_s  # the last step's optimiser cannot overlap
    fastest = session_rate(preset, 0.0)
    g, b, k = preset.group_size, preset.batch_queries, preset.max_staleness
    dur = w.duration_s.reshape(preset.steps, b * g)
    tok = w.context_tokens.reshape(preset.steps, b * g).astype(np.float64)
    version_t = [0.0]
    for step in range(preset.steps):
        start = version_t[max(0, step - k)]
        last = int(np.argmax(dur[step]))
        done = start + dur[step, last] / fastest
        # A streaming trainer can have all but the last execution's tokens done when it finishes;
        # otherwise the whole batch is trained after its last execution.
        tail = tok[step, last] if preset.stream_training else tok[step].sum()
        t = max(version_t[step] + tok[step].sum() / (n * tpc), done + tail / (n * tpc))
        version_t.append(t + preset.step_overhead_s)
    cp = version_t[-1]
    return LowerBound(
        hours=max(resource, cp) / 3600.0,
        resource_h=resource / 3600.0,
        critical_path_h=cp / 3600.0,
        rollout_cell_h=roll / 3600.0,
        train_cell_h=train / 3600.0,
    )
