"""Experiment trackers: each completed step's metrics and the run's config to W&B and TensorBoard, when the
config names them (`logging.trackers`); none is required.

A step is logged once, when its `step.completed` is in the log, with the report's names (`StepRow`: mean_reward,
pass_rate, executions, loss, seconds, world_size) and the trainer's own metrics of that step (clip_fraction,
is_weight_mean, grad_norm, ...), under the step number. W&B runs offline by default (its files under the run
folder; `wandb sync` uploads them later) and takes the run id as its own, so a resumed run continues the same
W&B run; TensorBoard writes event files under `runs/<run id>/tensorboard/`. What was logged is remembered in
`runs/<run id>/trackers.json`, so a resumed run logs only the steps after it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from gyre.report import build_report
from shared.events import Event, StepCompleted

PROGRESS = "trackers.json"


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TrackerUnavailable(RuntimeError):
    """A tracker the config names is not installed."""


class WandbTracker:
    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any], *, project: str,
                 mode: Literal["offline", "online"]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise TrackerUnavailable("logging.trackers names wandb, which is not installed (pip install "
                                     "'gyre[trackers]')") from exc
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=project, id=run_id, name=run_id, dir=str(run_dir), mode=mode, config=config,
                              resume="allow", reinit="finish_previous")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackerUnavailable("logging.trackers names tensorboard, which is not installed (pip install "
                                     "'gyre[trackers]')") from exc
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def step_metrics(run_id: str, events: Sequence[Event]) -> dict[int, dict[str, float]]:
    """Each completed step's metrics: the report's row, then the trainer's own (finite numbers only)."""
    rows = {row.step: row for row in build_report(run_id, events).steps}
    trained = {e.data.step: e.data.metrics for e in events if isinstance(e.data, StepCompleted)}
    out: dict[int, dict[str, float]] = {}
    for step, own in sorted(trained.items()):
        metrics: dict[str, float] = {}
        row = rows.get(step)
        if row is not None:
            for name in ("mean_reward", "pass_rate", "executions", "loss", "seconds", "world_size"):
                value = getattr(row, name)
                if value is not None:
                    metrics[name] = float(value)
        for name, value in own.items():
            metrics.setdefault(name, float(value))
        out[step] = {k: v for k, v in metrics.items() if math.isfinite(v)}
    return out


class Trackers:
    """The trackers a run's config names, fed from the log as the launcher reads it."""

    def __init__(self, names: Sequence[str], run_dir: Path, run_id: str, config: dict[str, Any], *,
                 project: str = "gyre", mode: Literal["offline", "online"] = "offline") -> None:
        self.run_dir, self.run_id = run_dir, run_id
        self.trackers: list[Tracker] = []
        for name in names:
            if name == "wandb":
                self.trackers.append(WandbTracker(run_dir, run_id, config, project=project, mode=mode))
            elif name == "tensorboard":
                self.trackers.append(TensorBoardTracker(run_dir, config))
        progress = run_dir / PROGRESS
        self.logged = set(json.loads(progress.read_text())["steps"]) if progress.is_file() else set()
        self._completed = 0

    def update(self, events: Sequence[Event]) -> None:
        """Log every step completed since the last call (cheap when none was)."""
        completed = sum(1 for e in events if e.type == "step.completed")
        if not self.trackers or completed == self._completed:
            return
        self._completed = completed
        for step, metrics in step_metrics(self.run_id, events).items():
            if step in self.logged:
                continue
            for tracker in self.trackers:
                tracker.log(step, metrics)
            self.logged.add(step)
        (self.run_dir / PROGRESS).write_text(json.dumps({"steps": sorted(self.logged)}))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


__all__ = ["Trackers", "TrackerUnavailable", "step_metrics"]
