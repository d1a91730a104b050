"""Pure pieces of the trainer rank: token accounting and batch validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.trainer.distributed import GroupSpec, free_port
from services.trainer.engine import BatchMismatch, Trainer, TrainerConfig, flat_token_count
from tests.trainer.trainer_trees import make_batch, pack, random_trajectories, tiny_model


def test_flat_token_count_is_the_sum_of_trajectory_lengths() -> None:
    trajs = random_trajectories(np.random.default_rng(0), executions=3, branches=5, vocab=97)
    mb, _ = pack(trajs)
    distinct = {(t.execution, tuple(s.token for s in t.steps)) for t in trajs}
    assert flat_token_count(mb) == sum(len(toks) for _, toks in distinct)
    assert mb.num_tokens < flat_token_count(mb)


def test_batch_whose_declared_target_counts_disagree_is_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tiny_model("qwen3", seed=1).save_pretrained(tmp_path)
    batch = make_batch(seed=0, step=0)
    wrong = dataclasses.replace(
        batch,
        executions=[dataclasses.replace(batch.executions[0], num_targets=batch.executions[0].num_targets + 1),
                    *batch.executions[1:]],
    )
    trainer, _ = Trainer.start(tmp_path, GroupSpec(rank=0, world_size=1, master_port=free_port()), TrainerConfig())
    try:
        with pytest.raises(BatchMismatch, match="declares"):
            trainer.step(wrong)
        metrics = trainer.step(batch)
        assert metrics["flat_tokens"] > metrics["unique_tokens"] > 0
        assert metrics["executions"] == len(batch.executions)
    finally:
        trainer.close()
