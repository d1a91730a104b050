"""Rank 0's side of the weights stream (shared/weights_stream.py): it holds its newest publication's shards and
sends them to each rollout worker that pulls them, over a pair group formed per pull.

One thread serves the pulls in ticket order. A pull that names shards rank 0 no longer holds (a newer
publication replaced them) is answered "not held" at once, and the worker reads the Object Store; a worker that
dies between its ticket and its group costs the group's timeout, after which the next ticket is served. Memory:
the newest publication's shards (the model's size in the published dtype), held as the bytes already stored.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from shared.weights_stream import HELD, TICKETS, StreamBackend, first_line, pair_group, rendezvous, shard_buffer

POLL_S = 0.02  # how often the serving thread looks for a new ticket


class StreamServer:
    """Rank 0's rendezvous store and the thread that answers pulls from it."""

    def __init__(self, host: str, port: int = 0, *, backend: StreamBackend = "gloo", device: str = "cpu",
                 timeout_s: float = 60.0, log: Any = None) -> None:
        self.host, self.backend, self.device, self.timeout_s, self.log = host, backend, device, timeout_s, log
        self._store = rendezvous(f"{host}:{port}", timeout_s, serve=True)
        self.address = f"{host}:{self._store.port}"
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0  # pulls sent whole
        self._thread = threading.Thread(target=self._serve, name="weights-stream", daemon=True)
        self._thread.start()

    def offer(self, shards: Mapping[str, bytes]) -> None:
        """Hold these shards (digest → bytes) from now on, in place of the publication held before."""
        with self._lock:
            self._held = dict(shards)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def _serve(self) -> None:
        served = 0
        while not self._stop.is_set():
            try:
                tickets = int(self._store.add(TICKETS, 0))
            except RuntimeError:
                return  # the store is gone with the process
            while served < tickets and not self._stop.is_set():
                served += 1
                self._answer(served)
            self._stop.wait(POLL_S)

    def _answer(self, ticket: int) -> None:
        started = time.perf_counter()
        try:
            self._store.wait([f"t{ticket}/want"])
            wanted = json.loads(self._store.get(f"t{ticket}/want"))
            with self._lock:
                shards = [self._held.get(d) for d in wanted]
            if any(s is None for s in shards):
                self._store.set(f"t{ticket}/answer", "not held: a newer publication replaced it")
                self._note("weights_stream_not_held", ticket=ticket)
                return
            self._store.set(f"t{ticket}/answer", HELD)
            group = pair_group(self._store, ticket, 0, self.backend, self.timeout_s)
            for i, data in enumerate(shards):
                assert data is not None
                group.send([shard_buffer(data, self.device)], 1, i).wait()
            self.served += 1
            self._note("weights_streamed", ticket=ticket, bytes=sum(len(s or b"") for s in shards),
                       seconds=round(time.perf_counter() - started, 3))
        except (RuntimeError, ValueError) as exc:  # the worker went away mid-pull: the next ticket is served
            self._note("weights_stream_failed", ticket=ticket, error=first_line(exc)[:200])

    def _note(self, what: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.info(what, **fields)


__all__ = ["StreamServer"]
