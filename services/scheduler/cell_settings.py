"""The cell agent's configuration (`GYRE_CELL_…`) and the names of a node's cells."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CellSettings(BaseSettings):
    """`GYRE_CELL_…`: the node's cells and what runs on them.

    `warm` (default): once a cell has a role, both roles' processes run on it, the other role's in standby (a
    rollout worker with GYRE_ROLLOUT_STANDBY=1, a trainer rank outside the group), and a switch moves the role
    between them; off, a switch stops the old role's process and starts the new one (the restart path, which is
    also the fallback when a warm process died). `standby_from_start` (default, with warm): a registered cell
    starts both processes in standby before its first order, so even its first assignment starts nothing (the
    cell's release from idle wakes the role's process); off, the first assignment starts the role's process cold
    and the other one in standby after it.

    Command templates take `{cell_id}`, `{node_id}`, `{run_id}`, `{python}`, `{port}` and `{devices}`.
    Readiness: `status` = the process is a Gyre rollout worker, which says it serves with a `weights.loaded` of
    its cell (at start-up, or on waking) and reports the end of a drain with `cell.drained`; `group` = the
    process is a Gyre trainer rank, ready once a `trainer.group_formed` lists its cell (the trainer coordinator
    answers a drain of the cell with `cell.drained`); `health` = the process's health endpoint answers 200;
    `started` = the process is still alive after `start_grace_s`. Only `status` and `group` processes are waited
    for when their cell leaves the role. Health ports (GYRE_HEALTH_PORT): cell *i*'s rollout process gets
    `health_port_base + i`, its train process `health_port_base + count + i` (a block of 2 × count ports).
    """

    model_config = SettingsConfigDict(env_prefix="GYRE_CELL_", extra="ignore", frozen=True)

    count: int = Field(default=1, ge=1)
    node_id: str = ""  # default: GYRE_NODE_ID (the host name)
    accelerators: int = Field(default=1, ge=1)  # per cell
    device: str = "cpu"
    # On a CPU node: pin cell i's processes to cores [i × accelerators, (i + 1) × accelerators) of those this agent
    # may use, so that a cell behaves like an accelerator of its own (vLLM's threads and the trainer's stay on
    # them). Where the node has too few cores for every cell, nothing is pinned.
    pin_cores: bool = False
    memory_bytes: int = Field(default=0, ge=0)
    # The KV a cell holds, in tokens, as `cell.registered` states it; 0: what its rollout engine reports (the
    # scheduler admits against the smaller of the two where both are known).
    kv_capacity_tokens: int = Field(default=0, ge=0)
    warm: bool = True
    standby_from_start: bool = True
    rollout_command: str = "{python} -m services.rollout worker"
    train_command: str = "{python} -m services.trainer rank"
    rollout_ready: Literal["status", "health", "started"] = "status"
    train_ready: Literal["group", "health", "started"] = "group"
    health_port_base: int = Field(default=9300, ge=0)  # 0: children get no health port
    start_grace_s: float = Field(default=1.0, ge=0)
    ready_timeout_s: float = Field(default=900.0, gt=0)
    # A process that has not reported its drain by then is stopped (a train cell's waits for a step boundary).
    drain_timeout_s: float = Field(default=600.0, ge=0)
    stop_timeout_s: float = Field(default=30.0, ge=0)
    restart_backoff_s: float = Field(default=2.0, ge=0)  # before restarting a crashed process; doubles per crash
    restart_backoff_max_s: float = Field(default=60.0, ge=0)  # in a row, up to this
    log_dir: Path | None = None  # default: <state_dir>/cells


def safe_id(text: str) -> str:
    """Cell ids end up in NATS subjects (a worker's id is its cell id): no dots, spaces or wildcards."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text).strip("-") or "node"


def cell_ids(node_id: str, count: int) -> list[str]:
    return [f"{safe_id(node_id)}-cell{i}" for i in range(count)]
