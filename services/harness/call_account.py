"""The account of an execution's model calls, folded from its stream: how many were answered, whether the
infrastructure refused the latest one (and why), whether one was refused for a spent call budget.

The gateway writes `call.completed` before it answers a call and `call.refused` before an error reaches the
agent, so once the agent has exited its stream holds every answer and refusal it saw. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from shared.events import CallCompleted, CallRefused, EventData

REFUSAL_CHARS = 500  # the longest refusal text kept (CallRefused.reason's own limit)


class CallAccount(BaseModel):
    """What an execution's stream says of its model calls."""

    model_config = ConfigDict(frozen=True)

    # Calls answered, counted from call 0 without a gap: the count an end event reports when the agent cannot
    # (a call the engine finishes after the agent stopped is recorded past the end and left out).
    answered: int = Field(default=0, ge=0)
    completed: int = Field(default=0, ge=0)  # call.completed events, gaps or not
    refused: int = Field(default=0, ge=0)  # call.refused events
    # "<status> <kind>: <reason>" of the latest call when the infrastructure refused it (429 or 5xx); cleared by
    # a later answer or by a refusal of the request itself (400, 413 ...).
    last_infra_refusal: str | None = None
    budget_spent: bool = False  # a call was refused because the execution's call budget was spent

    @property
    def recorded_any(self) -> bool:
        """Whether the gateway recorded any call of the execution, answered or refused."""
        return self.completed > 0 or self.refused > 0


def call_account(events: Iterable[EventData]) -> CallAccount:
    """Fold an execution's events, in stream order, into its call account; other event types are skipped."""
    indices: set[int] = set()
    completed = refused = 0
    last_infra_refusal: str | None = None
    budget_spent = False
    for data in events:
        if isinstance(data, CallCompleted):
            completed += 1
            indices.add(data.call_index)
            last_infra_refusal = None
        elif isinstance(data, CallRefused):
            refused += 1
            budget_spent = budget_spent or data.budget_spent
            last_infra_refusal = f"{data.status} {data.kind}: {data.reason}"[:REFUSAL_CHARS] if data.infra else None
    answered = 0
    while answered in indices:
        answered += 1
    return CallAccount(answered=answered, completed=completed, refused=refused,
                       last_infra_refusal=last_infra_refusal, budget_spent=budget_spent)
