"""One execution end to end: sandbox + workspace, the harness (built-in loop or external command), grading.

The service shell calls `run_execution` (in a thread) and turns the observer's callbacks and the result
into events: branched while it runs, finished or timed_out when the agent stops, scored after grading. How
the agent's end is classified is decided in outcomes.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from services.harness.agent import AgentLoop
from services.harness.agent_core import AgentConfig, AgentOutcome, Branch, Budget
from services.harness.call_account import CallAccount
from services.harness.external import run_external
from services.harness.external_harness import ExternalHarness, ExternalOutcome, GatewayAccess
from services.harness.grading import GradeResult
from services.harness.outcomes import AgentStopped, agent_stopped, external_stopped
from services.harness.sandbox_spec import SandboxSpec
from services.harness.task_images import BaseImageMap
from services.harness.taskrun import open_sandbox, prepare, run_tests, sandbox_spec_for
from services.harness.tasks import Task

CALL_ACCOUNT_WAIT_S = 60.0  # how long an external execution's end waits for the account of its calls


class BuiltinHarness(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: Literal["builtin"] = "builtin"
    agent: AgentConfig


Harness = BuiltinHarness | ExternalHarness


class ExecutionObserver(Protocol):
    def branched(self, branch: Branch) -> None: ...

    def agent_stopped(self, stopped: AgentStopped) -> None: ...

    def call_account(self) -> CallAccount | None:
        """The account of the execution's model calls from its stream, asked when an external agent exits
        (None: unknown)."""
        ...


class NullObserver:
    def branched(self, branch: Branch) -> None:
        return None

    def agent_stopped(self, stopped: AgentStopped) -> None:
        return None

    def call_account(self) -> CallAccount | None:
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
    base_images: BaseImageMap | None = None,
    replay_calls: int = 0,
) -> ExecutionResult:
    """Run one execution; on a spent budget the agent stops and the work it left is graded all the same.

    `replay_calls` resumes a built-in agent whose harness stopped after that many answered calls: in a fresh
    sandbox the loop runs again from the start, the gateway answering those calls from the log, and goes on live
    after them."""
    observer = observer or NullObserver()
    wall = task.config.max_agent_timeout_sec
    if budget is not None and budget.wall_clock_s is not None:
        wall = min(wall, budget.wall_clock_s)
    budget = Budget(wall_clock_s=wall, max_calls=budget.max_calls if budget else None)
    external = isinstance(harness, ExternalHarness)
    sandbox = open_sandbox(task, state_dir, backend=backend, spec=_spec(task, harness, spec),
                           gateway_url=gateway.base_url if external else None, base_images=base_images)
    try:
        prepare(task, sandbox)
        agent_outcome: AgentOutcome | None = None
        external_outcome: ExternalOutcome | None = None
        if isinstance(harness, ExternalHarness):
            # The call budget is the gateway's to enforce here (it refuses calls past it): the agent cannot.
            external_outcome = run_external(harness, sandbox, gateway, task.instruction, timeout_s=wall)
            stopped = external_stopped(external_outcome, observer.call_account())
        else:
            loop = AgentLoop.for_gateway(gateway.base_url, gateway.token,
                                         harness.agent.model_copy(update={"model": gateway.model}), sandbox,
                                         sink=observer, replay_calls=replay_calls)
            agent_outcome = loop.run(task.instruction, budget)
            stopped = agent_stopped(agent_outcome)
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


def grade_preserved(task: Task, state_dir: Path, *, backend: str = "auto", spec: SandboxSpec | None = None,
                    base_images: BaseImageMap | None = None) -> GradeResult:
    """Re-attach to an execution's state folder (e.g. after a crash) and grade the work it holds."""
    if not (Path(state_dir) / "work").is_dir():
        raise FileNotFoundError(f"{state_dir}: expected a sandbox state folder with work/, found none")
    sandbox = open_sandbox(task, state_dir, backend=backend, spec=spec, base_images=base_images)
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
        on_call_account: Callable[[], Coroutine[Any, Any, CallAccount | None]] | None = None,
    ) -> None:
        self._loop = loop
        self._on_branched = on_branched
        self._on_stopped = on_stopped
        self._on_call_account = on_call_account

    def branched(self, branch: Branch) -> None:
        asyncio.run_coroutine_threadsafe(self._on_branched(branch), self._loop).result()

    def agent_stopped(self, stopped: AgentStopped) -> None:
        asyncio.run_coroutine_threadsafe(self._on_stopped(stopped), self._loop).result()

    def call_account(self) -> CallAccount | None:
        if self._on_call_account is None:
            return None
        future = asyncio.run_coroutine_threadsafe(self._on_call_account(), self._loop)
        try:
            return future.result(timeout=CALL_ACCOUNT_WAIT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None  # no answer in time: the exit stays the agent's own outcome


async def run_execution_async(executor: concurrent.futures.Executor | None = None, **kwargs: Any) -> ExecutionResult:
    """`run_execution` in a worker thread of `executor` (sandboxes and the SDK client block); same arguments.

    A service passes a pool of its own, one thread per execution slot: an execution's thread waits for its
    callbacks on the event loop, and those may need the loop's default pool (a host-name lookup for a new
    database connection), so executions must never fill the default pool."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(run_execution, **kwargs))
