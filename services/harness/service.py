"""The harness service shell: turns `query.dispatched` into G executions, runs them concurrently up to a
limit, and reports their lives as events (started, branched, finished / timed_out, scored).

Executions are announced (`execution.started`) in the same transaction that records the dispatch as
processed, and launched only after it commits. The gateway takes each execution up from that event (seed,
call budget, cell); the harness derives the execution's token itself from the secret both share, and reads
the gateway's account of an external agent's calls back from the execution's stream: no control call goes
from here to the gateway. After a crash, `recover` finds executions that started but never ended and resumes
each built-in one (`execution.resumed`: the agent runs again in a fresh workspace, the gateway answering its
recorded calls from the log, and goes on live); one it cannot resume is timed out (`budget="crash"`), graded
on the work its sandbox preserved and marked an infrastructure failure, which is not trained.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.harness.agent_core import AgentConfig, Branch, Budget
from services.harness.call_account import CallAccount, call_account
from services.harness.execution import BuiltinHarness, Harness, LoopObserver, grade_preserved, run_execution_async
from services.harness.external_harness import GatewayAccess
from services.harness.outcomes import AgentStopped
from services.harness.planning import plan_query, recovery_actions
from services.harness.task_images import BaseImageMap
from services.harness.tasks import Task, TaskFormatError, load_task
from services.harness.uid_pool import UID_POOL
from shared.effects import Effects
from shared.events import (
    Event,
    EventData,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionResumed,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    QueryDispatched,
    stream_id_for,
)
from shared.execution_tokens import derive_execution_token
from shared.gateways import gateway_for, gateway_urls
from shared.runtime import Service
from shared.settings import NameList, Settings

END_TYPES = ("execution.finished", "execution.timed_out")
# An execution whose harness keeps stopping under it is given up (an infrastructure failure) after this many resumes.
MAX_RESUMES = 3


@dataclass(frozen=True)
class Resume:
    """How a restarted harness picks an execution up: its first `replay_calls` calls are answered from the log,
    and the branches the log already announces (kind, call index, chain) are not announced again."""

    replay_calls: int
    announced: frozenset[tuple[str, int, str]]
TOKEN_SECRET_VARIABLES = ("GYRE_HARNESS_GATEWAY_TOKEN_SECRET", "GYRE_ROLLOUT_TOKEN_SECRET")


class TokenSecretMissingError(RuntimeError):
    """The harness was started without the secret its executions' tokens are derived from."""


class HarnessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_HARNESS_", extra="ignore")

    tasks_dir: Path = Path("tasks")
    work_dir: Path = Path(".gyre/executions")
    # The gateway's default GYRE_ROLLOUT_PORT; a run served by several gateways lists them all, comma-separated,
    # and each execution sticks to one of them (shared.gateways).
    gateway_url: str = "http://127.0.0.1:8400"
    # The gateway's GYRE_ROLLOUT_TOKEN_SECRET (read from it when not set), required: each execution's token is
    # derived from it and the execution id (shared.execution_tokens), and the gateway, holding the same secret,
    # recognises the token without being told of it, across its restarts too.
    gateway_token_secret: str = Field(default_factory=lambda: os.environ.get("GYRE_ROLLOUT_TOKEN_SECRET", ""),
                                      repr=False)
    model_name: str = "gyre"
    concurrency: int = 2
    harness: Literal["builtin", "claude-code"] = "builtin"
    claude_code_dir: Path = Path(".cache/claude-code")
    # The built-in tools Claude Code offers the model (its --tools), comma-separated; empty: its default set.
    claude_code_tools: NameList = Field(default_factory=list)
    wall_budget_s: float | None = None
    call_budget: int | None = None
    max_tokens: int = 256
    compact_at_tokens: int = 6000
    # How long the built-in agent rides out a model API that refuses or cannot be reached (a gateway or rollout
    # worker restarting) before its execution ends as an infrastructure failure (AgentConfig.api_outage_s).
    api_outage_s: float = 300.0
    backend: str = "auto"
    # The Docker backend's base-image map, `ref=image,...,*=default` (services.harness.task_images.BaseImageMap).
    base_images: str = ""


