"""What the gateway holds of each live execution and the rules it applies to it (pure): settling an execution
from its log at its first call (seed, call budget, calls answered, the cell where its KV most likely is), the call
budget, each call's sampling seed, and the `call.refused` a refusal becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.rollout.call_log import Api, ExecutionSoFar
from services.rollout.errors import ApiError, CallBudgetSpent, is_infra_refusal
from services.rollout.tito import TitoState
from shared.calls import call_seed
from shared.events import CallRefused

REFUSAL_CHARS = 500  # a refusal's reason as the log keeps it (the message may quote a database error)
MAX_EXECUTION_SEED = 2**46  # call seeds, seed × 100003 + the call index, stay below 2^63


@dataclass
class ExecutionState:
    tito: TitoState = field(default_factory=TitoState)
    answered: int = 0  # model calls answered with a completion
    # From the execution's log (its `execution.started`): the seed a call that brings none samples with
    # (`call_seed(seed, answered)`) and the call budget (calls past it are refused, 400).
    seed: int | None = None
    max_calls: int | None = None
    settled: bool = False  # settled from the log (at its first call here)


@dataclass(frozen=True)
class Settled:
    """What settling an execution from its log decided beyond the state: where to place it first, and a seed
    the log holds that cannot seed calls (an older log; the calls sample unseeded)."""

    cell_id: str | None
    unusable_seed: int | None = None


def seed_problem(seed: object) -> str | None:
    """Why `seed` cannot seed an execution's calls (a call seed is seed × 100003 + the call index, below 2^63)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_EXECUTION_SEED:
        return (f"seed: expected an integer in [0, 2^46) (a call seed is seed × 100003 + the call index, "
                f"below 2^63), got {seed!r}")
    return None


def settle(state: ExecutionState, so_far: ExecutionSoFar) -> Settled:
    """Settle `state` from what the log holds: the seed and call budget of its `execution.started`, the calls
    answered so far (sampling seeds and the budget go on from there), and the cell of its latest call (else the
    one the scheduler placed it on)."""
    started = so_far.started
    unusable = None
    if started is not None:
        if seed_problem(started.seed) is None:
            state.seed = started.seed
        else:
            unusable = started.seed
        state.max_calls = started.call_budget
    state.answered = max(state.answered, so_far.calls)
    state.settled = True
    return Settled(cell_id=so_far.last_cell_id or (started.cell_id if started else None), unusable_seed=unusable)


def check_budget(state: ExecutionState) -> None:
    """Refuse a call past the execution's call budget (CallBudgetSpent, a 400)."""
    if state.max_calls is not None and state.answered >= state.max_calls:
        raise CallBudgetSpent(state.answered, state.max_calls)


def sampling_seed(state: ExecutionState, requested: int | None) -> int | None:
    """The seed a call samples with: its own, else the execution's for this call's index, else none."""
    if requested is not None or state.seed is None:
        return requested
    return call_seed(state.seed, state.answered)


def refusal(execution_id: str, exc: ApiError, *, api: Api, answered: int) -> CallRefused:
    """The `call.refused` of a call answered with `exc`: what the agent was told, never its token or body."""
    return CallRefused(
        execution_id=execution_id,
        status=exc.status,
        kind=exc.kind,
        reason=exc.message[:REFUSAL_CHARS],
        infra=is_infra_refusal(exc),
        budget_spent=isinstance(exc, CallBudgetSpent),
        answered=answered,
        api=api,
    )


__all__ = [
    "MAX_EXECUTION_SEED",
    "REFUSAL_CHARS",
    "ExecutionState",
    "Settled",
    "check_budget",
    "refusal",
    "sampling_seed",
    "seed_problem",
    "settle",
]
