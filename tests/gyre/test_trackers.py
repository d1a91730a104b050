"""Experiment trackers (gyre/trackers.py): each completed step, once, with the report's names and the trainer's
metrics, to an offline W&B run and TensorBoard event files under the run folder, read back here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gyre.trackers import Trackers, TrackerUnavailable, step_metrics
from shared.events import StepCompleted

from .test_report import run_events
from .tracker_files import tensorboard_scalars, wandb_run


def _with_trainer_metrics(events):  # type: ignore[no-untyped-def]
    """The report's run, its steps carrying more of the trainer's own metrics."""
    out = []
    for event in events:
        if isinstance(event.data, StepCompleted):
            data = event.data.model_copy(update={"metrics": {**event.data.metrics, "clip_fraction": 0.25,
                                                             "grad_norm": float("nan")}})
            event = event.model_copy(update={"data": data})
        out.append(event)
    return out


def test_each_step_goes_to_both_trackers_once_with_the_reports_names(tmp_path: Path) -> None:
    events = _with_trainer_metrics(run_events())
    first_step_only = events[: next(i for i, e in enumerate(events) if e.type == "step.completed") + 1]
    trackers = Trackers(["wandb", "tensorboard"], tmp_path, "run-trk", {"seed": 7, "model": {"path": "tiny"}})
    trackers.update(first_step_only)
    trackers.update(first_step_only)  # nothing new: nothing logged again
    trackers.update(events)
    trackers.close()

    expected = step_metrics("run-trk", events)
    assert set(expected) == {0, 1} and expected[1]["mean_reward"] == 0.875 and expected[1]["clip_fraction"] == 0.25
    assert "grad_norm" not in expected[1]  # not a finite number: left out rather than logged as NaN
    rows, config = wandb_run(tmp_path)
    assert [row["_step"] for row in rows] == [0, 1]
    for row in rows:
        assert {k: row[k] for k in expected[row["_step"]]} == pytest.approx(expected[row["_step"]])
    assert config["seed"] == 7 and config["model"] == {"path": "tiny"}
    scalars = tensorboard_scalars(tmp_path)
    assert set(scalars) == set(expected[1])
    assert scalars["mean_reward"] == [(0, 0.5), (1, 0.875)] and [s for s, _ in scalars["clip_fraction"]] == [0, 1]

    # Resumed: a new launcher over the same run folder logs only the steps after those already logged.
    again = Trackers(["tensorboard"], tmp_path, "run-trk", {"seed": 7})
    again.update(events)
    again.close()
    assert [s for s, _ in tensorboard_scalars(tmp_path)["mean_reward"]] == [0, 1]


def test_a_tracker_that_is_not_installed_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now fails
    with pytest.raises(TrackerUnavailable, match=r"names wandb, which is not installed \(pip install"):
        Trackers(["wandb"], tmp_path, "run-x", {})
    assert Trackers([], tmp_path, "run-x", {}).trackers == []
