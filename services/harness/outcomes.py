"""How an agent's run ended, as the execution reports it: finished, timed out (on which budget) or an error, and
whether the infrastructure rather than the policy stopped it. Pure: no I/O.

The built-in agent sees its own errors and says so in its outcome; an external harness is a black box whose
exit code does not say why it stopped, so its end is read together with the account of its model calls that
the gateway recorded on the execution's stream (call_account.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from services.harness.agent_core import AgentOutcome
from services.harness.call_account import CallAccount
from services.harness.external_harness import ExternalOutcome

StopStatus = Literal["finished", "timed_out", "error"]
TimeoutBudget = Literal["wall_clock", "calls", "tokens", "crash"]


class AgentStopped(BaseModel):
    """What the agent phase ended with, reported before grading starts."""

    model_config = ConfigDict(frozen=True)

    status: StopStatus
    stop_reason: str
    budget: TimeoutBudget | None = None
    elapsed_s: float
    calls: int | None  # answered model calls; None where nobody could count them (an external agent, no account)
    infra_failure: bool = False  # the model API failed the agent (see AgentOutcome.infra_failure)


def agent_stopped(outcome: AgentOutcome) -> AgentStopped:
    """The built-in agent's end: its own status says which budget ran out and whether the model API failed it."""
    match outcome.status:
        case "timed_out":
            return AgentStopped(status="timed_out", stop_reason=outcome.error or "timed out", budget="wall_clock",
                                elapsed_s=outcome.elapsed_s, calls=outcome.calls)
        case "calls_exhausted":
            return AgentStopped(status="timed_out", stop_reason=outcome.error or "call budget spent", budget="calls",
                                elapsed_s=outcome.elapsed_s, calls=outcome.calls)
        case "error":
            return AgentStopped(status="error", stop_reason=outcome.error or "error", elapsed_s=outcome.elapsed_s,
                                calls=outcome.calls, infra_failure=outcome.infra_failure)
        case "submitted" | "ended":
            return AgentStopped(status="finished", stop_reason=outcome.status, elapsed_s=outcome.elapsed_s,
                                calls=outcome.calls)
        case other:
            raise ValueError(f"unknown agent status {other!r}")


def external_stopped(outcome: ExternalOutcome, account: CallAccount | None) -> AgentStopped:
    """An external harness's end, read with the account of its calls (None: the account could not be read, and
    the exit is then the agent's own)."""
    calls = account.answered if account is not None else None
    if outcome.timed_out:
        return AgentStopped(status="timed_out", stop_reason="wall-clock budget spent", budget="wall_clock",
                            elapsed_s=outcome.elapsed_s, calls=calls)
    reason = "exit 0" if outcome.exit_code == 0 else f"exit {outcome.exit_code}"
    if account is not None and account.budget_spent:
        return AgentStopped(status="timed_out", stop_reason=f"call budget spent ({reason})", budget="calls",
                            elapsed_s=outcome.elapsed_s, calls=calls)
    if outcome.exit_code != 0 and account is not None:
        if account.last_infra_refusal is not None:
            # It gave up because the model API failed it (after its own retries): the infrastructure's doing.
            return AgentStopped(status="error", elapsed_s=outcome.elapsed_s, calls=calls, infra_failure=True,
                                stop_reason=f"{reason} after the model API refused its last call: "
                                            f"{account.last_infra_refusal}")
        if not account.recorded_any:
            # Not one call reached the gateway's log: it could not be reached (down, or the sandbox's route
            # broken) or did not recognise the token (a 401 names no execution, so it is never recorded). The
            # policy never produced a token, so its grade says nothing about the policy.
            return AgentStopped(status="error", elapsed_s=outcome.elapsed_s, calls=calls, infra_failure=True,
                                stop_reason=f"{reason} before the gateway recorded any model call of it")
    # Otherwise a harness that exits non-zero still ends normally from the execution's view; its work is graded.
    return AgentStopped(status="finished", stop_reason=reason, elapsed_s=outcome.elapsed_s, calls=calls)
