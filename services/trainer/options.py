"""The trainer's own settings (env `GYRE_TRAINER_…`): the coordinator's (`TrainerOptions`, which it hands to the
ranks with each `form`) and a rank process's (`RankOptions`). The loss settings come from shared `Settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.weights import DEFAULT_SHARD_BYTES, PublishDtype
from shared.weights_stream import StreamBackend


class TrainerOptions(BaseSettings):
    """The coordinator's settings; training hyperparameters travel to the ranks in `form` (protocol.TrainerSpec)."""

    model_config = SettingsConfigDict(env_prefix="GYRE_TRAINER_", extra="ignore", frozen=True)

    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    publish_every: int = 1  # publish weights after every N-th step (and always after the first)
    # The published weights' dtype: auto is the model's own (a bf16 checkpoint ships bf16, whatever the trainer
    # computes in); set it to what the rollout engines serve when that differs.
    publish_dtype: PublishDtype = "auto"
    shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, ge=1 << 20)  # a publication's shards (between layers)
    # Published versions kept in the Object Store besides the newest: at least the staleness bound (the shared
    # GYRE_MAX_STALENESS) is kept whatever this says; older ones no worker serves are deleted (retention.py).
    keep_versions: int = Field(default=1, ge=0)
    first_step: int = 0  # the step number of the first batch of a run
    keep_checkpoints: int = 2
    # How long a batch a crashed trainer held waits for redelivery (default: the shared GYRE_ACK_WAIT_S). A
    # step may take many minutes; the consumer's progress acks keep its batch from redelivery meanwhile.
    ack_wait_s: float | None = None
    # Where the ranks keep the run's checkpoints (services/trainer/checkpoints.py): `folder`, a directory every
    # rank sees (one node, or a shared filesystem; default <state_dir>/trainer/<run_id>/checkpoints), or `object`,
    # the NATS Object Store, which ranks on nodes that share nothing but the bus all reach.
    checkpoint_store: Literal["folder", "object"] = "folder"
    checkpoint_dir: Path | None = None
    # The coordinator's TCPStore, where the ranks meet: the address the ranks dial (this host as they see it)
    # and the port it listens on (0: any free port; the ranks learn it from `form`).
    store_host: str = "127.0.0.1"
    store_port: int = Field(default=0, ge=0)
    # A rank's rendezvous and every collective give up after this: a survivor stuck with a dead peer returns.
    collective_timeout_s: float = Field(default=60.0, gt=0)
    form_timeout_s: float = Field(default=900.0, gt=0)  # one member's form (rendezvous, build, checkpoint load)
    step_timeout_s: float = Field(default=3600.0, gt=0)  # one member's step, checkpoint and publication
    # While a step runs, the members that have not answered are asked who they are this often: a dead process's
    # subject has no responders (or a restarted one answers with another rank id).
    probe_every_s: float = Field(default=1.0, gt=0)
    step_attempts: int = Field(default=3, ge=1)  # re-forms and redos of one step before its batch is retried later
    # How long one delivery of a batch waits for a cell to train before it is handed back (and retried).
    idle_wait_s: float = Field(default=30.0, gt=0)


class RankOptions(BaseSettings):
    """A rank process's settings: the cell it stands by on (the cell agent sets `GYRE_TRAINER_CELL_ID`)."""

    model_config = SettingsConfigDict(env_prefix="GYRE_TRAINER_", extra="ignore", frozen=True)

    cell_id: str = ""
    # The same-node handoff: rank 0 also writes each published shard to a folder on its node, where rollout
    # workers on the same node (the same GYRE_NODE_ID) read it instead of the Object Store. Unset folder:
    # `<state_dir>/weights/published`.
    local_weights: bool = True
    local_weights_dir: Path | None = None
    # The weights stream (shared/weights_stream.py): rank 0 also sends each publication's shards to the workers
    # that pull them, over a pair group (gloo: host memory; nccl: GPU to GPU), at the address workers reach it by
    # (`host`; port 0: a free one). The Object Store stays the path of record and the fallback.
    weights_stream: bool = False
    weights_stream_host: str = "127.0.0.1"
    weights_stream_port: int = Field(default=0, ge=0, le=65535)
    weights_stream_backend: StreamBackend = "gloo"
    weights_stream_timeout_s: float = Field(default=60.0, gt=0)


__all__ = ["RankOptions", "TrainerOptions"]
