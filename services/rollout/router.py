"""The router: sticky routing of executions to workers, rerouting on drain, moves and unreachable workers, and the
token deltas sent to each worker (it mirrors the history each worker holds for each session). Where a new
session goes and how much of a prompt is sent are the rules of `routing.py`; this is the loop around them.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.rollout.protocol import (
    GenerateReply,
    GenerateRequest,
    SamplingSpec,
    TokenPayload,
    tokens_digest,
)
from services.rollout.routing import SessionMirror, choose_worker
from shared.logging import get_logger
from shared.worker_status import WorkerStatus


class NoCapacity(Exception):
    def __init__(self, retry_after_s: float, detail: str) -> None:
        super().__init__(f"no rollout capacity: {detail}")
        self.retry_after_s = retry_after_s


class WorkerFailed(Exception):
    """A worker answered with an error (not a reroute); the call fails."""


class WorkerUnreachable(Exception):
    """The transport could not reach the worker (no responders, timeout)."""


class WorkerClient(Protocol):
    async def generate(self, worker_id: str, request: GenerateRequest, delta: np.ndarray) -> GenerateReply: ...


@dataclass
class WorkerDirectory:
    """Latest status of each worker, fed by their heartbeats; stale workers stop receiving new sessions."""

    stale_after_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    statuses: dict[str, WorkerStatus] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)

    def update(self, status: WorkerStatus) -> None:
        self.statuses[status.worker_id] = status
        self.seen_at[status.worker_id] = self.clock()
        self.unreachable.discard(status.worker_id)

    def get(self, worker_id: str) -> WorkerStatus | None:
        return self.statuses.get(worker_id)

    def live(self) -> list[WorkerStatus]:
        now = self.clock()
        return [
            s
            for wid, s in sorted(self.statuses.items())
            if now - self.seen_at[wid] <= self.stale_after_s and wid not in self.unreachable
        ]

    def candidates(self, exclude: str = "") -> list[WorkerStatus]:
        return [s for s in self.live() if s.worker_id != exclude]

    def silent(self, worker_id: str) -> bool:
        """Whether a worker that did beat has missed its beats for `stale_after_s` (died, hung, cut off)."""
        seen = self.seen_at.get(worker_id)
        return seen is not None and self.clock() - seen > self.stale_after_s


class Router:
    def __init__(
        self,
        directory: WorkerDirectory,
        client: WorkerClient,
        *,
        max_attempts: int = 6,
        retry_after_s: float = 2.0,
        watch_s: float = 1.0,
    ) -> None:
        self.directory = directory
        self.client = client
        self.max_attempts = max_attempts
        self.retry_after_s = retry_after_s
        self.watch_s = watch_s  # how often a request in flight checks that its worker still beats
        self.placement: dict[str, str] = {}  # execution_id -> worker_id (sticky)
        self.preferred: dict[str, str] = {}  # execution_id -> the cell the scheduler placed it on
        self._mirrors: dict[tuple[str, str], SessionMirror] = {}
        self.log = get_logger(component="router")

    def prefer(self, execution_id: str, cell_id: str) -> None:
        """The scheduler placed this execution on `cell_id`: its first placement goes there if it can."""
        self.preferred[execution_id] = cell_id

    def place(self, execution_id: str, *, exclude: set[str] | None = None) -> str:
        """The worker of the cell the scheduler placed the execution on, when it is active with room; else the
        least-loaded active worker with room (`routing.choose_worker`); NoCapacity when there is none. Heartbeats
        lag, so the sessions this router placed count too."""
        live = self.directory.live()
        chosen = choose_worker(live, placed=Counter(self.placement.values()), exclude=exclude or set(),
                               preferred_cell=self.preferred.get(execution_id))
        if chosen is None:
            raise NoCapacity(self.retry_after_s, f"{len(live)} live workers, none with room")
        self.preferred.pop(execution_id, None)  # a preference is used once: a later placement goes least loaded
        self.placement[execution_id] = chosen.worker_id
        return chosen.worker_id

    def worker_of(self, execution_id: str) -> str | None:
        return self.placement.get(execution_id)

    def holders(self, execution_id: str) -> list[str]:
        """Every worker that may hold the execution's sessions: where it was placed, then where each drain
        moved them (`WorkerStatus.moved`), which the router only learns at the execution's next call."""
        found: list[str] = []
        worker = self.placement.get(execution_id)
        while worker is not None and worker not in found:
            found.append(worker)
            status = self.directory.get(worker)
            worker = status.moved.get(execution_id) if status is not None else None
        return found

    def forget(self, execution_id: str) -> None:
        self.placement.pop(execution_id, None)
        self.preferred.pop(execution_id, None)
        for key in [k for k in self._mirrors if k[0] == execution_id]:
            del self._mirrors[key]

    async def generate(
        self,
        *,
        execution_id: str,
        chain_id: str,
        prompt: np.ndarray,
        sampling: SamplingSpec,
        request_id: str,
    ) -> GenerateReply:
        """Send the prompt as a delta against what the execution's worker holds; follow moves and drains."""
        key = (execution_id, chain_id)
        excluded: set[str] = set()
        reclaim: set[str] = set()  # workers whose sessions of this execution moved to a worker now excluded
        last = ""
        for _ in range(self.max_attempts):
            worker_id = self.placement.get(execution_id)
            if worker_id is None or worker_id in excluded:
                worker_id = self.place(execution_id, exclude=excluded)
            mirror = self._mirrors.get(key)
            base = mirror.delta_base(prompt) if mirror is not None and mirror.worker_id == worker_id else 0
            request = GenerateRequest(
                request_id=request_id,
                execution_id=execution_id,
                chain_id=chain_id,
                base_len=base,
                base_digest=tokens_digest(prompt[:base]) if base else "",
                delta=TokenPayload(count=len(prompt) - base),
                sampling=sampling,
                reclaim=worker_id in reclaim and base == 0,
            )
            try:
                reply = await self._generate_while_beating(worker_id, request, prompt[base:])
            except WorkerUnreachable as exc:
                last = f"worker {worker_id} unreachable: {exc}"
                self.log.warning("worker_unreachable", worker_id=worker_id, execution_id=execution_id, error=str(exc))
                self.directory.unreachable.add(worker_id)
                excluded.add(worker_id)
                self._drop_mirrors(execution_id)
                continue
            match reply.status:
                case "ok":
                    self._mirrors[key] = SessionMirror(worker_id, prompt, np.asarray(reply.completion, dtype=np.int32))
                    return reply
                case "moved":
                    assert reply.moved_to is not None
                    if reply.moved_to in excluded:
                        # It moved to a worker that is gone: the one it left serves it again, from the whole prompt.
                        reclaim.add(worker_id)
                        self._drop_mirrors(execution_id)
                        last = f"moved from {worker_id} to {reply.moved_to}, which is unreachable"
                        continue
                    self.placement[execution_id] = reply.moved_to
                    # The session's history moved with it, so the mirror stays valid on the new worker.
                    for k, m in self._mirrors.items():
                        if k[0] == execution_id and m.worker_id == worker_id:
                            m.worker_id = reply.moved_to
                    last = f"moved from {worker_id} to {reply.moved_to}"
                case "resync":
                    self._mirrors.pop(key, None)
                    last = f"resync on {worker_id}: {reply.detail}"
                case "draining":
                    excluded.add(worker_id)
                    self.placement.pop(execution_id, None)
                    self._drop_mirrors(execution_id)
                    last = f"worker {worker_id} draining"
                case _:
                    raise WorkerFailed(f"worker {worker_id}: {reply.detail}")
        raise NoCapacity(self.retry_after_s, f"gave up after {self.max_attempts} attempts; last: {last}")

    async def _generate_while_beating(self, worker_id: str, request: GenerateRequest,
                                      delta: np.ndarray) -> GenerateReply:
        """The worker's answer, or WorkerUnreachable once it misses its status beats while the request waits (a
        dead worker's in-flight request would otherwise wait out the transport's timeout, minutes): the caller
        then places the execution on another worker, which recomputes it from the whole prompt."""
        if self.directory.silent(worker_id):
            raise WorkerUnreachable(f"{worker_id} missed its status beats")
        call = asyncio.ensure_future(self.client.generate(worker_id, request, delta))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.watch_s)
                if done:
                    return call.result()
                if self.directory.silent(worker_id):
                    raise WorkerUnreachable(f"{worker_id} missed its status beats while request "
                                            f"{request.request_id} waited")
        finally:
            if not call.done():
                call.cancel()

    def _drop_mirrors(self, execution_id: str) -> None:
        for key in [k for k in self._mirrors if k[0] == execution_id]:
            del self._mirrors[key]
