"""What an event handler decided, as data: the events to append, the blobs they refer to and the work to start
once both are durable. A handler computes its `Effects` outside any transaction; the runtime records them with
the handler's tracking row in one short transaction (`Transaction.record`), so no transaction stays open while a
handler trains a step or builds a batch. Pure: nothing here touches the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.blobs import DEFAULT_MEDIA_TYPE, blob_ref
from shared.events import BlobRef, Event

ExpectedVersion = int | Literal["any"] | None


@dataclass(frozen=True, slots=True)
class Append:
    """One append: `expected_version` as `EventStore.append` takes it (None: the events' own versions)."""

    events: tuple[Event, ...]
    expected_version: ExpectedVersion = None


@dataclass(slots=True)
class Effects:
    """Collected by a handler, recorded by the runtime: appends in order, blobs first (the events refer to
    them), then `after_commit` callbacks once the transaction has committed."""

    appends: list[Append] = field(default_factory=list)
    blobs: list[tuple[bytes, str]] = field(default_factory=list)
    callbacks: list[Callable[[], Any]] = field(default_factory=list)

    def append(self, events: Sequence[Event], *, expected_version: ExpectedVersion = None) -> None:
        self.appends.append(Append(tuple(events), expected_version))

    def put_blob(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE) -> BlobRef:
        """Store a blob (in Postgres, with the events) and return its reference, known before it is written."""
        self.blobs.append((data, media_type))
        return blob_ref(data, media_type)

    def after_commit(self, callback: Callable[[], Any]) -> None:
        """Run `callback` (a function, or one returning an awaitable) once the effects are durable."""
        self.callbacks.append(callback)

    def __bool__(self) -> bool:
        return bool(self.appends or self.blobs or self.callbacks)


__all__ = ["Append", "Effects", "ExpectedVersion"]
