"""The rollout processes' settings (`GYRE_ROLLOUT_…`): a worker's cell, engine and KV transport, the gateway's
address and limits; and the dtype a worker serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.rollout.worker import KV_STAGING_BYTES
from shared.weights import resolve_dtype


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_ROLLOUT_", extra="ignore", frozen=True)

    # worker
    worker_id: str = ""  # default: the cell id
    cell_id: str = "cell-0"
    capacity: int = 64  # live sessions this worker accepts
    max_model_len: int = 8192
    # The tokens of KV the engine allocates, as an accelerator cell's memory bounds them (unset: what the memory
    # given to the KV cache holds); the worker reports what its engine holds in `weights.loaded`.
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    # The dtype the engine serves: auto is the model's own (its config's), the dtype the trainer publishes in
    # by default (GYRE_TRAINER_PUBLISH_DTYPE=auto), so weights load without a cast; fp32 for the tiny models.
    dtype: str = "auto"
    # How a moved session's KV travels between workers: "nats" (the bus's Object Store: any node, nothing shared
    # but NATS) or "none" (sessions move by recompute).
    kv_transport: Literal["nats", "none"] = "nats"
    # This worker's own folder for KV in transit (its engine's connector writes and reads it; no other worker
    # does). Unset: in memory where the node has it (`default_kv_storage`), else `<state_dir>/kv/<worker_id>`.
    kv_storage: Path | None = None
    kv_staging_bytes: int = Field(default=KV_STAGING_BYTES, ge=0)  # KV received and not yet loaded, at most
    # Which connector saves and loads the KV: "gyre" (files, carried whole by the transport) or "nixl" (GPU nodes:
    # the blocks go device to device, the transport carries their descriptor).
    kv_connector: Literal["gyre", "nixl"] = "gyre"
    # This worker's folder for a publication's shards between their download and the swap (its engine reads
    # them from there). Unset: `<state_dir>/weights/<worker_id>`.
    weights_staging: Path | None = None
    # Pull a publication over the weights stream when its rank 0 offers one (and no same-node handoff serves it):
    # the engine receives the shards straight from rank 0; the Object Store is read when the stream fails.
    weights_stream: bool = True
    weights_stream_timeout_s: float = Field(default=60.0, gt=0)
    heartbeat_s: float = 1.0
    # Start in standby (engine loaded, warmed up and asleep; no `weights.loaded`) until the cell is released to
    # rollout: the cell agent's second, warm process on a cell that starts in another role.
    standby: bool = False
    # vLLM's sleep mode (GPU: weights offloaded, KV freed while standing by). Unset: where the platform has it.
    sleep_mode: bool | None = None
    # gateway
    host: str = "127.0.0.1"
    port: int = 8400
    uds: str | None = None  # also serve on this Unix socket (sandboxes reach the gateway through it)
    model_name: str = "gyre-tiny"
    # How the model writes tool calls (shared/tool_formats.py); auto: read off its chat template at start.
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # At most this many tokens per reply whatever a request asks (Claude Code asks for 32,000): the run's budget
    # of tokens per reply, for every harness. Unset: what the context leaves.
    max_reply_tokens: int | None = Field(default=None, ge=1)
    # The run's execution-token secret (shared.execution_tokens), shared with the harness: required by the gateway.
    token_secret: str = ""
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout_s: float = Field(default=60.0, gt=0)  # a request body that has not arrived by then: 408
    # This gateway's name among the run's gateways (a run may have several; the harness sticks each execution to
    # one): each reads executions' starts and ends on a durable consumer of its own, so every gateway sees every
    # end. Unset: the run's only gateway.
    gateway_id: str = ""


def served_dtype(requested: str, model_dir: Path) -> str:
    """`requested`, or for `auto` the model's own dtype from its config.json (`dtype`, or the older
    `torch_dtype`), as the trainer resolves its publish dtype (shared/weights.py); float32 when the config names
    none. Resolved here rather than by vLLM, whose `auto` serves an fp32 checkpoint in half precision on some
    platforms."""
    if requested != "auto":
        return requested
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return str(resolve_dtype("auto", config.get("dtype") or config.get("torch_dtype"))).removeprefix("torch.")