class HarnessService(Service):
    name = "harness"

    def __init__(self, settings: Settings | None = None, harness: HarnessSettings | None = None) -> None:
        super().__init__(settings)
        self.h = harness or HarnessSettings()
        self._gateways = gateway_urls(self.h.gateway_url)  # a bad list is named before anything runs
        self._slots = asyncio.Semaphore(self.h.concurrency)
        # One thread per slot, apart from the event loop's default pool (see run_execution_async).
        self._threads = concurrent.futures.ThreadPoolExecutor(self.h.concurrency, thread_name_prefix="execution")
        self._running: dict[str, asyncio.Task[None]] = {}
        self._task_cache: dict[str, Task] = {}
        self._base_images = BaseImageMap.parse(self.h.base_images)  # a bad map is named before anything runs

    def token_secret(self) -> bytes:
        """The secret execution tokens are derived from; a named error when it was not configured."""
        if not self.h.gateway_token_secret:
            raise TokenSecretMissingError(
                f"the harness derives each execution's token from the gateway's secret: expected it in "
                f"{' or '.join(TOKEN_SECRET_VARIABLES)}, found neither set"
            )
        return self.h.gateway_token_secret.encode()

    async def setup(self) -> None:
        self.token_secret()  # before anything is recovered or launched: no execution could call the model
        if os.geteuid() == 0:  # process sandboxes run as pool uids only under root
            swept = await asyncio.to_thread(UID_POOL.sweep_orphans)
            if swept:
                self.log.warning("orphaned_sandboxes_killed", uids=swept)
        if self.h.backend == "docker":  # containers outlive the harness that started them
            from services.harness.docker_sandbox import sweep_orphan_containers

            removed = await asyncio.to_thread(sweep_orphan_containers, self.h.work_dir)
            if removed:
                self.log.warning("orphaned_containers_removed", containers=removed)
        await self.recover()
        self.on(["query.dispatched"], self.dispatch)

    async def teardown(self) -> None:
        for task in self._running.values():
            task.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        return {"running_executions": len(self._running)}

    # ---- tasks ----

    def task(self, task_id: str) -> Task:
        if task_id not in self._task_cache:
            path = self.h.tasks_dir / task_id
            if not path.is_dir():
                raise TaskFormatError(path, None, f"no such task folder for task_id {task_id!r}")
            self._task_cache[task_id] = load_task(path)
        return self._task_cache[task_id]

    def harness_config(self, name: str | None = None) -> Harness:
        """The harness `name` (an execution's `execution.started.harness`), this service's own by default."""
        name = name or self.h.harness
        if name not in ("builtin", "claude-code"):
            raise ValueError(f"unknown harness {name!r}: expected builtin or claude-code")
        if name == "claude-code":
            from services.harness.external_harness import claude_code

            return claude_code(self.h.claude_code_dir.resolve(), self.h.model_name, tools=self.h.claude_code_tools)
        return BuiltinHarness(
            agent=AgentConfig(
                model=self.h.model_name, max_tokens=self.h.max_tokens, compact_at_tokens=self.h.compact_at_tokens,
                api_outage_s=self.h.api_outage_s,
            )
        )

    # ---- dispatch ----

    async def dispatch(self, event: Event) -> Effects:
        q = event.data
        assert isinstance(q, QueryDispatched)
        self.task(q.task_id)  # a bad task id fails here, before anything is announced
        # Execution ids derive from the query, so a redelivered dispatch names the same executions.
        effects = Effects()
        for planned in plan_query(query_id=q.query_id, task_id=q.task_id, group_size=q.group_size, seeds=q.seeds):
            started = ExecutionStarted(
                execution_id=planned.execution_id,
                query_id=q.query_id,
                task_id=q.task_id,
                group_size=q.group_size,
                sample_index=planned.sample_index,
                seed=planned.seed,
                step=q.step,
                harness=q.harness if q.harness != "builtin" else self.h.harness,
                policy_version=q.policy_version,
                wall_budget_s=self.h.wall_budget_s,
                call_budget=self.h.call_budget,
                cell_id=q.placements[planned.sample_index] if len(q.placements) == q.group_size else None,
            )
            stream = stream_id_for("execution", planned.execution_id)
            effects.append([self.event(started, stream_id=stream, cause=event)], expected_version="any")
            effects.after_commit(_bind(self._launch, started, event))
        return effects

    def _launch(self, started: ExecutionStarted, cause: Event | None, resume: Resume | None = None) -> None:
        if started.execution_id in self._running:
            return
        task = asyncio.ensure_future(self._run(started, cause, resume))
        task.set_name(f"execution-{started.execution_id}")
        self._running[started.execution_id] = task
        task.add_done_callback(lambda _: self._running.pop(started.execution_id, None))
        # An execution whose end or score could not be written is left to recovery: the service reports itself
        # unhealthy so that a supervisor restarts it.
        task.add_done_callback(self._task_ended)

    async def read_call_account(self, execution_id: str) -> CallAccount:
        """The account of an execution's model calls, folded from its stream (the gateway records each answer
        and each refusal there before the agent sees it)."""
        assert self.store is not None
        stored = await self.store.read_stream(stream_id_for("execution", execution_id))
        return call_account(item.event.data for item in stored)

    async def _account_at_exit(self, execution_id: str) -> CallAccount | None:
        """The account an external agent's end is read with; one that cannot be read leaves the exit graded as
        the agent's own."""
        try:
            return await self.read_call_account(execution_id)
        except Exception as exc:  # whatever stops the read, the exit stays the agent's own outcome
            self.log.warning("call_account_unavailable", execution_id=execution_id, error=str(exc))
            return None

    async def _run(self, started: ExecutionStarted, cause: Event | None, resume: Resume | None = None) -> None:
        execution_id = started.execution_id
        stream = stream_id_for("execution", execution_id)
        loop = asyncio.get_running_loop()
        log = self.log.bind(execution_id=execution_id, query_id=started.query_id)
        async with self._slots:
            t0 = time.monotonic()
            ended = False
            token = derive_execution_token(self.token_secret(), execution_id)

            async def on_branched(branch: Branch) -> None:
                if resume is not None and (branch.kind, branch.at_call_index, branch.chain) in resume.announced:
                    return  # the agent redoing a replayed part: its predecessor announced this branch
                await self._emit(
                    ExecutionBranched(
                        execution_id=execution_id, kind=branch.kind, at_call_index=branch.at_call_index,
                        from_call_index=branch.from_call_index, chain_id=branch.chain, reason=branch.reason,
                    ),
                    stream, cause,
                )

            async def on_stopped(stopped: AgentStopped) -> None:
                nonlocal ended
                calls = stopped.calls if stopped.calls is not None else await self.recorded_calls(execution_id)
                await self._emit(_ended(execution_id, stopped, calls), stream, cause)
                ended = True

            budget = Budget(wall_clock_s=self.h.wall_budget_s, max_calls=self.h.call_budget)
            try:
                result = await run_execution_async(
                    self._threads,
                    execution_id=execution_id,
                    task=self.task(started.task_id),
                    harness=self.harness_config(started.harness),
                    gateway=GatewayAccess(base_url=gateway_for(execution_id, self._gateways), token=token,
                                          model=self.h.model_name),
                    state_dir=self.h.work_dir / execution_id,
                    budget=budget,
                    backend=self.h.backend,
                    base_images=self._base_images,
                    replay_calls=resume.replay_calls if resume is not None else 0,
                    observer=LoopObserver(loop, on_branched=on_branched, on_stopped=on_stopped,
                                          on_call_account=lambda: self._account_at_exit(execution_id)),
                )
            except Exception as exc:
                log.exception("execution_failed", error=str(exc))
                if not ended:  # one end per execution: grading may fail after the agent's own end was reported
                    await self._emit(
                        ExecutionTimedOut(execution_id=execution_id, budget="crash", elapsed_s=time.monotonic() - t0,
                                          calls=await self.recorded_calls(execution_id)), stream, cause)
                await self._emit(self._zero_score(started, str(exc)), stream, cause)
                return
            grade = result.grade
            infra_failure = result.stopped.stop_reason if result.stopped.infra_failure else None
            await self._emit(
                ExecutionScored(
                    execution_id=execution_id, query_id=started.query_id, reward=grade.score,
                    tests_passed=grade.passed, tests_total=len(grade.tests),
                    timed_out=result.stopped.status == "timed_out", infra_failure=infra_failure,
                ),
                stream, cause,
            )
            log.info("execution_scored", reward=grade.score, status=result.stopped.status, infra_failure=infra_failure)

    async def recorded_calls(self, execution_id: str) -> int:
        """How many of an execution's calls the log holds, counted from call 0 without a gap: the count an end
        event reports when the agent could not (an external harness, a crash). The gateway records a call
        before it answers, so every call the agent was answered is in this count; a call the engine finishes
        later is recorded past the end and left out of the trajectory."""
        return (await self.read_call_account(execution_id)).answered

    def _zero_score(self, started: ExecutionStarted, reason: str) -> ExecutionScored:
        self.log.warning("execution_scored_zero", execution_id=started.execution_id, reason=reason)
        return ExecutionScored(execution_id=started.execution_id, query_id=started.query_id, reward=0.0,
                               tests_passed=0, tests_total=0, timed_out=True, infra_failure=reason or "unknown")

    async def _emit(self, data: EventData, stream: str, cause: Event | None) -> None:
        await self.emit([self.event(data, stream_id=stream, cause=cause)], expected_version="any")

    # ---- recovery ----

    async def recover(self) -> None:
        """Executions this run started but never ended are resumed (a built-in agent, MAX_RESUMES times at
        most); the others are timed out ('crash'), graded on what they left and marked infrastructure failures,
        not trained: their end is the harness's, not the policy's. Ended but unscored ones are graded."""
        assert self.store is not None
        stages: dict[str, list[Any]] = {}
        started: dict[str, ExecutionStarted] = {}
        ends: dict[str, EventData] = {}
        resumes: Counter[str] = Counter()
        types = ["execution.started", *END_TYPES, "execution.scored", "execution.resumed"]
        for stored in await self.store.read_all(types=types, run_id=self.settings.run_id):
            data = stored.event.data
            if isinstance(data, ExecutionStarted):
                started[data.execution_id] = data
            elif isinstance(data, (ExecutionFinished, ExecutionTimedOut)):
                ends.setdefault(data.execution_id, data)
            elif isinstance(data, ExecutionResumed):
                resumes[data.execution_id] += 1
                continue
            stage = {"execution.started": "started", "execution.scored": "scored"}.get(stored.event.type, "stopped")
            stages.setdefault(data.execution_id, []).append(stage)  # type: ignore[attr-defined]
        for action in recovery_actions(stages):
            s = started[action.execution_id]
            stream = stream_id_for("execution", s.execution_id)
            crashed: str | None = None
            if action.mark_timed_out:
                why_not = self._why_not_resumable(s, resumes[s.execution_id])
                if why_not is None:
                    await self._resume(s, attempt=resumes[s.execution_id] + 1)
                    continue
                crashed = f"the harness stopped mid-execution and {why_not}"
                calls = await self.recorded_calls(s.execution_id)
                await self._emit(ExecutionTimedOut(execution_id=s.execution_id, budget="crash", elapsed_s=0,
                                                   calls=calls), stream, None)
                if calls == 0:
                    # The workspace is as the task left it, and its grade says nothing about the policy.
                    await self._emit(self._zero_score(s, "the harness stopped before the first model call"),
                                     stream, None)
                    continue
            try:
                grade = await asyncio.to_thread(
                    grade_preserved, self.task(s.task_id), self.h.work_dir / s.execution_id, backend=self.h.backend,
                    base_images=self._base_images,
                )
            except (FileNotFoundError, TaskFormatError) as exc:
                await self._emit(self._zero_score(s, f"nothing preserved: {exc}"), stream, None)
                continue
            except Exception as exc:  # a sandbox that cannot start, say: one execution must not stop the service
                self.log.exception("recovery_grading_failed", execution_id=s.execution_id)
                await self._emit(self._zero_score(s, f"grading after the crash failed: {type(exc).__name__}: {exc}"),
                                 stream, None)
                continue
            # Scored as the live path would have: by how the execution ended, when its end was recorded; one the
            # harness's stop ended is graded for the record and not trained.
            end = ends.get(s.execution_id)
            finished = end if isinstance(end, ExecutionFinished) else None
            infra = crashed or (finished.stop_reason if finished and finished.infra_failure else None)
            await self._emit(
                ExecutionScored(execution_id=s.execution_id, query_id=s.query_id, reward=grade.score,
                                tests_passed=grade.passed, tests_total=len(grade.tests), timed_out=finished is None,
                                infra_failure=infra),
                stream, None,
            )
            self.log.info("recovered_execution", execution_id=s.execution_id, reward=grade.score)

    def _why_not_resumable(self, started: ExecutionStarted, resumed: int) -> str | None:
        """None when the execution can be resumed; else why not, as its infrastructure failure says it."""
        harness = started.harness or self.h.harness
        if harness != "builtin":
            return f"a {harness} agent cannot be resumed (its process went with the harness)"
        if resumed >= MAX_RESUMES:
            return f"was resumed {resumed} times already"
        return None

    async def _resume(self, started: ExecutionStarted, *, attempt: int) -> None:
        """Run the execution again from its start in a fresh workspace, its answered calls replayed from the log
        (the agent redoes their commands), and go on live from there."""
        assert self.store is not None
        execution_id = started.execution_id
        stream = stream_id_for("execution", execution_id)
        stored = [item.event.data for item in await self.store.read_stream(stream)]
        replay = call_account(stored).answered
        announced = frozenset((d.kind, d.at_call_index, d.chain_id) for d in stored if isinstance(d, ExecutionBranched))
        await self._emit(ExecutionResumed(execution_id=execution_id, replayed_calls=replay, attempt=attempt),
                         stream, None)
        # What the stopped agent left half done would be done twice: its commands run again from the start.
        await asyncio.to_thread(shutil.rmtree, self.h.work_dir / execution_id, True)
        self.log.info("execution_resumed", execution_id=execution_id, replayed_calls=replay, attempt=attempt)
        self._launch(started, None, Resume(replay_calls=replay, announced=announced))


def _bind(fn: Any, *args: Any) -> Any:
    return lambda: fn(*args)


def _ended(execution_id: str, stopped: AgentStopped, calls: int) -> EventData:
    if stopped.status == "timed_out":
        return ExecutionTimedOut(
            execution_id=execution_id, budget=stopped.budget or "wall_clock", elapsed_s=stopped.elapsed_s, calls=calls,
        )
    return ExecutionFinished(
        execution_id=execution_id, elapsed_s=stopped.elapsed_s, calls=calls, stop_reason=stopped.stop_reason,
        infra_failure=stopped.infra_failure,
    )
