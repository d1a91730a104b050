"""The run report: training-score curve, per-step cells in each role and the trainer's world size, every role switch
with its phases and the sessions it moved, tree statistics — computed from a run's events alone, so a report can
be rebuilt from the log or an export at any time. Pure; the images are gyre/report_plots.py.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.events import (
    BatchReady,
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReady,
    CallCompleted,
    CellReleased,
    Event,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionResumed,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    GroupFormed,
    KvMigrated,
    QueryDispatched,
    RankStepped,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
    WeightsRetired,
)


@dataclass
class StepRow:
    step: int
    mean_reward: float
    pass_rate: float
    executions: int
    loss: float | None = None
    seconds: float | None = None
    world_size: int | None = None  # the trainer group's, from step.completed
    roles: dict[str, int] = field(default_factory=dict)  # cells serving each role when the step completed
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's part (trainer.rank_stepped)
    completed_s: float | None = None  # when the step completed, seconds from the run's first event


@dataclass
class Switch:
    """One cell's switch from `cell.assigned` (or `cell.draining`) to `cell.ready`."""

    cell_id: str
    from_role: str
    to_role: str
    start_s: float
    seconds: float | None = None  # cell.ready's switch_seconds
    warm: bool | None = None
    phases: dict[str, float] = field(default_factory=dict)
    sessions_moved: dict[str, int] = field(default_factory=dict)  # by method: kv, recompute
    sessions_parked: int = 0


@dataclass
class RunReport:
    run_id: str
    steps: list[StepRow] = field(default_factory=list)
    reward_first: float | None = None
    reward_last: float | None = None
    reward_gain: float | None = None
    # Means over the first and last few steps (3, or a third of a short run): less noisy than single steps.
    reward_head: float | None = None
    reward_tail: float | None = None
    executions: int = 0
    timed_out: int = 0
    infra_failures: int = 0  # executions infrastructure ended: not trained, not in the reward curve
    # Resumes by a restarted harness (`execution.resumed`): calls answered again from the log, not generated.
    resumed_executions: int = 0
    replayed_calls: int = 0
    stale_executions: int = 0  # executions left out of training: generated beyond the staleness bound
    branches: dict[str, int] = field(default_factory=dict)
    forks_by_cause: dict[str, int] = field(default_factory=dict)  # the gateway's forks: what the harness rewrote
    unique_tokens: int = 0
    flat_tokens: int = 0
    dedup_factor: float | None = None
    group_shared_tokens: int = 0  # not packed again: a query's executions share their opening prompt
    # The trajectory cap over the trained executions: trajectories before and after it, executions it cut, and
    # the target tokens it left untrained.
    trained_executions: int = 0
    trajectories_before_cap: int = 0
    trajectories_after_cap: int = 0
    capped_executions: int = 0
    cap_dropped_targets: int = 0
    switches: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    world_sizes: list[dict[str, Any]] = field(default_factory=list)  # trainer.group_formed: t, world size, why
    migrations: dict[str, int] = field(default_factory=dict)  # sessions moved, by method
    # Prompt tokens targets took from moved KV instead of prefilling them again, and the KV bytes that moved.
    prefill_tokens_avoided: int = 0
    kv_bytes_moved: int = 0
    kv_fallbacks: dict[str, int] = field(default_factory=dict)  # moves that tried KV and recomputed, by reason
    # One row per published version (weights.published → each worker's weights.loaded): `publish_s` from the
    # step's end to the weights stored, `served_s` from then until the last worker served them, `pauses` how
    # long each worker held new calls for the swap.
    weight_syncs: list[dict[str, Any]] = field(default_factory=list)
    weights_retired: int = 0  # versions whose objects retention deleted
    weights_retired_bytes: int = 0
    wall_s: float | None = None
    first_dispatch_s: float | None = None  # the run's first query.dispatched (what precedes it is start-up)
    # Batch step − dispatch version of every query: how stale rollouts were when their batch was trained.
    staleness: dict[str, float] = field(default_factory=dict)
    # Per cell: [start, end] seconds during which it held at least one live session (placed, moved or served there),
    # and during which its trainer rank computed a step: what the cell-time shares split roles into busy and not.
    occupied: dict[str, list[list[float]]] = field(default_factory=dict)
    rank_busy: dict[str, list[list[float]]] = field(default_factory=dict)
    tasks_left_out: dict[str, str] = field(default_factory=dict)  # named to train on, not runnable here: why

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


