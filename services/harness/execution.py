"""One execution end to end: sandbox + workspace, the harness (built-in loop or external command), grading.

The service shell calls `run_execution` (in a thread) and turns the observer's callbacks and the result
into events: branched while it runs, finished or timed_out when the agent stops, scored after grading.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from services.harness.agent import AgentConfig, AgentLoop, AgentOutcome, Budget
from services.harness.agent_core import Branch
from services.harness.external import ExternalHarness, ExternalOutcome, GatewayAccess, run_external
from services.harness.grading import GradeResult
from services.harness.sandbox import ProcessSandbox, SandboxSpec, make_sandbox
from services.harness.taskrun import prepare, run_tests, sandbox_spec_for
from services.harness.tasks import Task


GATEWAY_STATUS_WAIT_S = 60.0  # how long an external execution's end waits for the gateway's account of its calls


class BuiltinHarness(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: Literal["builtin"] = "builtin"
    agent: AgentConfig


Harness = BuiltinHarness | ExternalHarness
StopStatus = Literal["finished", "timed_out", "error"]
TimeoutBudget = Literal["wall_clock", "calls", "tokens", "crash"]


class AgentStopped(BaseModel):
    """What the agent phase ended with, reported before grading starts."""

    model_config = ConfigDict(frozen=True)

    status: StopStatus
    stop_reason: str
    budget: TimeoutBudget | None = None
    elapsed_s: float
    calls: int | None  # answered model calls; None where the harness cannot count them (an external agent)
    infra_failure: bool = False  # the model API failed the agent (see AgentOutcome.infra_failure)


class GatewayStatus(BaseModel):
    """What the gateway saw of an external execution's model calls (its `/internal/executions/{id}`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    last_infra_refusal: str | None = None  # why infrastructure refused the latest call, if it did
    call_budget_spent: bool = False  # a call was refused because the execution's call budget was spent


class ExecutionObserver(Protocol):
    def branched(self, branch: Branch) -> None: ...

    def agent_stopped(self, stopped: AgentStopped) -> None: ...

    def gateway_status(self) -> GatewayStatus | None:
        """The gateway's account of the execution's calls, asked when an external agent exits (None: unknown)."""
        ...


class NullObserver:
    def branched(self, branch: Branch) -> None:
        return None

    def agent_stopped(self, stopped: AgentStopped) -> None:
        return None

    def gateway_status(self) -> GatewayStatus | None:
        return None


class ExecutionResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    execution_id: str
    stopped: AgentStopped
    grade: GradeResult
    state_dir: Path
    agent: AgentOutcome | None = None
    external: ExternalOutcome | None = None


def _spec(task: Task, harness: Harness, base: SandboxSpec | None) -> SandboxSpec:
    spec = sandbox_spec_for(task, base)
    if isinstance(harness, ExternalHarness):
        update: dict[str, object] = {"ro_paths": (*spec.ro_paths, *harness.ro_paths)}
        if harness.limits is not None:
            update["limits"] = harness.limits
        spec = spec.model_copy(update=update)
    return spec


def run_execution(
    *,
    execution_id: str,
    task: Task,
    harness: Harness,
    gateway: GatewayAccess,
    state_dir: Path,
    budget: Budget | None = None,
    backend: str = "auto",
    spec: SandboxSpec | None = None,
    observer: ExecutionObserver | None = None,
) -> ExecutionResult:
    """Run one execution; on a spent budget the agent stops and the work it left is graded all the same."""
    observer = observer or NullObserver()
    wall = task.config.max_agent_timeout_sec
    if budget is not None and budget.wall_clock_s is not None:
        wall = min(wall, budget.wall_clock_s)
    budget = Budget(wall_clock_s=wall, max_calls=budget.max_calls if budget else None)
    external = isinstance(harness, ExternalHarness)
    sandbox = make_sandbox(state_dir, _spec(task, harness, spec), backend=backend, gateway_url=gateway.base_url if external else None)
    try:
        prepare(task, sandbox)
        agent_outcome: AgentOutcome | None = None
        external_outcome: ExternalOutcome | None = None
        if isinstance(harness, ExternalHarness):
            # The call budget is the gateway's to enforce here (it refuses calls past it): the agent cannot.
            external_outcome = run_external(harness, sandbox, gateway, task.instruction, timeout_s=wall)
            status = None if external_outcome.timed_out else observer.gateway_status()
            stopped = _external_stopped(external_outcome, status)
        else:
            loop = AgentLoop.for_gateway(gateway.base_url, gateway.token, harness.agent.model_copy(update={"model": gateway.model}), sandbox, sink=observer)
            agent_outcome = loop.run(task.instruction, budget)
            stopped = _agent_stopped(agent_outcome)
        observer.agent_stopped(stopped)
        graded, _ = run_tests(task, sandbox)
        return ExecutionResult(
            execution_id=execution_id,
            stopped=stopped,
            grade=graded,
            state_dir=sandbox.state_dir,
            agent=agent_outcome,
            external=external_outcome,
        )
    finally:
        # The state folder stays: it is the preserved work, and the crash path re-grades it.
        sandbox.close()


