"""The coordinator ↔ rank protocol: NATS subjects and the JSON bodies of each verb, defined once and validated on
both sides (the coordinator in group.py, the ranks in rank.py).

Subjects: `<prefix>.trainer-rank.<cell_id>.<verb>`. Not `<prefix>.trainer.…`: `trainer` is an event family, whose
JetStream stream takes every subject under it, so requests there would be stored and acknowledged by the stream.
Verbs: `form` (join generation g), `step` (train one batch, checkpoint, publish when asked), `leave` (back to
standby), `publish` (store the weights the group holds: the initial ones, or a trained step's being re-emitted) and
`ping` (who answers on the cell's subject, in which generation: a dead rank's subject has no responders).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.events import BlobRef
from shared.weights import DEFAULT_SHARD_BYTES, PublishDtype

Verb = Literal["form", "step", "leave", "publish", "ping"]
VERBS: tuple[Verb, ...] = ("form", "step", "leave", "publish", "ping")

OBJECT_SCHEME = "object:"  # a checkpoint root in the Object Store's checkpoint bucket: `object:<run id>`


def rank_subject(prefix: str, cell_id: str, verb: Verb) -> str:
    """The request/reply endpoint of the rank process on `cell_id`."""
    return f"{prefix}.trainer-rank.{cell_id}.{verb}"


class Body(BaseModel):
    # A step's metrics may be infinite or NaN (a diverged gradient norm): carried as JSON's Infinity/NaN here, named
    # and left out only when they become an event (events are strict JSON).
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class TrainerSpec(Body):
    """What every rank trains with (the coordinator's settings, so all members agree)."""

    lr: float
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    is_cap: float = 2.0
    recompute_old_logprobs: bool = False
    publish_dtype: PublishDtype = "auto"  # the dtype weights are published in (auto: the model's own)
    shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, ge=1)


class TrainerState(Body):
    """The trainer state a member resumed from the latest checkpoint (identical on every member)."""

    last_step: int  # the last batch step trained (first_step - 1 before any)
    step_count: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)  # the last step's, as the checkpoint holds them
    seconds: float = Field(default=0.0, ge=0)
    world_size: int = Field(default=1, ge=1)  # of the group that trained the last step


class FormRequest(Body):
    generation: int = Field(ge=1)
    rank_id: str  # the process the coordinator means: a restarted one on the same cell refuses
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    store_host: str
    store_port: int = Field(ge=1)
    checkpoint_root: str  # a folder every rank sees, or `object:<run id>` (the Object Store): checkpoints.py
    keep_checkpoints: int = Field(ge=0)  # 0: keep every checkpoint
    first_step: int = Field(ge=0)
    timeout_s: float = Field(gt=0)  # the rendezvous and every collective of the group
    trainer: TrainerSpec


class FormReply(Body):
    rank_id: str
    generation: int
    phases: dict[str, float]  # group_s, build_s, load_s
    state: TrainerState


class StepRequest(Body):
    step: int = Field(ge=0)
    generation: int = Field(ge=1)
    batch: BlobRef
    publish: bool
    max_staleness: int = Field(ge=0)


class StepReply(Body):
    rank_id: str
    rank: int
    metrics: dict[str, float]
    micro_batches: int = Field(ge=0)  # this rank's real passes
    tokens: int = Field(ge=0)  # in those passes
    seconds: float = Field(ge=0)  # the step (forward, backward, optimiser), as the checkpoint records it
    checkpoint_s: float = Field(ge=0)
    step_count: int = Field(ge=1)  # after the step
    policy_version: int = Field(ge=1)  # of the weights the step made
    weights: BlobRef | None = None  # rank 0, when the step publishes: the manifest (shared/weights.py)
    publish_s: float = Field(default=0.0, ge=0)  # rank 0's gathering, encoding and storing of those weights


class LeaveRequest(Body):
    generation: int = Field(ge=0)  # the group the coordinator lets it leave (0: whatever it is in)


class LeaveReply(Body):
    rank_id: str
    seconds: float = Field(ge=0)


class PublishRequest(Body):
    generation: int = Field(ge=1)


class PublishReply(Body):
    rank_id: str
    weights: BlobRef | None = None  # rank 0's
    publish_s: float = Field(default=0.0, ge=0)


class PingRequest(Body):
    pass


class PingReply(Body):
    rank_id: str
    generation: int | None  # None: standing by, in no group
    busy: str | None = None  # the verb its torch thread runs


class ErrorReply(Body):
    """What a rank answers when a verb fails (the requester always gets an answer, never only a timeout)."""

    rank_id: str = ""  # empty when the bus answered for a handler that raised (shared.bus.Bus.serve)
    error: str  # "<ExceptionType>: message"


class RankAnsweredError(Exception):
    """A rank answered a verb with an error (a collective that failed, a generation it is not in...)."""

    def __init__(self, verb: str, reply: ErrorReply) -> None:
        super().__init__(f"{verb} failed on rank {reply.rank_id or '?'}: {reply.error}")
        self.verb = verb
        self.reply = reply


REQUESTS: dict[Verb, type[Body]] = {
    "form": FormRequest, "step": StepRequest, "leave": LeaveRequest, "publish": PublishRequest, "ping": PingRequest,
}
REPLIES: dict[Verb, type[Body]] = {
    "form": FormReply, "step": StepReply, "leave": LeaveReply, "publish": PublishReply, "ping": PingReply,
}


def decode_reply(verb: Verb, data: bytes) -> Body:
    """A rank's reply to `verb`, validated; raises `RankAnsweredError` for an error reply."""
    body = json.loads(data)
    if isinstance(body, dict) and "error" in body and set(body) <= {"rank_id", "error"}:
        raise RankAnsweredError(verb, ErrorReply.model_validate(body))
    return REPLIES[verb].model_validate(body)


__all__ = [
    "OBJECT_SCHEME",
    "REPLIES",
    "REQUESTS",
    "VERBS",
    "ErrorReply",
    "FormReply",
    "FormRequest",
    "LeaveReply",
    "LeaveRequest",
    "PingReply",
    "PingRequest",
    "PublishReply",
    "PublishRequest",
    "StepReply",
    "StepRequest",
    "TrainerSpec",
    "TrainerState",
    "Verb",
    "RankAnsweredError",
    "decode_reply",
    "rank_subject",
]
