"""The trainer service shell: batch.ready in, one GSPO step per batch, checkpoint, weights to the Object
Store, step.completed and weights.published out. Resumes from its latest checkpoint after a crash.

Exactly once per step: the handler trains with no transaction open and returns its events as `Effects`, which the
runtime records with the tracking row afterwards. The checkpoint, written before that record, holds the last
trained step and its metrics, so a batch delivered again (a failed record, a lost ack, a crash in between) is
recognised and only its events are re-emitted, never trained twice; a step whose checkpoint fails is rolled back.
A batch for a later step than the next one waits (is retried) until the gap is filled.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any, Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

from services.trainer.distributed import GroupSpec, free_port
from services.trainer.engine import Trainer, TrainerConfig
from services.trainer.loss import GspoConfig
from services.trainer.weights import WEIGHTS_MEDIA_TYPE
from shared.batch import TrainingBatch
from shared.bus import ConsumerOptions
from shared.effects import Effects
from shared.events import BatchReady, BlobRef, Event, StepCompleted, WeightsPublished, stream_id_for
from shared.runtime import Service
from shared.settings import Settings
from shared.store import ConcurrencyConflict


class TrainerServiceError(Exception):
    pass


class StepOutOfOrder(TrainerServiceError):
    """A batch arrived before the one for the step before it; raised so the bus redelivers it later."""


class TrainerOptions(BaseSettings):
    """Trainer-only settings (env prefix GYRE_TRAINER_); the loss settings come from shared Settings."""

    model_config = SettingsConfigDict(env_prefix="GYRE_TRAINER_", extra="ignore", frozen=True)

    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    publish_every: int = 1  # publish weights after every N-th step (and always after the first)
    first_step: int = 0  # the step number of the first batch of a run
    keep_checkpoints: int = 2
    # How long a batch a crashed trainer held waits for redelivery (default: the shared GYRE_ACK_WAIT_S). A
    # step may take many minutes; the consumer's progress acks keep its batch from redelivery meanwhile.
    ack_wait_s: float | None = None
    checkpoint_dir: Path | None = None  # default: <state_dir>/trainer/<run_id>/checkpoints


def step_stream_id(run_id: str, step: int) -> str:
    return stream_id_for("step", f"{run_id}-{step}")


def weights_stream_id(run_id: str, version: int) -> str:
    return stream_id_for("weights", f"{run_id}-{version}")


class TrainerService(Service):
    name = "trainer"

    def __init__(self, settings: Settings | None = None, options: TrainerOptions | None = None) -> None:
        super().__init__(settings)
        self.options = options or TrainerOptions()
        self.trainer: Trainer | None = None
        self.last_step: int = self.options.first_step - 1
        self.last_metrics: dict[str, float] = {}
        self.last_seconds: float = 0.0
        self.reform_s: float = 0.0

    @property
    def checkpoint_root(self) -> Path:
        if self.options.checkpoint_dir is not None:
            return self.options.checkpoint_dir
        return Path(self.settings.state_dir) / "trainer" / self.settings.run_id / "checkpoints"

    def trainer_config(self) -> TrainerConfig:
        s = self.settings
        return TrainerConfig(
            lr=self.options.lr,
            weight_decay=self.options.weight_decay,
            grad_clip=self.options.grad_clip,
            precision=self.options.precision,
            loss=GspoConfig(eps_low=s.eps_low, eps_high=s.eps_high, is_cap=s.is_cap),
            recompute_old_logprobs=s.recompute_old_logprobs,
        )

    async def setup(self) -> None:
        if self.settings.model_dir is None:
            raise TrainerServiceError("GYRE_MODEL_DIR must name the model directory the trainer starts from")
        spec = GroupSpec.from_env()
        if spec.world_size == 1:
            # Alone: a private rendezvous port, so several single-rank trainers on one node never collide.
            spec = GroupSpec(rank=0, world_size=1, master_port=free_port())
        if spec.rank != 0:
            raise TrainerServiceError(
                f"the service process is rank 0 of the trainer group; got RANK={spec.rank} (run other ranks "
                "with `gyre train run-step`)"
            )
        trainer, timing = await asyncio.to_thread(
            Trainer.start, Path(self.settings.model_dir), spec, self.trainer_config(), self.checkpoint_root
        )
        self.trainer = trainer
        self.reform_s = timing.total_s
        state = self._checkpoint_state()
        if state:
            self._remember(state)
        else:
            # A checkpoint of the starting weights, so that a step that fails after changing the weights in
            # memory can always be rolled back to the last saved state (`_roll_back`).
            await asyncio.to_thread(trainer.save, self.checkpoint_root, self.options.keep_checkpoints,
                                    {"last_step": self.last_step})
        self.log.info(
            "trainer_ready",
            world_size=spec.world_size,
            policy_version=trainer.policy_version,
            last_step=self.last_step,
            reform_s=round(timing.total_s, 3),
            group_s=round(timing.group_s, 3),
            build_s=round(timing.build_s, 3),
            load_s=round(timing.load_s, 3),
        )
        if trainer.policy_version == 0:
            await self._publish_initial()
        if self.last_step >= self.options.first_step:
            # Checkpointed but perhaps not committed before a crash: emit it now, before any later batch
            # (a later one can arrive first, while the crashed consumer's message waits out its ack_wait).
            await self.record(await self._step_effects(None, self.last_step, self.last_metrics, self.last_seconds))
        options = ConsumerOptions(
            ack_wait_s=self.options.ack_wait_s or self.settings.ack_wait_s,
            max_deliver=max(self.settings.max_deliver, 1000),  # out-of-order waits are retries, not failures
            backoff_s=tuple(self.settings.backoff_s),
        )
        self.on(["batch.ready"], self.handle, options=options)

    def _remember(self, state: dict[str, Any]) -> None:
        """Take the last trained step and its result from a checkpoint's trainer state."""
        self.last_step = int(state.get("last_step", self.options.first_step - 1))
        self.last_metrics = dict(state.get("metrics", {}))
        self.last_seconds = float(state.get("seconds", 0.0))

    def _roll_back(self) -> None:
        """Put the trainer (weights, optimiser, counters) and the step bookkeeping back to the latest checkpoint."""
        from services.trainer.distributed import latest_checkpoint

        assert self.trainer is not None
        latest = latest_checkpoint(self.checkpoint_root)
        if latest is None:
            raise TrainerServiceError(f"no checkpoint under {self.checkpoint_root} to roll a failed step back to")
        self._remember(self.trainer.resume(latest))

    def _checkpoint_state(self) -> dict[str, Any]:
        from services.trainer.distributed import latest_checkpoint, read_trainer_state

        latest = latest_checkpoint(self.checkpoint_root)
        return read_trainer_state(latest) if latest is not None else {}

    async def teardown(self) -> None:
        if self.trainer is not None:
            await asyncio.to_thread(self.trainer.close)
            self.trainer = None

    def health(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "last_step": self.last_step,
            "policy_version": t.policy_version if t else None,
            "world_size": t.world_size if t else None,
            "reform_s": round(self.reform_s, 3),
        }

    # ------------------------------------------------------------------------------------------ steps

    async def handle(self, event: Event) -> Effects | None:
        """Train the batch's step (outside any transaction: the runtime records the returned effects with the
        event's tracking row once the step is trained and checkpointed)."""
        data = event.data
        if not isinstance(data, BatchReady):
            return None
        assert self.trainer is not None and self.store is not None
        if data.step <= self.last_step:
            # Trained before a crash that lost its record: the checkpoint has the result; emit it.
            self.log.info("batch_already_trained", step=data.step, last_step=self.last_step)
            if data.step == self.last_step:
                return await self._step_effects(event, data.step, self.last_metrics, self.last_seconds)
            return None
        if data.step != self.last_step + 1:
            raise StepOutOfOrder(f"batch for step {data.step} arrived, expected step {self.last_step + 1} first")
        batch = TrainingBatch.decode(await self.blobs.get(data.batch))
        if batch.step != data.step:
            raise TrainerServiceError(f"batch.ready says step {data.step}, the batch blob says {batch.step}")
        started = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.step, batch)
        try:
            seconds = time.perf_counter() - started
            metrics["staleness_bound_violations"] = float(
                metrics["staleness_max"] > self.settings.max_staleness
            )
            # Checkpoint before the record: a crash after this line finds the step trained and only re-emits.
            await asyncio.to_thread(
                self.trainer.save,
                self.checkpoint_root,
                self.options.keep_checkpoints,
                {"last_step": data.step, "metrics": metrics, "seconds": seconds},
            )
        except Exception:
            # The weights moved in memory but the step is not saved: go back to the last checkpoint, so the
            # batch's redelivery trains it once from the same weights (or, if the save did complete, finds it
            # trained and only re-emits). Not on cancellation (the service stopping): the save's thread runs
            # on to completion, and rolling back under it would mix two states in the checkpoint.
            await asyncio.to_thread(self._roll_back)
            raise
        self.last_step, self.last_metrics, self.last_seconds = data.step, metrics, seconds
        effects = await self._step_effects(event, data.step, metrics, seconds)
        self.log.info("step_completed", step=data.step, seconds=round(seconds, 3), **{
            k: round(v, 6) for k, v in metrics.items() if k in ("loss", "clip_fraction", "seq_ratio_mean", "grad_norm")
        })
        return effects

    async def _step_effects(
        self, cause: Event | None, step: int, metrics: dict[str, float], seconds: float
    ) -> Effects:
        """`step.completed` for a trained step, and `weights.published` when the step publishes (its weights
        stored first): nothing when an earlier incarnation recorded them already."""
        assert self.trainer is not None and self.store is not None
        effects = Effects()
        stream = step_stream_id(self.settings.run_id, step)
        if await self.store.read_stream(stream):
            return effects  # emitted and committed already
        version = self.trainer.policy_version
        # An event cannot hold NaN or infinity (JSON); a diverged step says so by name and count instead.
        nonfinite = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if nonfinite:
            self.log.warning("nonfinite_metrics", step=step, metrics=nonfinite)
            metrics = {**{k: v for k, v in metrics.items() if k not in nonfinite},
                       "nonfinite_metrics": float(len(nonfinite))}
        completed = StepCompleted(
            step=step,
            policy_version=version,
            world_size=self.trainer.world_size,
            seconds=seconds,
            metrics=metrics,
        )
        effects.append([self.event(completed, stream_id=stream, version=1, cause=cause)], expected_version=0)
        n = step - self.options.first_step + 1
        if n == 1 or n % self.options.publish_every == 0:
            ref = await self._store_weights()
            published = WeightsPublished(version=version, step=step, weights=ref)
            stream = weights_stream_id(self.settings.run_id, version)
            effects.append([self.event(published, stream_id=stream, version=1, cause=cause)], expected_version=0)
        return effects

    async def _store_weights(self) -> BlobRef:
        assert self.trainer is not None
        data = await asyncio.to_thread(self.trainer.weights_bytes)
        if data is None:
            raise TrainerServiceError("rank 0 produced no weights")
        return await self.blobs.put(data, WEIGHTS_MEDIA_TYPE, store="object")

    async def _publish_initial(self) -> None:
        assert self.store is not None
        stream = weights_stream_id(self.settings.run_id, 0)
        if await self.store.read_stream(stream):
            return
        ref = await self._store_weights()
        event = self.event(WeightsPublished(version=0, step=-1, weights=ref), stream_id=stream, version=1)
        try:
            await self.emit([event], expected_version=0)
        except ConcurrencyConflict as exc:  # another incarnation published it first: same weights
            self.log.info("initial_weights_already_published", detail=str(exc))