def _agent_stopped(outcome: AgentOutcome) -> AgentStopped:
    match outcome.status:
        case "timed_out":
            return AgentStopped(status="timed_out", stop_reason=outcome.error or "timed out", budget="wall_clock", elapsed_s=outcome.elapsed_s, calls=outcome.calls)
        case "calls_exhausted":
            return AgentStopped(status="timed_out", stop_reason=outcome.error or "call budget spent", budget="calls", elapsed_s=outcome.elapsed_s, calls=outcome.calls)
        case "error":
            return AgentStopped(status="error", stop_reason=outcome.error or "error", elapsed_s=outcome.elapsed_s,
                                calls=outcome.calls, infra_failure=outcome.infra_failure)
        case "submitted" | "ended":
            return AgentStopped(status="finished", stop_reason=outcome.status, elapsed_s=outcome.elapsed_s, calls=outcome.calls)
        case other:
            raise ValueError(f"unknown agent status {other!r}")


def _external_stopped(outcome: ExternalOutcome, status: GatewayStatus | None = None) -> AgentStopped:
    """An external harness's end, read with the gateway's account of its calls (`status`)."""
    if outcome.timed_out:
        return AgentStopped(status="timed_out", stop_reason="wall-clock budget spent", budget="wall_clock", elapsed_s=outcome.elapsed_s, calls=None)
    reason = "exit 0" if outcome.exit_code == 0 else f"exit {outcome.exit_code}"
    if status is not None and status.call_budget_spent:
        return AgentStopped(status="timed_out", stop_reason=f"call budget spent ({reason})", budget="calls",
                            elapsed_s=outcome.elapsed_s, calls=None)
    api_failure = status.last_infra_refusal if status is not None else None
    if outcome.exit_code != 0 and api_failure is not None:
        # It gave up because the model API failed it (after its own retries): the infrastructure's doing.
        return AgentStopped(status="error", stop_reason=f"{reason} after the model API refused its last call: {api_failure}",
                            elapsed_s=outcome.elapsed_s, calls=None, infra_failure=True)
    # Otherwise a harness that exits non-zero still ends normally from the execution's view; its work is graded.
    return AgentStopped(status="finished", stop_reason=reason, elapsed_s=outcome.elapsed_s, calls=None)


def grade_preserved(task: Task, state_dir: Path, *, backend: str = "auto", spec: SandboxSpec | None = None) -> GradeResult:
    """Re-attach to an execution's state folder (e.g. after a crash) and grade the work it holds."""
    if not (Path(state_dir) / "work").is_dir():
        raise FileNotFoundError(f"{state_dir}: expected a sandbox state folder with work/, found none")
    sandbox: ProcessSandbox = make_sandbox(state_dir, sandbox_spec_for(task, spec), backend=backend)
    try:
        graded, _ = run_tests(task, sandbox)
        return graded
    finally:
        sandbox.close()




class LoopObserver:
    """Bridges the execution's thread to async callbacks on the service's event loop.

    Each callback is awaited to completion before the execution goes on, so events are appended in
    the order things happened (a branch before the stop, the stop before the score).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        on_branched: Callable[[Branch], Coroutine[Any, Any, None]],
        on_stopped: Callable[[AgentStopped], Coroutine[Any, Any, None]],
        on_gateway_status: Callable[[], Coroutine[Any, Any, GatewayStatus | None]] | None = None,
    ) -> None:
        self._loop = loop
        self._on_branched = on_branched
        self._on_stopped = on_stopped
        self._on_gateway_status = on_gateway_status

    def branched(self, branch: Branch) -> None:
        asyncio.run_coroutine_threadsafe(self._on_branched(branch), self._loop).result()

    def agent_stopped(self, stopped: AgentStopped) -> None:
        asyncio.run_coroutine_threadsafe(self._on_stopped(stopped), self._loop).result()

    def gateway_status(self) -> GatewayStatus | None:
        if self._on_gateway_status is None:
            return None
        future = asyncio.run_coroutine_threadsafe(self._on_gateway_status(), self._loop)
        try:
            return future.result(timeout=GATEWAY_STATUS_WAIT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None  # no answer in time: the exit stays the agent's own outcome


async def run_execution_async(executor: concurrent.futures.Executor | None = None, **kwargs: Any) -> ExecutionResult:
    """`run_execution` in a worker thread of `executor` (sandboxes and the SDK client block); same arguments.

    A service passes a pool of its own, one thread per execution slot: an execution's thread waits for its
    callbacks on the event loop, and those may need the loop's default pool (a host-name lookup for a new
    database connection), so executions must never fill the default pool."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(run_execution, **kwargs))
