"""The trainer rank: a sharded model and optimizer that turn tree-packed batches into optimiser steps.

Every rank of the group holds the same TrainingBatch, takes its share of the micro-batches (balanced by
tokens) and runs the same number of forward/backward passes so FSDP's collectives stay in step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from services.trainer.checkpoints import CheckpointStore, as_store, load_checkpoint, save_checkpoint
from services.trainer.distributed import (
    GroupSpec,
    Precision,
    ReformTiming,
    apply_fsdp,
    balance_micro_batches,
    discard_gradients,
    full_state_dict,
    init_group,
    leave_group,
    set_gradient_sync,
    timed,
)
from services.trainer.loss import GspoConfig, GspoStats, GspoStep, execution_log_ratio_sums, gspo_metrics, gspo_pass
from services.trainer.packed_forward import DEFAULT_FLEX_THRESHOLD, PackedTensors, packed_logprobs, to_tensors
from shared.batch import MicroBatch, TrainingBatch
from shared.weights import DEFAULT_SHARD_BYTES, PublishDtype, encode_shards, resolve_dtype


# A real pass's loss from its index, its tensors and its logprobs (what `Trainer._optimiser_step` backpropagates).
PassLoss = Callable[[int, PackedTensors, torch.Tensor], torch.Tensor]


class TrainerError(Exception):
    pass


class StepAlreadyTrained(TrainerError):
    """A batch for a step the checkpoint already holds: training it again would apply it twice."""


class BatchMismatch(TrainerError):
    pass


@dataclass(frozen=True)
class PublishedShards:
    """A publication as rank 0 holds it: the full weights, encoded into shards (safetensors bytes and tensor
    count each, in load order; shared/weights.py) only as they are stored, so encoding the next shard overlaps
    storing the last and one shard's bytes exist at a time."""

    state_dict: dict[str, torch.Tensor]
    dtype: torch.dtype
    shard_bytes: int
    skip: tuple[str, ...] = ()  # tensors left out (a tied lm_head)
    seconds: float = 0.0  # gathering the full weights (a collective)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def shards(self) -> Iterator[tuple[bytes, int]]:
        return encode_shards(self.state_dict, self.dtype, self.shard_bytes, skip=self.skip)


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: Precision = "auto"
    flex_threshold: int = DEFAULT_FLEX_THRESHOLD
    loss: GspoConfig = field(default_factory=GspoConfig)
    recompute_old_logprobs: bool = False  # False: pi_old = mu (the behaviour logprobs)
    seed: int = 0
    publish_dtype: PublishDtype = "auto"  # the published weights' dtype; auto: the model's own (shared/weights.py)
    shard_bytes: int = DEFAULT_SHARD_BYTES


def flat_token_count(mb: MicroBatch) -> int:
    """Tokens the micro-batch would cost unpacked: every token once per root-to-leaf path through it."""
    n = mb.num_tokens
    if n == 0:
        return 0
    idx = np.arange(n)
    is_leaf = (mb.subtree_end == idx + 1).astype(np.int64)
    leaves_before = np.concatenate([[0], np.cumsum(is_leaf)])
    return int((leaves_before[mb.subtree_end] - leaves_before[idx]).sum())


def _dummy_batch(device: torch.device) -> PackedTensors:
    # A 1-token sequence without targets: keeps a rank with fewer micro-batches in the collectives.
    z = torch.zeros(1, dtype=torch.long, device=device)
    e = z[:0]
    return PackedTensors(
        input_ids=z[None],
        position_ids=z[None],
        subtree_end=torch.ones(1, dtype=torch.long, device=device),
        target_pos=e,
        pred_pos=e,
        labels=e,
        behaviour_logprob=torch.zeros(0, device=device),
        policy_version=e,
        target_exec=e,
    )


