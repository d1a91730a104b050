"""What a cell is for: the one `Role` the scheduler orders, the cell agent carries out, events record and the
policies reason about (a chat message's author is `shared.chat.MessageRole`, another thing)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a cell does: serves rollouts, trains, or sits outside the budget. A `StrEnum`, so events hold the
    plain strings ("rollout", "train", "idle") and compare equal to them."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    IDLE = "idle"


__all__ = ["Role"]
