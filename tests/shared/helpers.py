"""Small builders shared by the foundation tests."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from shared.events import CellAssigned, Event, new_event

_counter = itertools.count()


def assigned(stream: str = "cell-a", version: int = 1, *, run_id: str = "r", role: str = "rollout") -> Event:
    return new_event(
        CellAssigned(cell_id=stream.removeprefix("cell-"), role=role, policy="async", reason=f"n{next(_counter)}"),
        run_id=run_id,
        stream_id=stream,
        version=version,
        occurred_at=datetime.now(UTC),
    )