def load_model(model_dir: Path) -> torch.nn.Module:
    """The base model, unsharded, fp32, on CPU (what a rank builds its sharded model from)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # services log JSON; a progress bar on stderr is noise
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model


def _to_float(t: Any) -> float:
    full = getattr(t, "full_tensor", None)
    return float(full() if full is not None else t)


class Trainer:
    """One rank. Build with `Trainer.start(...)`; `step(batch)` trains; `save`/`resume` go through DCP."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        config: TrainerConfig,
        model_dir: Path,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.config = config
        self.compute_dtype = compute_dtype  # what the sharded model computes in (distributed.apply_fsdp)
        self.model_dir = Path(model_dir)
        self.device = torch.device(mesh.device_type)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.step_count = 0  # optimiser steps taken; the next batch trained is step `step_count`
        self.policy_version = 0  # version of the current weights (0 = initial)

    # -------------------------------------------------------------------------------------------- setup

    @classmethod
    def start(
        cls,
        model_dir: Path,
        spec: GroupSpec,
        config: TrainerConfig,
        checkpoints: CheckpointStore | Path | None = None,
        *,
        store: dist.Store | None = None,
        template: torch.nn.Module | None = None,
    ) -> tuple[Trainer, ReformTiming]:
        """Join the process group (through `store` when given, else `spec`'s address), build the sharded model
        (from a copy of `template`, the unsharded model a standing-by rank keeps, else from `model_dir`), and
        resume from the latest checkpoint if any."""
        mesh, group_s = timed(init_group, spec, store)
        trainer, build_s = timed(cls.build, model_dir, mesh, config, template)
        load_s = 0.0
        if checkpoints is not None:
            saved = as_store(checkpoints)
            if done := saved.complete():
                _, load_s = timed(trainer.resume_from, saved, done[-1])
        return trainer, ReformTiming(group_s=group_s, build_s=build_s, load_s=load_s)

    @classmethod
    def build(
        cls, model_dir: Path, mesh: DeviceMesh, config: TrainerConfig, template: torch.nn.Module | None = None
    ) -> Trainer:
        torch.manual_seed(config.seed)
        # `fully_shard` turns the module's parameters into shards in place, so each group gets its own copy.
        model: Any = copy.deepcopy(template) if template is not None else load_model(model_dir)
        model.to(torch.device(mesh.device_type))
        model.train()
        compute_dtype = apply_fsdp(model, mesh, config.precision)
        return cls(model, mesh, config, model_dir, compute_dtype)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def close(self, *, barrier: bool = True) -> None:
        leave_group(barrier=barrier)

    # ---------------------------------------------------------------------------------------- training

    def _local_passes(self, micro_batches: list[MicroBatch]) -> list[tuple[PackedTensors, bool]]:
        assignment = balance_micro_batches([mb.num_tokens for mb in micro_batches], self.world_size)
        mine = [to_tensors(micro_batches[i], self.device) for i in assignment[self.rank]]
        passes = max(len(a) for a in assignment)
        return [(t, True) for t in mine] + [(_dummy_batch(self.device), False)] * (passes - len(mine))

    def _logprobs(self, t: PackedTensors) -> torch.Tensor:
        return packed_logprobs(
            self.model, t, flex_threshold=self.config.flex_threshold, compute_dtype=self.compute_dtype
        )

    def _all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t

    @contextmanager
    def _discarding_gradients_on_failure(self) -> Iterator[None]:
        """Around a step's backward passes and optimiser step. Should a pass fail part-way (an OOM in one
        micro-batch, say), the gradients the earlier passes accumulated are dropped, so that the batch's
        redelivery trains every target once, not the first passes' targets twice."""
        try:
            yield
        except BaseException:
            discard_gradients(self.model)
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def _optimiser_step(self, passes: list[tuple[PackedTensors, bool]], loss_of: PassLoss) -> tuple[float, float]:
        """The frame every optimiser step shares: forward and backward each pass (gradient sync on the last only),
        clip, step, zero the gradients, and advance `step_count` and `policy_version`. `loss_of` gives a real
        pass's loss from its logprobs; a dummy pass backpropagates `lp.sum()`: zero, but connected to every
        parameter, so FSDP's collectives stay in step. Returns the loss summed over passes and ranks, and the
        gradient norm."""
        scale = float(self.world_size)  # FSDP averages gradients over ranks; the loss is a sum over them
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with self._discarding_gradients_on_failure():
            for i, (t, real) in enumerate(passes):
                set_gradient_sync(self.model, i == len(passes) - 1)
                lp = self._logprobs(t)
                loss = loss_of(i, t, lp) if real else lp.sum()
                (loss * scale).backward()
                loss_sum += loss.detach().double()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._all_reduce(loss_sum)
        self.step_count += 1
        self.policy_version += 1
        return float(loss_sum), _to_float(grad_norm)

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """One GSPO optimiser step over the whole batch (all ranks call it with the same batch)."""
        num_exec = len(batch.executions)
        counts_np = np.zeros(num_exec, dtype=np.int64)
        spans = np.zeros(num_exec, dtype=np.int64)
        for mb in batch.micro_batches:
            mb.validate(num_exec)
            present = np.bincount(mb.target_exec, minlength=num_exec)
            counts_np += present
            spans += present > 0
        declared = np.array([e.num_targets for e in batch.executions], dtype=np.int64)
        if not np.array_equal(counts_np, declared):
            bad = int(np.flatnonzero(counts_np != declared)[0])
            raise BatchMismatch(
                f"execution {batch.executions[bad].execution_id} declares {declared[bad]} targets, "
                f"the micro-batches hold {counts_np[bad]}"
            )
        dev = self.device
        passes = self._local_passes(batch.micro_batches)

        # s_e needs every target of e. When an execution spans micro-batches (or pi_old is recomputed), a
        # no-grad pass at the step's starting weights gives the per-execution sums, all-reduced over ranks.
        recompute = self.config.recompute_old_logprobs
        old: list[torch.Tensor | None] = [None] * len(passes)  # per pass: pi_old, when not mu
        ratio_sums: torch.Tensor | None = None
        if recompute or bool((spans > 1).any()):
            ratio_sums = torch.zeros(num_exec, dtype=torch.float64, device=dev)
            with torch.no_grad():
                for i, (t, real) in enumerate(passes):
                    lp = self._logprobs(t)
                    if real:
                        pi_old = old[i] = lp if recompute else t.behaviour_logprob
                        ratio_sums += execution_log_ratio_sums(lp, pi_old, t.target_exec, num_exec)
            self._all_reduce(ratio_sums)

        gspo = GspoStep(
            advantages=torch.tensor([e.advantage for e in batch.executions], dtype=torch.float32, device=dev),
            exec_num_targets=torch.from_numpy(counts_np).to(dev),
            num_executions=int((counts_np > 0).sum()),
            log_ratio_sums=ratio_sums,
            trainer_version=self.policy_version,
            config=self.config.loss,
        )
        per_pass: list[GspoStats] = []

        def loss_of(i: int, t: PackedTensors, lp: torch.Tensor) -> torch.Tensor:
            recomputed = old[i]
            pi_old = recomputed if recomputed is not None else t.behaviour_logprob
            loss, stats = gspo_pass(gspo, lp, pi_old, t.behaviour_logprob, t.target_exec, t.policy_version)
            per_pass.append(stats)
            return loss

        loss, grad_norm = self._optimiser_step(passes, loss_of)
        stats = GspoStats.zeros(num_exec, dev)
        for pass_stats in per_pass:
            stats = stats.merge(pass_stats)
        self._all_reduce(stats.totals)
        self._all_reduce(stats.log_ratio_sums)
        self._all_reduce(stats.maxima, dist.ReduceOp.MAX)
        return {
            "loss": loss,
            **gspo_metrics(gspo, stats),
            "grad_norm": grad_norm,
            "unique_tokens": float(sum(mb.num_tokens for mb in batch.micro_batches)),
            "flat_tokens": float(batch.meta.get("flat_tokens", sum(flat_token_count(mb) for mb in batch.micro_batches))),
            "target_tokens": stats.targets,
            "executions": float(gspo.num_executions),
            "micro_batches": float(len(batch.micro_batches)),
            "world_size": float(self.world_size),
        }

    def sft_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """One cross-entropy step: mean over every unique target token of -log p (same packing and FSDP)."""
        total_targets = sum(mb.num_targets for mb in micro_batches)
        if total_targets == 0:
            raise TrainerError("an SFT step needs at least one target token; the micro-batches hold none")
        loss, grad_norm = self._optimiser_step(
            self._local_passes(micro_batches), lambda i, t, lp: -lp.sum() / total_targets
        )
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "target_tokens": float(total_targets),
            "unique_tokens": float(sum(mb.num_tokens for mb in micro_batches)),
        }

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Per-target logprobs of every micro-batch (each rank computes its share; results gathered to all)."""
        passes = self._local_passes(micro_batches)
        assignment = balance_micro_batches([mb.num_tokens for mb in micro_batches], self.world_size)
        local = [self._logprobs(t).cpu() for t, real in passes if real]
        gathered: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            for t, real in passes:
                if not real:
                    self._logprobs(t)
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        out: list[torch.Tensor] = [torch.empty(0)] * len(micro_batches)
        for rank, idxs in enumerate(assignment):
            for j, idx in enumerate(idxs):
                out[idx] = gathered[rank][j]
        return out

    # ------------------------------------------------------------------------------------- checkpoints

    def trainer_state(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "policy_version": self.policy_version}

    def save(self, checkpoints: CheckpointStore | Path, keep: int = 2, extra: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        """Checkpoint this step (a collective); returns the state file's contents."""
        store = as_store(checkpoints)
        state = {**self.trainer_state(), **(extra or {})}
        return save_checkpoint(store, self.step_count, self.model, self.optimizer, state, keep=keep)

    def resume_from(self, checkpoints: CheckpointStore, step: int) -> dict[str, Any]:
        """Resume from a step of a checkpoint store, fetched to this node first where the store is remote."""
        try:
            return self.resume(checkpoints.fetch(step))
        finally:
            checkpoints.release()

    def resume(self, path: Path) -> dict[str, Any]:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step_count = int(state["step_count"])
        self.policy_version = int(state["policy_version"])
        # The checkpoint brings the optimiser's moments and step counts, and also the hyperparameters it was
        # saved with; the ones configured now are the ones to train with.
        for group in self.optimizer.param_groups:
            group.update(lr=self.config.lr, betas=self.config.betas, eps=self.config.adam_eps,
                         weight_decay=self.config.weight_decay)
        return state

    # ------------------------------------------------------------------------------------- publication

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on CPU; a collective (every rank calls it), non-empty on rank 0 only."""
        sd = full_state_dict(self.model)
        return sd if self.rank == 0 else {}

    def weights_bytes(self) -> bytes | None:
        """The full weights as one safetensors file on rank 0 (None elsewhere), in the trainer's dtype: what a
        model directory holds (weights.py)."""
        from services.trainer.weights import safetensors_bytes

        sd = self.full_weights()
        if self.rank != 0:
            return None
        return safetensors_bytes(sd, self.model.config)

    def weights_shards(self) -> PublishedShards | None:
        """The full weights for the publication on rank 0 (None elsewhere), to be cast to the publish dtype and
        cut between layers as they are stored. A collective: every rank calls it."""
        started = time.perf_counter()
        sd = self.full_weights()
        if self.rank != 0:
            return None
        config = self.model.config
        dtype = resolve_dtype(self.config.publish_dtype, getattr(config, "dtype", None))
        # Tied to embed_tokens: HF and vLLM rebuild it (and safetensors refuses shared storage).
        skip = ("lm_head.weight",) if getattr(config, "tie_word_embeddings", False) else ()
        return PublishedShards(sd, dtype, self.config.shard_bytes, skip, time.perf_counter() - started)
