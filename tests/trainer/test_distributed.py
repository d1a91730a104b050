"""FSDP2 over real gloo process groups: world sizes agree, and a 2 -> 1 -> 2 resize keeps the loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.distributed import balance_micro_batches
from tests.trainer.trainer_dist import run_phases
from tests.trainer.trainer_trees import tiny_model

STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    tiny_model("qwen3", seed=11).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_phases([(2, STEPS)], model_dir, tmp_path_factory.mktemp("w2"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= 2e-5, f"{name} differs by {diff}"


def test_balance_micro_batches_evens_tokens_and_is_deterministic() -> None:
    counts = [100, 10, 60, 50, 40, 30]
    out = balance_micro_batches(counts, 2)
    assert sorted(i for r in out for i in r) == list(range(6))
    loads = [sum(counts[i] for i in r) for r in out]
    assert max(loads) - min(loads) <= 10
    assert out == balance_micro_batches(counts, 2)
    assert balance_micro_batches([5], 3) == [[0], [], []]


def test_two_ranks_and_one_rank_give_same_losses_and_weights(
    two_ranks: dict, model_dir: Path, tmp_path: Path
) -> None:
    one = run_phases([(1, STEPS)], model_dir, tmp_path)
    assert len(one["losses"]) == len(two_ranks["losses"]) == STEPS
    assert one["losses"] == pytest.approx(two_ranks["losses"], rel=1e-5, abs=1e-6)
    # Training moved the weights, so the comparison below is not trivially true.
    start = tiny_model("qwen3", seed=11).state_dict()
    assert max((one["weights"][k] - start[k]).abs().max().item() for k in start) > 1e-3
    _assert_same_weights(one["weights"], two_ranks["weights"])


def test_resize_two_one_two_through_checkpoints_continues_the_loss_curve(
    two_ranks: dict, model_dir: Path, tmp_path: Path
) -> None:
    resized = run_phases([(2, 2), (1, 2), (2, 2)], model_dir, tmp_path)
    assert resized["losses"] == pytest.approx(two_ranks["losses"], rel=1e-5, abs=1e-6)
    _assert_same_weights(resized["weights"], two_ranks["weights"])
    # Re-forms after the first loaded a checkpoint.
    assert [r["world"] for r in resized["reforms"]] == [2, 1, 2]
    assert all(r["load_s"] > 0 for r in resized["reforms"][1:])
