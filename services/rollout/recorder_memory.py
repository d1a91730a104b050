"""The call recorder's in-memory backend, for tests and benchmarks: events and blobs in a list and a dict, versioned
per stream as the event store versions them. `fail_next` makes the next call's write fail (a store outage)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from services.rollout.recorder import LoggedRecorder
from shared.blobs import BlobNotFound, checked
from shared.events import BlobRef, CallCompleted, CallRefused, Event, stream_id_for
from shared.tokens import digest_of


class MemoryCallStorage:
    """`CallStorage` in memory. Appends are atomic: a failed one keeps nothing."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.blobs: dict[str, bytes] = {}
        self.fail_next: BaseException | None = None  # raised by the next `append_call`

    async def read_execution(self, execution_id: str) -> list[Event]:
        stream_id = stream_id_for("execution", execution_id)
        return [e for e in self.events if e.stream_id == stream_id]

    async def get_blob(self, ref: BlobRef) -> bytes:
        found = self.blobs.get(ref.digest)
        if found is None:
            raise BlobNotFound(ref.digest)
        return checked(ref, found)

    async def append_call(self, events: Sequence[Event], blob: bytes) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.blobs[digest_of(blob)] = blob
        self.add(events)

    async def append_events(self, events: Sequence[Event]) -> None:
        self.add(events)

    def add(self, events: Sequence[Event]) -> None:
        """Append now, each event at its stream's next version as the store versions them (expected_version
        "any"); tests also write here what other services would (an execution's start or end)."""
        heads: dict[str, int] = {}
        for event in events:
            head = heads.get(event.stream_id)
            if head is None:
                head = sum(1 for e in self.events if e.stream_id == event.stream_id)
            heads[event.stream_id] = head + 1
            self.events.append(event.model_copy(update={"version": head + 1}))


class InMemoryCallRecorder(LoggedRecorder):
    """The recorder over `MemoryCallStorage`; `events`, `blobs`, `fail_next` and `calls()` look into it."""

    storage: MemoryCallStorage

    def __init__(
        self,
        *,
        run_id: str = "test",
        clock: Callable[[], datetime] | None = None,
        storage: MemoryCallStorage | None = None,
    ) -> None:
        super().__init__(storage or MemoryCallStorage(), run_id=run_id, clock=clock)

    @property
    def events(self) -> list[Event]:
        return self.storage.events

    @property
    def blobs(self) -> dict[str, bytes]:
        return self.storage.blobs

    @property
    def fail_next(self) -> BaseException | None:
        return self.storage.fail_next

    @fail_next.setter
    def fail_next(self, exc: BaseException | None) -> None:
        self.storage.fail_next = exc

    def restarted(self) -> InMemoryCallRecorder:
        """A new recorder over the same storage (a gateway that restarted, its log kept)."""
        return InMemoryCallRecorder(run_id=self.run_id, clock=self._clock, storage=self.storage)

    def calls(self, execution_id: str | None = None) -> list[CallCompleted]:
        out = [e.data for e in self.events if isinstance(e.data, CallCompleted)]
        return [c for c in out if execution_id is None or c.execution_id == execution_id]

    def refusals(self, execution_id: str | None = None) -> list[CallRefused]:
        out = [e.data for e in self.events if isinstance(e.data, CallRefused)]
        return [r for r in out if execution_id is None or r.execution_id == execution_id]


__all__ = ["InMemoryCallRecorder", "MemoryCallStorage"]
