"""`gyre eval`'s pieces that need no engine: the scores, the newest checkpoint, and a trainer checkpoint exported
as a model folder the rollout worker loads (the whole path, served and graded, runs in tests/e2e/test_compare.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from gyre.eval import EvalError, export_checkpoint, latest_checkpoint, mean_score, pass_at_1
from gyre.tinymodel import create_tiny_model


def test_pass_at_1_is_the_mean_over_tasks_of_the_share_of_samples_that_pass() -> None:
    scores = {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.5, 0.0, 0.0, 0.0]}
    assert pass_at_1(scores) == pytest.approx((3 / 4 + 0) / 2)
    assert mean_score(scores) == pytest.approx(3.5 / 8)
    assert pass_at_1({}) == 0.0 and mean_score({}) == 0.0


def test_the_latest_checkpoint_is_the_newest_complete_one(tmp_path: Path) -> None:
    for step, done in ((1, True), (2, True), (3, False)):
        folder = tmp_path / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        if done:
            (folder / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000002"
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_a_trainer_checkpoint_exports_as_a_model_folder_with_its_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = create_tiny_model(tmp_path / "base", seed=0, size="tiny")
    trained = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)
    checkpoint = tmp_path / "step-00000003"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(checkpoint))
    out = export_checkpoint(base, checkpoint, tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(loaded.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
    assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())
    other = create_tiny_model(tmp_path / "other", seed=1, size="small")
    with pytest.raises(EvalError, match="not a checkpoint of"):
        export_checkpoint(other, checkpoint, tmp_path / "wrong")


def test_eval_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    from gyre.cli import app, _mount

    _mount("eval")
    result = CliRunner().invoke(app, ["eval"])
    assert result.exit_code == 2 and "give --run RUN_ID or --model DIR" in result.output
    result = CliRunner().invoke(app, ["eval", "--run", "run-nope", "--config", "configs/long-horizon.yaml"])
    assert result.exit_code == 2 and "no runs/run-nope/run.json" in result.output
