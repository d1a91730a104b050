"""Workload presets and the long-tailed execution model they sample from (deterministic per seed).

An execution's nominal duration is `query difficulty × per-sample noise`, capped by the agent's time
budget (a wall-clock budget is enforced by the engine instead, `BUDGETS`); its final context grows in
proportion to how long it ran. Nominal means: at the reference
load of a rollout cell (the load under which the published durations were measured).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

HOUR = 3600.0

# How the agent's time budget (`timeout_h`) ends an execution:
# * "work": after `timeout_h` nominal hours of progress, however long that takes on a loaded cell —
#   a budget on the agent's calls or turns; every policy then does the same work;
# * "wall_clock": `timeout_h` hours after dispatch, with whatever it has done by then (the task
#   format's `max_agent_timeout_sec`); a slower schedule then does less work.
BUDGETS = frozenset({"work", "wall_clock"})


class PresetError(ValueError):
    """An unknown preset name or an impossible preset value."""


@dataclass(frozen=True, slots=True)
class Preset:
    """One calibrated workload on one cluster. Field comments give the unit and the meaning."""

    name: str
    description: str
    # --- run ---
    steps: int
    batch_queries: int  # queries per optimiser step (B)
    group_size: int = 16  # executions per query (G)
    max_staleness: int = 1  # k: a query joins a batch at most k versions after its dispatch version
    # --- durations (hours, nominal) ---
    query_log_mean: float = 0.0  # mean of log(query difficulty / 1 h)
    query_log_sd: float = 0.5  # spread of difficulty between tasks
    sample_log_sd: float = 0.3  # spread between the G samples of one task
    timeout_h: float = 8.0  # the agent's time budget; longer executions are cut and graded as preserved
    budget: str = "work"  # how timeout_h is enforced: BUDGETS below
    # --- tokens ---
    prompt_tokens: int = 8_000
    mean_context_tokens: int = 300_000  # mean final context of an execution (≈ unique tokens trained)
    max_context_tokens: int = 1_000_000
    # --- cluster ---
    cells: int = 64
    kv_capacity_tokens: int = 4_000_000  # resident context one rollout cell holds
    kv_bytes_per_token: int = 64_000
    max_sessions_per_cell: int = 256  # engine concurrency limit (max_num_seqs), binds for short contexts
    # KV admission reserves a session, at least (its mean context where larger); None: the capacity's share of a
    # session at the engine's concurrency limit. A preset fitted to a live run gives the live scheduler's.
    session_reserve_tokens: int | None = None
    gen_fraction: float = 0.5  # share of an execution's nominal time spent waiting on generation
    nominal_fill: float = 0.5  # KV fill at which nominal durations hold
    kv_half_fill: float = 0.5  # KV fill at which attention reads cost as much as weight reads
    # The rate a cell prefills a history again (a parked session resuming, a session moved by recompute).
    # None: derived from training, `prefill_rate()`.
    prefill_tokens_per_s: float | None = None
    migration_bytes_per_s: float = 25e9
    to_train_s: float = 8.52
    to_rollout_s: float = 3.46
    # --- training ---
    train_tokens_per_cell_s: float = 2_000.0
    step_overhead_s: float = 120.0  # optimiser step + weight publication, independent of cell count
    stream_training: bool = False  # train finished executions before their batch is complete
    async_rollout_share: float | None = None  # async pool split; None: sized from expected work
    fill: float = 0.9  # KV fraction the policies may reserve on a rollout cell
    colocate_run_ahead: bool = True  # colocate starts later batches within the bound (parks them)
    # --- drift ---
    # As the policy improves its executions run longer and carry more context: step s's nominal difficulty is
    # the drawn one × (1 + drift_per_step)^s (contexts follow, as they grow with the hours run). 0: stationary.
    drift_per_step: float = 0.0

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise PresetError(f"budget must be one of {sorted(BUDGETS)}, got {self.budget!r}")
        if not -1.0 < self.drift_per_step <= 1.0:
            raise PresetError(f"drift_per_step must be in (-1, 1] (a step's growth in difficulty), "
                              f"got {self.drift_per_step}")

    def scaled(self, **changes: object) -> Preset:
        return replace(self, **changes)  # type: ignore[arg-type]

    def prefill_rate(self) -> float:
        """Tokens per second a cell prefills: as given, else 3 × what it trains. Prefilling a context is the
        forward pass over it, a third of a training step's FLOPs (forward + backward ≈ 3 forwards), at the same
        utilisation; at these contexts attention dominates both, so the ratio holds per token of context."""
        return self.prefill_tokens_per_s if self.prefill_tokens_per_s else 3.0 * self.train_tokens_per_cell_s

    def nominal_cap_h(self) -> float:
        """The most nominal hours an execution can run: the budget itself when it caps work; under a
        wall-clock budget, what a session could do in it at the fastest decode (w >= 1 - gen_fraction)."""
        if self.budget == "work":
            return self.timeout_h
        return self.timeout_h / max(1e-9, 1.0 - self.gen_fraction)


@dataclass(frozen=True, slots=True)
class Workload:
    """Sampled executions, query-major: execution j of query q is row q * G + j."""

    duration_s: np.ndarray  # nominal duration of each execution
    context_tokens: np.ndarray  # final context of each execution (its trained tokens)
    timed_out: np.ndarray  # bool: cut by the time budget whatever the schedule (longer than nominal_cap_h)
    group_size: int

    @property
    def n_queries(self) -> int:
        return int(self.duration_s.shape[0]) // self.group_size

    def query_duration_s(self) -> np.ndarray:
        return np.asarray(self.duration_s.reshape(-1, self.group_size).max(axis=1))


def sample_workload(preset: Preset, seed: int, *, n_queries: int | None = None) -> Workload:
    """Draw every execution of the run from a seeded generator (no global randomness)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    nq = n_queries if n_queries is not None else preset.steps * preset.batch_queries
    g = preset.group_size
    difficulty = np.exp(preset.query_log_mean + preset.query_log_sd * rng.standard_normal(nq))
    if preset.drift_per_step:  # drawn as without drift (same seed, same draws), then grown by step
        step = np.arange(nq) // max(1, preset.batch_queries)
        difficulty = difficulty * (1.0 + preset.drift_per_step) ** step
    s = preset.sample_log_sd
    noise = np.exp(s * rng.standard_normal((nq, g)) - s * s / 2)
    cap_h = preset.nominal_cap_h()
    hours = np.minimum(difficulty[:, None] * noise, cap_h).reshape(-1)
    timed_out = (difficulty[:, None] * noise).reshape(-1) >= cap_h
    growth = context_growth_per_hour(preset)
    ctx = np.minimum(preset.prompt_tokens + growth * hours, preset.max_context_tokens)
    return Workload(
        duration_s=hours * HOUR, context_tokens=ctx.astype(np.int64), timed_out=timed_out, group_size=g
    )


