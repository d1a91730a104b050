"""The cell agent's configuration (`GYRE_CELL_…`) and the names of a node's cells."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CellSettings(BaseSettings):
    """`GYRE_CELL_…`: the node's cells and what runs on them.

    Command templates take `{cell_id}`, `{node_id}`, `{run_id}`, `{python}`, `{port}` and `{devices}`.
    Readiness: `status` = the process is a Gyre rollout worker, which says it serves with a `weights.loaded` of
    its cell at start-up (and reports the end of a drain with `cell.drained`); `health` = the process's health
    endpoint (GYRE_HEALTH_PORT = health_port_base + cell index) answers 200; `started` = the process is still
    alive after `start_grace_s`. Only a `status` rollout process is waited for when its cell leaves rollout.
    """

    model_config = SettingsConfigDict(env_prefix="GYRE_CELL_", extra="ignore", frozen=True)

    count: int = Field(default=1, ge=1)
    node_id: str = ""  # default: GYRE_NODE_ID (the host name)
    accelerators: int = Field(default=1, ge=1)  # per cell
    device: str = "cpu"
    memory_bytes: int = Field(default=0, ge=0)
    kv_capacity_tokens: int = Field(default=1 << 20, ge=0)
    rollout_command: str = "{python} -m services.rollout worker"
    train_command: str = "{python} -m services.trainer"
    rollout_ready: Literal["status", "health", "started"] = "status"
    train_ready: Literal["health", "started"] = "health"
    health_port_base: int = Field(default=9300, ge=0)  # 0: children get no health port
    start_grace_s: float = Field(default=1.0, ge=0)
    ready_timeout_s: float = Field(default=900.0, gt=0)
    drain_timeout_s: float = Field(default=600.0, ge=0)  # a worker that has not reported its drain by then is stopped
    stop_timeout_s: float = Field(default=30.0, ge=0)
    restart_backoff_s: float = Field(default=2.0, ge=0)
    log_dir: Path | None = None  # default: <state_dir>/cells


def safe_id(text: str) -> str:
    """Cell ids end up in NATS subjects (a worker's id is its cell id): no dots, spaces or wildcards."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text).strip("-") or "node"


def cell_ids(node_id: str, count: int) -> list[str]:
    return [f"{safe_id(node_id)}-cell{i}" for i in range(count)]
