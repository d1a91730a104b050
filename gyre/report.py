"""The run report: training-score curve, per-cell role timeline, tree statistics and switch durations,
computed from a run's events alone (so a report can be rebuilt from the log or an export at any time).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.events import (
    BatchReady,
    CellAssigned,
    CellReady,
    CellReleased,
    Event,
    ExecutionBranched,
    ExecutionScored,
    ExecutionStarted,
    StepCompleted,
)


@dataclass
class StepRow:
    step: int
    mean_reward: float
    pass_rate: float
    executions: int
    loss: float | None = None
    seconds: float | None = None


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
    stale_executions: int = 0  # executions left out of training: generated beyond the staleness bound
    branches: dict[str, int] = field(default_factory=dict)
    unique_tokens: int = 0
    flat_tokens: int = 0
    dedup_factor: float | None = None
    switches: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def build_report(run_id: str, events: Sequence[Event]) -> RunReport:
    """Fold a run's events (in log order) into its report. Pure."""
    report = RunReport(run_id=run_id)
    step_of: dict[str, int] = {}
    rewards: dict[int, list[float]] = defaultdict(list)
    losses: dict[int, tuple[float | None, float]] = {}
    branches: dict[str, int] = defaultdict(int)
    role_since: dict[str, tuple[str, float]] = {}
    t0 = events[0].occurred_at if events else None

    def t(event: Event) -> float:
        assert t0 is not None
        return (event.occurred_at - t0).total_seconds()

    for event in events:
        data = event.data
        if isinstance(data, ExecutionStarted):
            step_of[data.execution_id] = data.step
        elif isinstance(data, ExecutionScored):
            report.executions += 1
            report.timed_out += int(data.timed_out)
            if data.infra_failure is not None:
                report.infra_failures += 1
            else:
                rewards[step_of.get(data.execution_id, 0)].append(data.reward)
        elif isinstance(data, ExecutionBranched):
            branches[data.kind] += 1
        elif isinstance(data, BatchReady):
            report.unique_tokens += data.unique_tokens
            report.flat_tokens += data.flat_tokens
            report.stale_executions += data.stale_executions
        elif isinstance(data, StepCompleted):
            losses[data.step] = (data.metrics.get("loss"), data.seconds)
        elif isinstance(data, CellAssigned):
            _close_segment(report, role_since, data.cell_id, t(event))
            role_since[data.cell_id] = (f"{data.role} (switching)", t(event))
        elif isinstance(data, CellReady):
            _close_segment(report, role_since, data.cell_id, t(event))
            role_since[data.cell_id] = (data.role, t(event))
            report.switches.append({"cell_id": data.cell_id, "role": data.role, "seconds": data.switch_seconds})
        elif isinstance(data, CellReleased):
            pass
    end = t(events[-1]) if events else 0.0
    for cell_id in list(role_since):
        _close_segment(report, role_since, cell_id, end)
    for step in sorted(rewards):
        values = rewards[step]
        loss, seconds = losses.get(step, (None, None))
        report.steps.append(
            StepRow(
                step=step,
                mean_reward=sum(values) / len(values),
                pass_rate=sum(1 for v in values if v >= 1.0) / len(values),
                executions=len(values),
                loss=loss,
                seconds=seconds,
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
    if report.unique_tokens:
        report.dedup_factor = report.flat_tokens / report.unique_tokens
    report.wall_s = end
    return report


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _close_segment(report: RunReport, open_: dict[str, tuple[str, float]], cell_id: str, now: float) -> None:
    if cell_id in open_:
        role, since = open_.pop(cell_id)
        if now > since:
            report.timeline.append({"cell_id": cell_id, "role": role, "start_s": since, "end_s": now})


def write_report(report: RunReport, out_dir: Path) -> list[Path]:
    """report.json plus PNGs: the training-score curve and the per-cell timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "report.json"]
    written[0].write_text(report.to_json())

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r.step for r in report.steps]
    ax.plot(steps, [r.mean_reward for r in report.steps], marker="o", label="mean group reward")
    ax.plot(steps, [r.pass_rate for r in report.steps], marker="s", linestyle="--", label="pass rate")
    if len(steps) >= 6:
        means = [r.mean_reward for r in report.steps]
        smooth = [_mean(means[max(0, i - 2) : i + 1]) for i in range(len(means))]
        ax.plot(steps, smooth, color="black", linewidth=2, label="mean reward, 3-step average")
    ax.set_xlabel("RL step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Training score — {report.run_id}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_dir / "training_curve.png", dpi=120)
    plt.close(fig)
    written.append(out_dir / "training_curve.png")

    cells = sorted({seg["cell_id"] for seg in report.timeline})
    if cells:
        colours = {"rollout": "tab:blue", "train": "tab:orange", "idle": "lightgrey"}
        fig, ax = plt.subplots(figsize=(7, 0.6 * len(cells) + 1.2))
        for y, cell in enumerate(cells):
            for seg in (s for s in report.timeline if s["cell_id"] == cell):
                role = seg["role"].split(" ")[0]
                hatch = "//" if "switching" in seg["role"] else None
                ax.barh(y, seg["end_s"] - seg["start_s"], left=seg["start_s"], color=colours.get(role, "grey"),
                        hatch=hatch, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(cells)), cells)
        ax.set_xlabel("seconds since the run started")
        ax.set_title("Cell roles (blue rollout, orange train, hatched: switching)")
        fig.tight_layout()
        fig.savefig(out_dir / "cell_timeline.png", dpi=120)
        plt.close(fig)
        written.append(out_dir / "cell_timeline.png")
    return written


def summary_lines(report: RunReport) -> list[str]:
    lines = [f"run {report.run_id}: {len(report.steps)} steps, {report.executions} executions "
             f"({report.timed_out} timed out"
             + (f", {report.infra_failures} ended by infrastructure" if report.infra_failures else "")
             + (f", {report.stale_executions} left out as too stale" if report.stale_executions else "")
             + f") in {report.wall_s or 0:.0f} s"]
    if report.reward_gain is not None:
        lines.append(f"mean reward {report.reward_first:.3f} → {report.reward_last:.3f} ({report.reward_gain:+.3f})")
        lines.append(
            f"first {min(3, max(1, len(report.steps) // 3))} steps {report.reward_head:.3f} → "
            f"last {report.reward_tail:.3f}; pass rate {report.steps[0].pass_rate:.2f} → {report.steps[-1].pass_rate:.2f}"
        )
    if report.dedup_factor is not None:
        lines.append(f"tokens: {report.unique_tokens} unique, {report.flat_tokens} flat (dedup ×{report.dedup_factor:.2f})")
    if report.branches:
        lines.append("branches: " + ", ".join(f"{k} {v}" for k, v in report.branches.items()))
    if report.switches:
        mean = sum(s["seconds"] for s in report.switches) / len(report.switches)
        lines.append(f"{len(report.switches)} role switches, mean {mean:.2f} s")
    return lines
