"""Pure pieces of the trainer rank: token accounting and batch validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.trainer.checkpoints import latest_checkpoint
from services.trainer.distributed import GroupSpec, free_port
from services.trainer.engine import BatchMismatch, Trainer, TrainerConfig, flat_token_count
from tests.trainer.trainer_trees import make_batch, pack, random_trajectories, tiny_model


def local_weights(trainer: Trainer) -> dict:  # type: ignore[type-arg]
    """A one-rank trainer's parameters as plain tensors: each group's mesh is its own, so DTensors of two groups
    do not mix."""
    return {k: getattr(v, "to_local", lambda: v)().detach().clone() for k, v in trainer.model.state_dict().items()}


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


def test_a_step_that_failed_part_way_leaves_no_gradient_behind(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A micro-batch that raises after earlier ones ran backward (an OOM, say) fails the step; the bus
    redelivers the batch, and the retry must train every target once, exactly as a clean step does."""
    import torch

    tiny_model("qwen3", seed=1).save_pretrained(tmp_path)
    batch = make_batch(seed=0, step=0)
    assert len(batch.micro_batches) >= 3
    clean, _ = Trainer.start(tmp_path, GroupSpec(rank=0, world_size=1, master_port=free_port()), TrainerConfig())
    try:
        clean.step(batch)
        expected = local_weights(clean)
    finally:
        clean.close()
    retried, _ = Trainer.start(tmp_path, GroupSpec(rank=0, world_size=1, master_port=free_port()), TrainerConfig())
    try:
        real = retried._logprobs
        calls = {"grad": 0}

        def fails_on_the_third_gradient_pass(t):  # type: ignore[no-untyped-def]
            if torch.is_grad_enabled():
                calls["grad"] += 1
                if calls["grad"] == 3:
                    raise RuntimeError("out of memory (simulated)")
            return real(t)

        monkeypatch.setattr(retried, "_logprobs", fails_on_the_third_gradient_pass)
        with pytest.raises(RuntimeError, match="simulated"):
            retried.step(batch)
        retried.step(batch)
        got = local_weights(retried)
        worst = max(float((got[k] - v).abs().max()) for k, v in expected.items())
    finally:
        retried.close()
    assert worst == 0.0


def test_a_checkpoint_before_the_first_step_changes_nothing_and_resume_keeps_the_configured_lr(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Saving an optimiser that has not stepped must not start its state (Adam would count a step too many);
    a resumed trainer trains with the hyperparameters it is configured with, not the checkpoint's."""
    tiny_model("qwen3", seed=1).save_pretrained(tmp_path / "model")
    batch = make_batch(seed=0, step=0)

    def trained(save_first: bool) -> dict:
        root = tmp_path / f"ckpt-{save_first}"
        trainer, _ = Trainer.start(tmp_path / "model", GroupSpec(rank=0, world_size=1, master_port=free_port()),
                                   TrainerConfig(lr=1e-3), checkpoints=root)
        try:
            if save_first:
                trainer.save(root)
                trainer.resume(latest_checkpoint(root))  # what a roll-back to it does
            trainer.step(batch)
            return local_weights(trainer)
        finally:
            trainer.close()

    plain, saved = trained(False), trained(True)
    assert max(float((plain[k] - saved[k]).abs().max()) for k in plain) == 0.0
    resumed, _ = Trainer.start(tmp_path / "model", GroupSpec(rank=0, world_size=1, master_port=free_port()),
                               TrainerConfig(lr=5e-2), checkpoints=tmp_path / "ckpt-True")
    try:
        assert [g["lr"] for g in resumed.optimizer.param_groups] == [5e-2] * len(resumed.optimizer.param_groups)
    finally:
        resumed.close()


def test_run_step_refuses_a_batch_its_checkpoint_already_holds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.trainer.engine import StepAlreadyTrained
    from services.trainer.runner import run_step

    tiny_model("qwen3", seed=1).save_pretrained(tmp_path / "model")
    batch_file = tmp_path / "step0.batch"
    batch_file.write_bytes(make_batch(seed=0, step=0).encode())

    def once() -> dict:
        spec = GroupSpec(rank=0, world_size=1, master_port=free_port())
        return run_step(tmp_path / "model", batch_file, tmp_path / "ckpt", spec, TrainerConfig())

    assert once()["policy_version"] == 1
    with pytest.raises(StepAlreadyTrained, match="step 0"):
        once()