_FALLBACK_KINDS = (  # (a phrase a fallback's reason holds, what the report calls it)
    ("digest", "corrupted or truncated in transit"),
    ("missing", "KV missing (its sender died, or it expired)"),
    ("stopped arriving", "transfer stalled"),
    ("arrived, then nothing", "transfer stalled"),
    ("target full", "target full"),
    ("model mismatch", "another model"),
    ("stale", "another policy version"),
    ("no whole KV block", "no whole block to move"),
    ("no KV connector", "no KV connector or transport"),
)


def _reason_kind(fallback: str) -> str:
    """A fallback's reason without its particulars (object names, byte counts), so like reasons count together."""
    return next((kind for phrase, kind in _FALLBACK_KINDS if phrase in fallback), fallback[:80])


def build_report(run_id: str, events: Sequence[Event]) -> RunReport:
    """Fold a run's events (in log order) into its report. Pure."""
    report = RunReport(run_id=run_id)
    step_of: dict[str, int] = {}
    rewards: dict[int, list[float]] = defaultdict(list)
    completed: dict[int, StepCompleted] = {}
    ranks: dict[int, list[dict[str, Any]]] = defaultdict(list)
    roles_at: dict[int, dict[str, int]] = {}
    branches: Counter[str] = Counter()
    forks: Counter[str] = Counter()
    migrations: Counter[str] = Counter()
    role_since: dict[str, tuple[str, float]] = {}
    completed_at: dict[int, float] = {}
    serving: dict[str, str] = {}  # cell -> the role it serves (cell.ready) until it leaves it
    switching: dict[str, Switch] = {}
    syncs: dict[int, dict[str, Any]] = {}
    served_by: set[tuple[str, int]] = set()  # (worker, version): the first weights.loaded of each counts
    t0 = events[0].occurred_at if events else None
    placed: dict[str, list[str]] = {}  # query -> cell per sample
    lag: list[int] = []
    occupancy = _Occupancy()

    def t(event: Event) -> float:
        assert t0 is not None
        return (event.occurred_at - t0).total_seconds()

    for event in events:
        data = event.data
        if isinstance(data, ExecutionStarted):
            step_of[data.execution_id] = data.step
            places = placed.get(data.query_id, [])
            if data.sample_index < len(places):
                occupancy.at(data.execution_id, places[data.sample_index], t(event))
        elif isinstance(data, QueryDispatched):
            placed[data.query_id] = list(data.placements)
            lag.append(data.step - data.policy_version)
            if report.first_dispatch_s is None:
                report.first_dispatch_s = t(event)
        elif isinstance(data, CallCompleted):
            occupancy.at(data.execution_id, data.cell_id, t(event))
        elif isinstance(data, (ExecutionFinished, ExecutionTimedOut)):
            occupancy.end(data.execution_id, t(event))
        elif isinstance(data, ExecutionScored):
            report.executions += 1
            report.timed_out += int(data.timed_out)
            if data.infra_failure is not None:
                report.infra_failures += 1
            else:
                rewards[step_of.get(data.execution_id, 0)].append(data.reward)
        elif isinstance(data, ExecutionResumed):
            report.resumed_executions += 1
            report.replayed_calls += data.replayed_calls
        elif isinstance(data, ExecutionBranched):
            branches[data.kind] += 1
            if data.kind == "fork":
                forks[data.cause or "unknown"] += 1
        elif isinstance(data, BatchReady):
            report.unique_tokens += data.unique_tokens
            report.flat_tokens += data.flat_tokens
            report.group_shared_tokens += data.group_shared_tokens
            report.stale_executions += data.stale_executions
            report.trained_executions += data.executions
            report.trajectories_before_cap += data.trajectories_before_cap
            report.trajectories_after_cap += data.trajectories_after_cap
            report.capped_executions += data.capped_executions
            report.cap_dropped_targets += data.dropped_targets
        elif isinstance(data, StepCompleted):
            completed[data.step] = data
            completed_at[data.step] = t(event)
            roles_at[data.step] = dict(sorted(Counter(serving.values()).items()))
        elif isinstance(data, RankStepped):
            ranks[data.step].append({"cell_id": data.cell_id, "rank": data.rank, "tokens": data.tokens,
                                     "micro_batches": data.micro_batches, "seconds": data.seconds})
            report.rank_busy.setdefault(data.cell_id, []).append([max(0.0, t(event) - data.seconds), t(event)])
        elif isinstance(data, GroupFormed):
            report.world_sizes.append({"t_s": t(event), "world_size": data.world_size, "members": data.members,
                                       "generation": data.generation, "seconds": data.seconds,
                                       "reason": data.reason})
        elif isinstance(data, CellAssigned):
            _close_segment(report, role_since, data.cell_id, t(event))
            role_since[data.cell_id] = (f"{data.role} (switching)", t(event))
            old = serving.pop(data.cell_id, "idle")
            switching[data.cell_id] = Switch(data.cell_id, from_role=old, to_role=data.role, start_s=t(event))
        elif isinstance(data, CellDrained):
            if (switch := switching.get(data.cell_id)) is not None:
                switch.phases.update(data.phases)
                switch.sessions_parked += data.parked_sessions
        elif isinstance(data, KvMigrated):
            occupancy.at(data.execution_id, data.to_cell, t(event))
            migrations[data.method] += 1
            if data.method == "kv":
                report.prefill_tokens_avoided += data.tokens
                report.kv_bytes_moved += data.bytes
            if data.fallback:
                reason = _reason_kind(data.fallback)
                report.kv_fallbacks[reason] = report.kv_fallbacks.get(reason, 0) + 1
            if (switch := switching.get(data.from_cell)) is not None:
                switch.sessions_moved[data.method] = switch.sessions_moved.get(data.method, 0) + 1
        elif isinstance(data, CellReady):
            _close_segment(report, role_since, data.cell_id, t(event))
            role_since[data.cell_id] = (data.role, t(event))
            serving[data.cell_id] = data.role
            switch = switching.pop(data.cell_id, None) or Switch(data.cell_id, "idle", data.role, t(event))
            switch.seconds, switch.warm = data.switch_seconds, data.warm
            switch.phases.update(data.phases)
            report.switches.append(asdict(switch))
        elif isinstance(data, (CellDraining, CellReleased)):
            serving.pop(data.cell_id, None)  # between roles: it serves neither until cell.ready
        elif isinstance(data, WeightsPublished):
            syncs[data.version] = {"version": data.version, "step": data.step, "bytes": data.bytes,
                                   "dtype": data.dtype, "publish_s": data.publish_s, "published_at_s": t(event),
                                   "served_s": None, "workers": 0, "pauses": []}
        elif isinstance(data, WeightsLoaded):
            sync = syncs.get(data.version)
            if sync is not None and (data.worker_id, data.version) not in served_by:
                served_by.add((data.worker_id, data.version))
                sync["workers"] += 1
                sync["served_s"] = round(t(event) - sync["published_at_s"], 4)
                if "pause_s" in data.phases:
                    sync["pauses"].append(data.phases["pause_s"])
        elif isinstance(data, WeightsRetired):
            report.weights_retired += 1
            report.weights_retired_bytes += data.bytes
    end = t(events[-1]) if events else 0.0
    for cell_id in list(role_since):
        _close_segment(report, role_since, cell_id, end)
    for step in sorted(rewards):
        values = rewards[step]
        done = completed.get(step)
        report.steps.append(
            StepRow(
                step=step,
                mean_reward=sum(values) / len(values),
                pass_rate=sum(1 for v in values if v >= 1.0) / len(values),
                executions=len(values),
                loss=done.metrics.get("loss") if done else None,
                seconds=done.seconds if done else None,
                world_size=done.world_size if done else None,
                roles=roles_at.get(step, {}),
                completed_s=completed_at.get(step),
                ranks=sorted(ranks.get(step, []), key=lambda r: r["rank"]),
            )
        )
    if report.steps:
        report.reward_first = report.steps[0].mean_reward
        report.reward_last = report.steps[-1].mean_reward
        report.reward_gain = report.reward_last - report.reward_first
        k = max(1, min(3, len(report.steps) // 3))
        report.reward_head = _mean([r.mean_reward for r in report.steps[:k]])
        report.reward_tail = _mean([r.mean_reward for r in report.steps[-k:]])
    report.branches = dict(sorted(branches.items()))
    report.forks_by_cause = dict(sorted(forks.items()))
    report.migrations = dict(sorted(migrations.items()))
    if report.unique_tokens:
        report.dedup_factor = report.flat_tokens / report.unique_tokens
    report.weight_syncs = [syncs[v] for v in sorted(syncs)]
    report.wall_s = end
    report.occupied = occupancy.intervals(end)
    if lag:
        report.staleness = {"mean": sum(lag) / len(lag), "max": max(lag)}
    return report


class _Occupancy:
    """Where each live session is (its placement, the cell that served its last call, where it was moved), folded
    into each cell's intervals of holding at least one."""

    def __init__(self) -> None:
        self.cell_of: dict[str, str] = {}
        self.count: dict[str, int] = defaultdict(int)
        self.since: dict[str, float] = {}
        self.done: dict[str, list[list[float]]] = defaultdict(list)
        self.ended: set[str] = set()

    def at(self, execution_id: str, cell_id: str, now: float) -> None:
        if execution_id in self.ended or self.cell_of.get(execution_id) == cell_id:
            return
        self._leave(execution_id, now)
        self.cell_of[execution_id] = cell_id
        self.count[cell_id] += 1
        if self.count[cell_id] == 1:
            self.since[cell_id] = now

    def end(self, execution_id: str, now: float) -> None:
        self._leave(execution_id, now)
        self.ended.add(execution_id)

    def _leave(self, execution_id: str, now: float) -> None:
        cell = self.cell_of.pop(execution_id, None)
        if cell is None:
            return
        self.count[cell] -= 1
        if self.count[cell] == 0:
            self.done[cell].append([self.since.pop(cell), now])

    def intervals(self, end: float) -> dict[str, list[list[float]]]:
        out = {cell: list(spans) for cell, spans in self.done.items()}
        for cell, since in self.since.items():
            out.setdefault(cell, []).append([since, end])
        return dict(sorted(out.items()))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _close_segment(report: RunReport, open_: dict[str, tuple[str, float]], cell_id: str, now: float) -> None:
    if cell_id in open_:
        role, since = open_.pop(cell_id)
        if now > since:
            report.timeline.append({"cell_id": cell_id, "role": role, "start_s": since, "end_s": now})


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summary_lines(report: RunReport) -> list[str]:
    lines = [f"run {report.run_id}: {len(report.steps)} steps, {report.executions} executions "
             f"({report.timed_out} timed out"
             + (f", {report.infra_failures} ended by infrastructure" if report.infra_failures else "")
             + (f", {report.resumed_executions} resumed after a harness stop ({report.replayed_calls} calls "
                "replayed)" if report.resumed_executions else "")
             + (f", {report.stale_executions} left out as too stale" if report.stale_executions else "")
             + f") in {report.wall_s or 0:.0f} s"]
    if report.reward_gain is not None:
        lines.append(f"mean reward {report.reward_first:.3f} → {report.reward_last:.3f} ({report.reward_gain:+.3f})")
        lines.append(
            f"first {min(3, max(1, len(report.steps) // 3))} steps {report.reward_head:.3f} → "
            f"last {report.reward_tail:.3f}; pass rate {report.steps[0].pass_rate:.2f} → {report.steps[-1].pass_rate:.2f}"
        )
    if report.dedup_factor is not None:
        shared = report.group_shared_tokens
        packed = report.unique_tokens - shared
        lines.append(f"tokens: {report.unique_tokens} unique, {report.flat_tokens} flat (dedup ×{report.dedup_factor:.2f})"
                     + (f"; {packed} packed, each query's opening prompt once (×{report.unique_tokens / packed:.2f})"
                        if shared and packed > 0 else ""))
    if report.trajectories_before_cap:
        n = max(report.trained_executions, 1)
        lines.append(f"trajectories per execution: {report.trajectories_before_cap / n:.2f} before the cap, "
                     f"{report.trajectories_after_cap / n:.2f} after; the cap cut {report.capped_executions} "
                     f"executions and left {report.cap_dropped_targets} target tokens untrained")
    if report.branches:
        lines.append("branches: " + ", ".join(f"{k} {v}" for k, v in report.branches.items()))
    if report.forks_by_cause:
        lines.append("forks by cause: " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                                    for k, v in report.forks_by_cause.items()))
    sizes = sorted({r.world_size for r in report.steps if r.world_size is not None})
    if sizes:
        lines.append("trainer world size per step: " + (str(sizes[0]) if len(sizes) == 1 else
                                                        f"{sizes[0]}–{sizes[-1]} (" + " ".join(
                                                            str(r.world_size) for r in report.steps) + ")"))
    by_kind: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in report.switches:
        if s["from_role"] != "idle" and s["seconds"] is not None:
            by_kind[(s["from_role"], s["to_role"])].append(s)
    first_starts = sum(1 for s in report.switches if s["from_role"] == "idle")
    if report.switches:
        lines.append(f"{len(report.switches)} cell switches ({first_starts} first starts)" + "".join(
            f"; {a}→{b} ×{len(v)}, median {_median([s['seconds'] for s in v]):.2f} s"
            + (f" ({sum(1 for s in v if s['warm'])} warm)" if any(s["warm"] is not None for s in v) else "")
            for (a, b), v in sorted(by_kind.items())))
    moved = ", ".join(f"{n} by {m}" for m, n in report.migrations.items()) or "none"
    lines.append(f"sessions moved: {moved}; re-prefill avoided: {report.prefill_tokens_avoided:,} tokens "
                 f"({report.kv_bytes_moved / 2**20:.1f} MiB of KV moved)")
    if report.kv_fallbacks:
        lines.append("KV moves that recomputed: " + "; ".join(f"{n}× {r}" for r, n in report.kv_fallbacks.items()))
    lines.extend(_weight_sync_lines(report))
    lines += [f"left out (cannot run here): {task_id}: {reason}" for task_id, reason in report.tasks_left_out.items()]
    return lines


def _weight_sync_lines(report: RunReport) -> list[str]:
    """Version latency (a step's end → every worker serving its weights) and the generation pause per load."""
    trained = [s for s in report.weight_syncs if s["step"] >= 0 and s["served_s"] is not None]
    if not trained:
        return []
    sizes = sorted({(s["bytes"], s["dtype"]) for s in trained if s["bytes"]})
    size = f" of {sizes[-1][0] / 2**20:.1f} MiB ({sizes[-1][1]})" if sizes else ""
    latency = [s["publish_s"] + s["served_s"] for s in trained]
    pauses = [p for s in trained for p in s["pauses"]]
    line = (f"weight sync: {len(trained)} versions{size}; step end → every worker serving median "
            f"{_median(latency):.2f} s (max {max(latency):.2f}; storing them median "
            f"{_median([s['publish_s'] for s in trained]):.2f} s)")
    if pauses:
        line += f"; generation paused median {_median(pauses):.3f} s a load (max {max(pauses):.3f})"
    lines = [line]
    if report.weights_retired:
        lines.append(f"weights retired: {report.weights_retired} versions, "
                     f"{report.weights_retired_bytes / 2**20:.1f} MiB deleted from the Object Store")
    return lines
