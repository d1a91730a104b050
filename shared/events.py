"""Gyre's event catalogue: a versioned envelope around one frozen payload model per event type.

Every event crossing a service boundary is one of these; `parse_event` is the only way bytes become events.
One cohesive thing, kept whole on purpose: the catalogue is the contract between the services, and a reader
should find every event of the system in one file.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from shared.cells import Role


class EventError(Exception):
    """Base of every error raised while decoding or building events."""


class UnknownEventType(EventError):
    def __init__(self, event_type: str) -> None:
        super().__init__(f"unknown event type {event_type!r}; known types: {', '.join(sorted(REGISTRY))}")
        self.event_type = event_type


class UnsupportedSchemaVersion(EventError):
    def __init__(self, event_type: str, version: int, supported: int) -> None:
        super().__init__(
            f"event type {event_type!r} has schema_version {version}; this build reads versions 1..{supported}"
        )
        self.event_type = event_type
        self.version = version


class InvalidEventPayload(EventError):
    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid event: {detail}")
        self.detail = detail


class _Frozen(BaseModel):
    # No NaN or infinity: JSON cannot hold them (pydantic would write null, which no reader accepts back, and
    # one such event would block every read of the log past it), so a producer fails here instead.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


BranchKind = Literal["continuation", "compaction", "delegation", "retry", "fork"]
# Why a fork happened: the harness re-rendered what the model generated (the prompt leaves the chain's previous
# call inside generated text), or rewrote other context.
ForkCause = Literal["reply_rewritten", "context_rewritten"]
CallApi = Literal["anthropic", "openai", "internal"]  # which API a model call came through


class BlobRef(_Frozen):
    """A pointer to a content-addressed blob (token arrays, batches, weights, KV blocks)."""

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    size: int = Field(ge=0)
    media_type: str = "application/octet-stream"
    store: Literal["pg", "object"] = "pg"


class EventData(_Frozen):
    """Base of every payload; subclasses set `TYPE` (the `<aggregate>.<event>` name) and `SCHEMA_VERSION`."""

    TYPE: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int] = 1


class _Extended(EventData):
    """A payload with fields added after events of its type were first written (`WRITTEN_WHEN_SET`): they are
    left out of the JSON while they hold their default, so those earlier events export byte-identically."""

    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset_additions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.WRITTEN_WHEN_SET:
            if name in data and data[name] == type(self).model_fields[name].get_default(call_default_factory=True):
                del data[name]
        return data


REGISTRY: dict[str, type[EventData]] = {}


def register(cls: type[EventData]) -> type[EventData]:
    if cls.TYPE in REGISTRY:
        raise EventError(f"event type {cls.TYPE!r} registered twice")
    REGISTRY[cls.TYPE] = cls
    return cls


# ---- cells -----------------------------------------------------------------------------------------


@register
class CellRegistered(EventData):
    TYPE: ClassVar[str] = "cell.registered"
    cell_id: str
    node_id: str
    accelerators: int = Field(ge=1)
    device: str  # "cpu", "cuda", ...
    memory_bytes: int = Field(ge=0)
    kv_capacity_tokens: int = Field(ge=0)


@register
class CellAssigned(EventData):
    TYPE: ClassVar[str] = "cell.assigned"
    cell_id: str
    role: Role
    policy: str
    reason: str = ""


@register
class CellDraining(EventData):
    TYPE: ClassVar[str] = "cell.draining"
    cell_id: str
    from_role: Role
    # None: not known to the cell agent, which folds no session events (the worker's `cell.drained` counts what
    # it moved and what it kept). Older logs carry the count the agent read from the worker's heartbeat.
    live_sessions: int | None = Field(default=None, ge=0)


@register
class CellDrained(_Extended):
    """What served the cell's role let go of it, as the `cell.draining` it answers (its causation) asked.

    From a rollout cell, its worker: each session it moved has its own `kv.migrated`, appended before this;
    `parked_sessions` it still holds (no active worker to take them, or a move failed: `detail` says which); its
    engine then sleeps (a warm cell keeps the process). From a train cell, the trainer: the cell's rank left the
    group at a step boundary (`worker_id` names the rank). `phases` times the parts (e.g. `drain_s`, `sleep_s`,
    `wait_step_s`). The cell agent releases the cell on it."""

    TYPE: ClassVar[str] = "cell.drained"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("phases",)
    cell_id: str
    worker_id: str
    migrated_sessions: int = Field(ge=0)
    parked_sessions: int = Field(ge=0)
    seconds: float = Field(ge=0)
    detail: str = ""
    phases: dict[str, float] = Field(default_factory=dict)


@register
class CellReleased(EventData):
    TYPE: ClassVar[str] = "cell.released"
    cell_id: str
    from_role: Role
    migrated_sessions: int = Field(ge=0)
    seconds: float = Field(ge=0)


@register
class CellReady(_Extended):
    """The cell serves `role`, `switch_seconds` after its switch began. `warm`: its process for the role was
    already running (woken or let into the group) rather than started; `phases` times the switch's parts as the
    processes reported them (drain, sleep, group re-form, weight load, process start...)."""

    TYPE: ClassVar[str] = "cell.ready"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("warm", "phases")
    cell_id: str
    role: Role
    switch_seconds: float = Field(ge=0)
    policy_version: int | None = None
    warm: bool | None = None
    phases: dict[str, float] = Field(default_factory=dict)


# ---- rollout ---------------------------------------------------------------------------------------


@register
class KvMigrated(_Extended):
    """One live session moved cell to cell: by its KV (`tokens`: prompt tokens the target took from the moved
    KV rather than prefill again) or by recompute (`tokens`: the history the target prefilled). A move that
    tried KV and recomputed says why in `fallback` (digest mismatch, target full, another model or policy...).
    `phases` times a KV move's parts: `save_s` and `send_s` on the source, `receive_s` and `load_s` on the
    target (and `recompute_s` where it recomputed)."""

    TYPE: ClassVar[str] = "kv.migrated"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("fallback", "phases")
    execution_id: str
    from_cell: str
    to_cell: str
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    method: Literal["kv", "recompute"]
    fallback: str = ""
    phases: dict[str, float] = Field(default_factory=dict)


@register
class KvMigrationOrdered(EventData):
    """The scheduler orders one live session moved to another rollout cell (a policy's `MigrateSession`):
    the worker of `from_cell` moves it to the worker of `to_cell` or, if that one cannot take it, keeps it."""

    TYPE: ClassVar[str] = "kv.migration_ordered"
    execution_id: str
    from_cell: str
    to_cell: str
    policy: str
    reason: str = ""


@register
class KvMigrationRefused(EventData):
    """The worker of `from_cell` did not carry out an ordered move (`reason`: it drains, holds no session of the
    execution, the target is not an active worker, or the target refused); the session stays where it is."""

    TYPE: ClassVar[str] = "kv.migration_refused"
    execution_id: str
    from_cell: str
    to_cell: str
    reason: str


@register
class CallCompleted(EventData):
    """One model call. Token arrays live in `record` (see shared.calls); the rest is a summary for readers."""

    TYPE: ClassVar[str] = "call.completed"
    execution_id: str
    call_id: str
    call_index: int = Field(ge=0)
    record: BlobRef
    parent_call_index: int | None = None
    parent_prefix_len: int = Field(default=0, ge=0)
    prompt_tokens: int = Field(ge=0)  # full prompt length (shared prefix + delta)
    new_prompt_tokens: int = Field(ge=0)  # tokens stored by this call (the delta)
    completion_tokens: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    cell_id: str
    chain_id: str = "main"
    branch_hint: BranchKind | None = None
    finish_reason: str = "stop"
    api: CallApi = "anthropic"
    latency_s: float = Field(default=0.0, ge=0)


@register
class CallRefused(EventData):
    """The gateway refused one model call of `execution_id` with an API error (an answer the agent saw): the
    harness folds these to tell an agent that stopped on its own from one the infrastructure stopped. Written
    before the error leaves the gateway. Never carries the execution's token, a header or the request body."""

    TYPE: ClassVar[str] = "call.refused"
    execution_id: str
    status: int = Field(ge=400, le=599)  # the HTTP status the agent got
    kind: str  # the API's error type (e.g. "rate_limit_error", "invalid_request_error")
    reason: str = Field(max_length=500)
    # The infrastructure, not the request, failed (429 or 5xx: no capacity, a worker or the log unavailable).
    infra: bool
    budget_spent: bool = False  # refused because the execution's call budget was spent
    answered: int = Field(default=0, ge=0)  # calls of the execution answered before this one
    api: CallApi = "anthropic"


# ---- executions ------------------------------------------------------------------------------------


@register
class QueryDispatched(_Extended):
    """The scheduler orders one query (a task run as a group of `group_size` executions)."""

    TYPE: ClassVar[str] = "query.dispatched"
    query_id: str
    task_id: str
    group_size: int = Field(ge=1)
    seeds: list[int]
    step: int = Field(ge=0)  # the training step this query's group feeds
    policy_version: int = Field(ge=0)
    harness: str = "builtin"
    # The cell the scheduler placed each sample on (index = sample); the router starts the execution there
    # when that cell's worker takes sessions. Empty: the router chooses.
    placements: list[str] = Field(default_factory=list)
    # How many queries feed `step`: its batch waits for all of them (a query dispatched only when room frees
    # must not miss the batch its step's first query completed). None in logs written before it existed.
    step_queries: int | None = Field(default=None, ge=1)
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("placements", "step_queries")


@register
class ExecutionStarted(_Extended):
    TYPE: ClassVar[str] = "execution.started"
    execution_id: str
    query_id: str
    task_id: str
    group_size: int = Field(ge=1)
    sample_index: int = Field(ge=0)
    seed: int
    step: int = Field(default=0, ge=0)
    harness: str = "builtin"
    policy_version: int = Field(default=0, ge=0)
    wall_budget_s: float | None = None
    call_budget: int | None = None
    cell_id: str | None = None  # where the scheduler placed it (QueryDispatched.placements)
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("cell_id",)


@register
class ExecutionBranched(_Extended):
    TYPE: ClassVar[str] = "execution.branched"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("cause",)
    execution_id: str
    kind: BranchKind
    at_call_index: int = Field(ge=0)  # the first call on the new branch
    from_call_index: int | None = None  # the call it branches from, when known
    chain_id: str = "main"
    reason: str = ""
    cause: ForkCause | None = None  # a fork the gateway found: where the prompt left the chain's previous call


@register
class ExecutionTimedOut(EventData):
    TYPE: ClassVar[str] = "execution.timed_out"
    execution_id: str
    budget: Literal["wall_clock", "calls", "tokens", "crash"]
    elapsed_s: float = Field(ge=0)
    calls: int = Field(ge=0)


@register
class ExecutionResumed(EventData):
    """A restarted harness picked up an execution its predecessor was running when it stopped: the agent runs
    again from the start in a fresh workspace, its first `replayed_calls` calls answered from the log (no
    generation, nothing recorded again), and goes on live. `attempt` counts the resumes of this execution."""

    TYPE: ClassVar[str] = "execution.resumed"
    execution_id: str
    replayed_calls: int = Field(ge=0)
    attempt: int = Field(ge=1)


@register
class ExecutionFinished(_Extended):
    TYPE: ClassVar[str] = "execution.finished"
    execution_id: str
    elapsed_s: float = Field(ge=0)
    calls: int = Field(ge=0)
    stop_reason: str = "submitted"
    # True when the model API, not the agent, ended it (stop_reason then says how): the score of a recovered
    # execution must carry that on (ExecutionScored.infra_failure), as the live path's does.
    infra_failure: bool = False
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("infra_failure",)


@register
class ExecutionScored(_Extended):
    TYPE: ClassVar[str] = "execution.scored"
    execution_id: str
    query_id: str
    reward: float
    tests_passed: int = Field(ge=0)
    tests_total: int = Field(ge=0)
    timed_out: bool = False
    # Set (to the reason) when infrastructure, not the policy, ended the execution: the model API refused it
    # after retries, its sandbox or harness failed, or nothing of it was left to grade. The reward then says
    # nothing about the policy, so the trajectory service leaves the execution out of its group and batch.
    infra_failure: str | None = None
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("infra_failure",)


# ---- training --------------------------------------------------------------------------------------


@register
class BatchReady(_Extended):
    TYPE: ClassVar[str] = "batch.ready"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("stale_executions", "trajectories_before_cap",
                                                   "trajectories_after_cap", "capped_executions", "dropped_targets",
                                                   "group_shared_tokens")
    step: int = Field(ge=0)
    batch: BlobRef
    query_ids: list[str]
    executions: int = Field(ge=0)
    trees: int = Field(ge=0)
    micro_batches: int = Field(ge=0)
    unique_tokens: int = Field(ge=0)
    flat_tokens: int = Field(ge=0)
    target_tokens: int = Field(ge=0)
    min_policy_version: int = Field(ge=0)
    max_policy_version: int = Field(ge=0)
    # Executions left out because a target was generated beyond the staleness bound (their reward still counts
    # in their group's normalisation).
    stale_executions: int = Field(default=0, ge=0)
    # What the trajectory cap did (0 in batches written before these were recorded): root-to-leaf trajectories
    # of the batch's executions before and after it, executions it cut, target tokens left untrained.
    trajectories_before_cap: int = Field(default=0, ge=0)
    trajectories_after_cap: int = Field(default=0, ge=0)
    capped_executions: int = Field(default=0, ge=0)
    dropped_targets: int = Field(default=0, ge=0)
    # Tokens the batch did not hold again because a query's executions share their opening prompt (packed once).
    group_shared_tokens: int = Field(default=0, ge=0)


@register
class StepCompleted(EventData):
    TYPE: ClassVar[str] = "step.completed"
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    world_size: int = Field(ge=1)
    seconds: float = Field(ge=0)
    metrics: dict[str, float]


@register
class WeightsPublished(_Extended):
    """A new policy version is in the Object Store. `format`: `safetensors`, one file (runs recorded before
    shards); `shards`, `weights` is the manifest of the layer-aligned shards (shared/weights.py), `dtype` and
    `bytes` say what they hold."""

    TYPE: ClassVar[str] = "weights.published"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("dtype", "bytes", "publish_s")
    version: int = Field(ge=0)
    step: int = Field(ge=-1)  # -1: the initial weights before any step
    weights: BlobRef
    format: Literal["safetensors", "shards"] = "safetensors"
    dtype: str = ""
    bytes: int = Field(default=0, ge=0)
    publish_s: float = Field(default=0.0, ge=0)  # from the step's end: gathering, encoding and storing them


@register
class WeightsRetired(EventData):
    """A published version's objects were deleted from the Object Store (retention: no worker serves it and
    it is older than the kept window). `objects`/`bytes`: what was deleted; shards a kept version shares stay."""

    TYPE: ClassVar[str] = "weights.retired"
    version: int = Field(ge=0)
    objects: int = Field(ge=0)
    bytes: int = Field(ge=0)
    kept: list[int]  # the versions kept when it was retired


@register
class WeightsLoaded(_Extended):
    """A rollout worker serves `version` from now on: at its start, after waking on its cell, or after loading
    a `weights.published`. The scheduler counts the staleness bound from the oldest version the rollout cells
    serve (docs/operating.md); the cell agent takes a worker's first one after a start or a wake as its
    readiness. `phases` times a start or a wake (e.g. `wake_s`, `load_s`) or a publication's load (`fetch_s`
    while serving, then `pause_s` with new calls held, `swap_s` of it in the engine). `kv_capacity_tokens`: the
    tokens of KV the worker's engine holds (its blocks × block size, as the engine allocated them; 0: not
    reported): the scheduler admits sessions to the cell against the smaller of this and what the cell registered."""

    TYPE: ClassVar[str] = "weights.loaded"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("phases", "kv_capacity_tokens")
    cell_id: str
    worker_id: str
    version: int = Field(ge=0)
    phases: dict[str, float] = Field(default_factory=dict)
    kv_capacity_tokens: int = Field(default=0, ge=0)


@register
class RankReady(EventData):
    """A trainer rank process on `cell_id` stands by (warm: imports done, model loaded) and can be let into the
    trainer's group; `rank_id` names the process (a restarted one gets a new id)."""

    TYPE: ClassVar[str] = "trainer.rank_ready"
    cell_id: str
    rank_id: str


@register
class GroupFormed(EventData):
    """The trainer (re-)formed its ranks' process group: `members` are cell ids in rank order (empty: no cell
    trains, the group is dissolved), resuming from the latest checkpoint before `next_step`. `phases` are the
    slowest member's (`group_s`, `build_s`, `load_s`); `reason` says what changed (joined, left, failed)."""

    TYPE: ClassVar[str] = "trainer.group_formed"
    generation: int = Field(ge=1)
    members: list[str]
    world_size: int = Field(ge=0)
    next_step: int = Field(ge=0)
    seconds: float = Field(ge=0)
    phases: dict[str, float] = Field(default_factory=dict)
    reason: str = ""


@register
class RankStepped(EventData):
    """One rank's part of a training step: what it computed, in which group (the report's world size per step
    and each rank's work)."""

    TYPE: ClassVar[str] = "trainer.rank_stepped"
    step: int = Field(ge=0)
    generation: int = Field(ge=1)
    cell_id: str
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    micro_batches: int = Field(ge=0)
    tokens: int = Field(ge=0)
    seconds: float = Field(ge=0)


# ---- envelope --------------------------------------------------------------------------------------


class Event(_Frozen):
    """The versioned envelope. `occurred_at` is recorded once by the producer and never recomputed."""

    event_id: uuid.UUID
    type: str
    schema_version: int = Field(ge=1)
    run_id: str
    stream_id: str
    version: int = Field(ge=1)
    occurred_at: datetime
    causation_id: uuid.UUID | None = None
    correlation_id: uuid.UUID | None = None
    data: EventData

    @model_validator(mode="before")
    @classmethod
    def _typed_data(cls, body: Any) -> Any:
        """Validate a `data` object as the payload model its `type` names (the bytes-to-event fast path);
        an unknown type or schema version fails here and `parse_event` names the error."""
        if isinstance(body, dict) and isinstance(body.get("data"), dict) and isinstance(body.get("type"), str):
            payload = REGISTRY.get(body["type"])
            if payload is None:
                raise ValueError(f"unknown event type {body.get('type')!r}")
            version = body.get("schema_version")
            if not isinstance(version, int) or not 1 <= version <= payload.SCHEMA_VERSION:
                raise ValueError(f"unsupported schema_version {version!r}")
            body = {**body, "data": payload.model_validate(body["data"])}
        return body

    @property
    def subject(self) -> str:
        return f"gyre.{self.type}"

    @property
    def aggregate(self) -> str:
        return self.type.split(".", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        body = self.model_dump(mode="json", exclude={"data"})
        body["data"] = self.data.model_dump(mode="json")
        return body

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()


def new_event(
    data: EventData,
    *,
    run_id: str,
    stream_id: str,
    version: int,
    occurred_at: datetime,
    causation_id: uuid.UUID | None = None,
    correlation_id: uuid.UUID | None = None,
    event_id: uuid.UUID | None = None,
) -> Event:
    """Build an envelope. Time and ids arrive as data so pure cores can build events deterministically."""
    return Event(
        event_id=event_id or uuid.uuid4(),
        type=data.TYPE,
        schema_version=data.SCHEMA_VERSION,
        run_id=run_id,
        stream_id=stream_id,
        version=version,
        occurred_at=occurred_at,
        causation_id=causation_id,
        correlation_id=correlation_id,
        data=data,
    )


def parse_event(raw: bytes | str | dict[str, Any]) -> Event:
    """Decode one event, raising UnknownEventType, UnsupportedSchemaVersion or InvalidEventPayload."""
    if isinstance(raw, (bytes, str)):
        # Fast path: pydantic parses and validates the JSON in one pass. Anything it refuses goes through
        # the steps below, which say precisely what is wrong.
        try:
            return Event.model_validate_json(raw)
        except ValidationError:
            pass
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidEventPayload(f"not JSON: {exc}") from exc
        except RecursionError as exc:  # nesting deeper than any event has
            raise InvalidEventPayload("not JSON: nested too deeply") from exc
    else:
        body = dict(raw)
    if not isinstance(body, dict):
        raise InvalidEventPayload(f"expected a JSON object, got {type(body).__name__}")
    event_type = body.get("type")
    if not isinstance(event_type, str):
        raise InvalidEventPayload("missing string field 'type'")
    cls = REGISTRY.get(event_type)
    if cls is None:
        raise UnknownEventType(event_type)
    version = body.get("schema_version")
    if not isinstance(version, int) or version < 1 or version > cls.SCHEMA_VERSION:
        if isinstance(version, int) and version >= 1:
            raise UnsupportedSchemaVersion(event_type, version, cls.SCHEMA_VERSION)
        raise InvalidEventPayload(f"field 'schema_version' must be a positive integer, got {version!r}")
    try:
        data = cls.model_validate(body.get("data"))
        return Event.model_validate({**body, "data": data})
    except ValidationError as exc:
        raise InvalidEventPayload(f"{event_type}: {_first_errors(exc)}") from exc


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def execution_id_for(query_id: str, sample_index: int) -> str:
    """The id of sample `sample_index` of a query's group: the harness names executions so, and the scheduler
    expects sessions under these names before their `execution.started`."""
    return f"execution-{query_id}-{sample_index:03d}"


def stream_id_for(aggregate: str, ident: str) -> str:
    """Stream ids are `<aggregate>-<id>` (e.g. `execution-…`, `cell-…`, `step-…`)."""
    return ident if ident.startswith(f"{aggregate}-") else f"{aggregate}-{ident}"
