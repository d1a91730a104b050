"""Routing rules (pure): which worker takes a new session (the least loaded with room, or the cell the scheduler
placed the execution on), and how much of a prompt a worker already holds, so only the rest is sent.

The router (new executions) and a draining worker (where its sessions go) both rank workers by `load`, the one
least-loaded order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from shared.worker_status import WorkerStatus

Load = tuple[float, int, str]


def load(status: WorkerStatus, placed: int = 0) -> Load:
    """A worker's place in the least-loaded order: live sessions per unit of capacity, then calls in flight,
    then its id (so equal loads order the same way everywhere). `placed` counts sessions placed on it since its
    last heartbeat, which lags: the larger of the two counts."""
    sessions = max(status.live_sessions, placed)
    return (sessions / status.capacity, status.in_flight, status.worker_id)


def has_room(status: WorkerStatus, placed: int = 0) -> bool:
    """Whether the worker takes one more session."""
    return max(status.live_sessions, placed) < status.capacity


def least_loaded(candidates: Iterable[WorkerStatus], placed: Mapping[str, int] | None = None) -> WorkerStatus | None:
    """The least-loaded of `candidates` (None when there are none)."""
    placed = placed or {}
    return min(candidates, key=lambda s: load(s, placed.get(s.worker_id, 0)), default=None)


def choose_worker(
    live: Iterable[WorkerStatus],
    *,
    placed: Mapping[str, int],
    exclude: Collection[str] = (),
    preferred_cell: str | None = None,
) -> WorkerStatus | None:
    """Where a new session goes: among the active workers with room (not `exclude`d), the one serving
    `preferred_cell` (the scheduler's snapshot counts the session there), else the least loaded; None when no
    worker has room."""
    options = [
        s for s in live
        if s.state == "active" and s.worker_id not in exclude and has_room(s, placed.get(s.worker_id, 0))
    ]
    preferred = next((s for s in options if preferred_cell is not None and s.cell_id == preferred_cell), None)
    return preferred or least_loaded(options, placed)


def migration_target(
    peers: Iterable[WorkerStatus],
    *,
    preferred: Collection[str] = (),
    refused: Collection[str] = (),
    only_preferred: bool = False,
    follow: str | None = None,
) -> WorkerStatus | None:
    """Where a draining (or ordered) worker sends a session: an active peer that has not refused it, the worker
    its execution's other chains went to (`follow`: an execution's chains stay together), else the least loaded
    of the `preferred` ones, else of all (with `only_preferred`, only those). None when no peer takes it."""
    candidates = [p for p in peers if p.state == "active" and p.worker_id not in refused
                  and (not only_preferred or p.worker_id in preferred)]
    followed = next((p for p in candidates if follow is not None and p.worker_id == follow), None)
    return followed or least_loaded([p for p in candidates if p.worker_id in preferred] or candidates)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class SessionMirror:
    """What a worker holds of a session: the last prompt sent (the caller's array, not copied: prompts grow to a
    million ids and the gateway's are read-only views) followed by the completion it generated."""

    worker_id: str
    prompt: np.ndarray
    completion: np.ndarray

    def shared_with(self, prompt: np.ndarray) -> int:
        """How many leading ids `prompt` shares with the history."""
        shared = common_prefix_len(self.prompt, prompt)
        if shared < len(self.prompt):
            return shared
        return shared + common_prefix_len(self.completion, prompt[shared:])

    def delta_base(self, prompt: np.ndarray) -> int:
        """How many leading ids of `prompt` need not be sent: all it shares with the history, less the one id
        the engine must compute (a prompt the history covers entirely still needs a token to run)."""
        return min(self.shared_with(prompt), len(prompt) - 1)


__all__ = [
    "Load",
    "SessionMirror",
    "choose_worker",
    "common_prefix_len",
    "has_room",
    "least_loaded",
    "load",
    "migration_target",
]