@lru_cache(maxsize=64)
def context_growth_per_hour(preset: Preset, samples: int = 100_000) -> float:
    """Tokens of context an execution gains per nominal hour, chosen so that the mean final context
    (after the context cap) equals `mean_context_tokens`; bisection over a fixed-seed sample."""
    rng = np.random.Generator(np.random.PCG64(12345))
    z = rng.standard_normal(samples)
    e = rng.standard_normal(samples)
    s = preset.sample_log_sd
    h = np.exp(preset.query_log_mean + preset.query_log_sd * z) * np.exp(s * e - s * s / 2)
    h = np.minimum(h, preset.timeout_h)  # at the reference load a wall-clock budget is timeout_h nominal hours too
    lo, hi = 0.0, 100.0 * preset.max_context_tokens / max(1e-9, float(h.mean()))
    for _ in range(60):
        mid = (lo + hi) / 2
        mean = float(np.minimum(preset.prompt_tokens + mid * h, preset.max_context_tokens).mean())
        lo, hi = (mid, hi) if mean < preset.mean_context_tokens else (lo, mid)
    return (lo + hi) / 2


def workload_stats(preset: Preset, w: Workload) -> dict[str, float]:
    """The statistics the presets are calibrated to: mean execution and query hours, tail share."""
    q = w.query_duration_s() / HOUR
    return {
        "mean_execution_h": float(w.duration_s.mean() / HOUR),
        "mean_query_h": float(q.mean()),
        "share_queries_ge_4h": float((q >= 4.0).mean()),
        "p99_execution_h": float(np.quantile(w.duration_s / HOUR, 0.99)),
        "share_timed_out": float(w.timed_out.mean()),
        "mean_context_tokens": float(w.context_tokens.mean()),
        "queries": float(q.shape[0]),
    }
