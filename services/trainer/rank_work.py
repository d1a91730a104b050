"""A rank's torch side, run on one thread of its own (rank.py keeps NATS answering meanwhile): the base model kept
warm while the rank stands by, and `form`, `step`, `leave`, `publish` on the group it is in.

A rank holds no state the checkpoint does not: `form` builds the sharded model afresh and loads the latest
checkpoint (DCP reshards it to this group), and a step that fails leaves the rank refusing steps until it is
formed again, so its in-memory weights (moved, not saved) are never trained on.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.checkpoints import CheckpointStore, open_checkpoints
from services.trainer.distributed import GroupSpec, balance_micro_batches, group_store, leave_group, timed
from services.trainer.engine import PublishedShards, Trainer, TrainerConfig, load_model
from services.trainer.loss import GspoConfig
from services.trainer.protocol import FormReply, FormRequest, StepReply, StepRequest, TrainerSpec, TrainerState
from shared.batch import TrainingBatch


class RankWorkError(Exception):
    pass


class NotInGroup(RankWorkError):
    """A step or publication for a generation this rank is not (or no longer) formed in."""


def trainer_config(spec: TrainerSpec) -> TrainerConfig:
    return TrainerConfig(
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        grad_clip=spec.grad_clip,
        precision=spec.precision,
        loss=GspoConfig(eps_low=spec.eps_low, eps_high=spec.eps_high, is_cap=spec.is_cap),
        recompute_old_logprobs=spec.recompute_old_logprobs,
        publish_dtype=spec.publish_dtype,
        shard_bytes=spec.shard_bytes,
    )


def trainer_state(state: dict[str, Any], first_step: int) -> TrainerState:
    """The protocol's view of a checkpoint's `trainer_state.json`."""
    return TrainerState(
        last_step=int(state.get("last_step", first_step - 1)),
        step_count=int(state["step_count"]),
        policy_version=int(state["policy_version"]),
        metrics={k: float(v) for k, v in state.get("metrics", {}).items()},
        seconds=float(state.get("seconds", 0.0)),
        world_size=int(state.get("world_size", 1)),
    )


class RankWork:
    """Everything a rank does with torch. Not thread-safe: one thread calls it (rank.py's torch executor)."""

    def __init__(self, model_dir: Path, checkpoints: Callable[[str], CheckpointStore] = open_checkpoints) -> None:
        self.model_dir = Path(model_dir)
        self.checkpoints = checkpoints  # a form's checkpoint root → its store (rank.py's reaches the Object Store)
        self.template: torch.nn.Module | None = None  # the unsharded base model, built once while standing by
        self.trainer: Trainer | None = None
        self.form_request: FormRequest | None = None  # the group it is in
        self.intact = False  # False after a failed step: its weights moved without a checkpoint

    @property
    def generation(self) -> int | None:
        return self.form_request.generation if self.form_request is not None and self.trainer is not None else None

    def warm(self) -> None:
        """What can be built before any group exists: torch and transformers imported, the base model loaded."""
        self.template = load_model(self.model_dir)
        self.template.train()

    def leave(self) -> None:
        """Out of any group, back to standing by. No barrier: a peer may be gone."""
        self.trainer = None
        self.form_request = None
        self.intact = False
        leave_group(barrier=False)
        gc.collect()  # the sharded model and optimiser state (on a GPU, memory the cell's other role needs)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def form(self, request: FormRequest) -> FormReply:
        """Leave the old group, join `request.generation` through the coordinator's store, build the sharded model
        and load the latest checkpoint; before any checkpoint exists the group saves its starting weights, so there
        is always a state to re-form from."""
        self.leave()
        spec = GroupSpec(rank=request.rank, world_size=request.world_size, timeout_s=request.timeout_s)
        store = group_store(request.store_host, request.store_port, request.generation, request.timeout_s)
        trainer, timing = Trainer.start(
            self.model_dir, spec, trainer_config(request.trainer), store=store, template=self.template
        )
        saved = self.checkpoints(request.checkpoint_root)
        # Rank 0 picks the step every member loads: members listing the store each would disagree on a step
        # being committed or pruned at that moment, and load different ones (or some save while others load).
        newest = [saved.complete()[-1:] if trainer.rank == 0 else None]
        dist.broadcast_object_list(newest, src=0)
        done: list[int] = newest[0] or []
        if not done:
            # The model alone (an optimiser that has not stepped is saved as such: the first step is Adam's first).
            state, load_s = timed(trainer.save, saved, request.keep_checkpoints,
                                  {"last_step": request.first_step - 1})
        else:
            state, load_s = timed(trainer.resume_from, saved, done[-1])
        self.trainer, self.form_request, self.intact = trainer, request, True
        return FormReply(
            rank_id=request.rank_id,
            generation=request.generation,
            phases={"group_s": timing.group_s, "build_s": timing.build_s, "load_s": load_s},
            state=trainer_state(state, request.first_step),
        )

    def _formed(self, generation: int) -> tuple[Trainer, FormRequest]:
        if self.trainer is None or self.form_request is None:
            raise NotInGroup(f"asked for generation {generation}, but this rank stands by in no group")
        if self.form_request.generation != generation:
            raise NotInGroup(f"asked for generation {generation}, this rank is in {self.form_request.generation}")
        if not self.intact:
            raise NotInGroup(f"generation {generation}'s last step failed here; the group must form again")
        return self.trainer, self.form_request

    def step(self, request: StepRequest, batch_bytes: bytes, rank_id: str) -> tuple[StepReply, PublishedShards | None]:
        """Train the batch, checkpoint it (every rank, collectively) and, when the step publishes, gather the full
        weights (rank 0 gets the bytes). The checkpoint holds the step's metrics, for a re-emit after a crash."""
        trainer, formed = self._formed(request.generation)
        batch = TrainingBatch.decode(batch_bytes)
        if batch.step != request.step:
            raise RankWorkError(f"the step request says step {request.step}, the batch blob holds step {batch.step}")
        self.intact = False  # until the checkpoint holds what the step did to the weights
        started = time.perf_counter()
        metrics = trainer.step(batch)
        seconds = time.perf_counter() - started
        metrics["staleness_bound_violations"] = float(metrics["staleness_max"] > request.max_staleness)
        _, checkpoint_s = timed(trainer.save, self.checkpoints(formed.checkpoint_root), formed.keep_checkpoints,
                                {"last_step": request.step, "metrics": metrics, "seconds": seconds})
        self.intact = True
        weights = trainer.weights_shards() if request.publish else None
        counts = [mb.num_tokens for mb in batch.micro_batches]
        mine = balance_micro_batches(counts, trainer.world_size)[trainer.rank]
        reply = StepReply(
            rank_id=rank_id, rank=trainer.rank, metrics=metrics, micro_batches=len(mine),
            tokens=sum(counts[i] for i in mine), seconds=seconds, checkpoint_s=checkpoint_s,
            step_count=trainer.step_count, policy_version=trainer.policy_version,
        )
        return reply, weights

    def publish(self, generation: int) -> PublishedShards | None:
        """The weights the group holds (a collective; the shards on rank 0)."""
        trainer, _ = self._formed(generation)
        return trainer.weights_shards()


__all__ = ["NotInGroup", "RankWork", "RankWorkError", "trainer_config", "trainer_state"]
