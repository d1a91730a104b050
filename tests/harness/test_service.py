"""The harness service on real NATS and PostgreSQL: query.dispatched in, execution events out, crash recovery."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request

from services.harness.service import HarnessService, HarnessSettings, TokenSecretMissingError
from shared.events import CallRefused, QueryDispatched, execution_id_for, new_event, stream_id_for
from shared.execution_tokens import derive_execution_token, execution_of_token
from shared.relay import OutboxRelay
from shared.runtime import utcnow
from shared.settings import Settings
from tests.conftest import Infra, unique
from tests.harness.scripted_server import RefusalHook, ScriptedAnthropicServer, failure, shell, submit

REPO = Path(__file__).resolve().parents[2]
SECRET = "harness-test-token-secret-0123456789"  # the run's token secret, shared with the gateway


def gateway(script: list[Any], *, on_refused: RefusalHook | None = None) -> ScriptedAnthropicServer:
    """A scripted model API standing in for the gateway; `paths` records every path the harness asked for."""
    server = ScriptedAnthropicServer(script, on_refused=on_refused)
    paths: list[str] = []

    @server.app.middleware("http")
    async def record_path(request: Request, call_next: Any) -> Any:
        paths.append(request.url.path)
        return await call_next(request)

    server.paths = paths  # type: ignore[attr-defined]
    return server.start()


def service(
    infra: Infra, store, bus, tmp_path: Path, server: ScriptedAnthropicServer, run_id: str,
    cls: type[HarnessService] = HarnessService, secret: str | None = SECRET,
) -> HarnessService:
    """The service under test; `secret` None leaves the token secret to the environment."""
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, ack_wait_s=30,
    )
    h = HarnessSettings(
        tasks_dir=REPO / "tasks", work_dir=tmp_path / "executions", gateway_url=server.base_url,
        model_name="scripted-model", concurrency=1, wall_budget_s=60,
        api_outage_s=1.0,  # how long an agent rides out a failing model API (the service's default is 300 s)
        **({"gateway_token_secret": secret} if secret is not None else {}),
    )
    return cls(settings, h)


async def wait_for_types(store, run_id: str, wanted: dict[str, int], timeout: float = 120) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = [s.event for s in await store.read_all(run_id=run_id)]
        counts = {t: sum(1 for e in events if e.type == t) for t in wanted}
        if all(counts[t] >= n for t, n in wanted.items()):
            return events
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {wanted}; have {counts}")
        await asyncio.sleep(0.2)


async def dispatch_and_wait(
    store, bus, infra: Infra, tmp_path: Path, server: ScriptedAnthropicServer, query: QueryDispatched,
    wanted: dict[str, int], cls: type[HarnessService] = HarnessService, secret: str | None = SECRET,
) -> list:
    """Run the harness service (and a relay) on one dispatched query until the wanted events are in the log."""
    run_id = unique("run-")
    svc = service(infra, store, bus, tmp_path, server, run_id, cls, secret)
    stop = asyncio.Event()
    relay = OutboxRelay(store, bus, dsn=infra.database_url, idle_wait_s=0.1)
    relay_task = asyncio.create_task(relay.run(stop))
    try:
        await svc.start()
        dispatch = new_event(query, run_id=run_id, stream_id=f"query-{query.query_id}", version=1, occurred_at=utcnow())
        await store.append([dispatch])
        return await wait_for_types(store, run_id, wanted)
    finally:
        await svc.stop()
        stop.set()
        await relay_task
        server.stop()


async def test_a_dispatched_query_runs_its_group_and_scores_each_execution(store, bus, infra: Infra, tmp_path):
    server = gateway([shell("printf 'hello world\\n' > /app/hello.txt"), submit(), submit()])
    query = QueryDispatched(query_id="q1", task_id="create-file-1", group_size=2, seeds=[11, 12], step=0, policy_version=0,
                            placements=["n1-cell1", "n1-cell0"])
    events = await dispatch_and_wait(store, bus, infra, tmp_path, server, query,
                                     {"execution.started": 2, "execution.finished": 2, "execution.scored": 2})
    scored = {e.data.execution_id: e.data for e in events if e.type == "execution.scored"}
    assert scored[execution_id_for("q1", 0)].reward == 1.0
    assert scored[execution_id_for("q1", 1)].reward < 1.0
    assert all(s.infra_failure is None for s in scored.values())
    # The gateway takes each execution up from its start event: the seed (it seeds every call), the call budget
    # (it enforces it) and the cell the scheduler placed it on.
    started = [e.data for e in events if e.type == "execution.started"]
    assert [(s.sample_index, s.seed, s.group_size, s.cell_id, s.call_budget) for s in started] == [
        (0, 11, 2, "n1-cell1", None), (1, 12, 2, "n1-cell0", None)]
    # Every request carried its own execution's token, derived from the secret the gateway holds too; the
    # harness asked the gateway for nothing but model calls.
    assert {h["authorization"] for h in server.headers} == {
        f"Bearer {derive_execution_token(SECRET.encode(), execution_id_for('q1', i))}" for i in (0, 1)
    }
    assert set(server.paths) == {"/v1/messages"}  # type: ignore[attr-defined]
    for e in events:  # events of one execution share its stream, in order
        if e.type.startswith("execution."):
            assert e.stream_id == stream_id_for("execution", e.data.execution_id)


async def recover_crashed(store, bus, infra, tmp_path, run_id: str,
                          executions: dict[str, tuple[bool, int]]) -> list:
    """What a harness that died left: `executions` maps each execution id to (its workspace holds the answer,
    model calls it made). Each ran Claude Code, whose process went with the harness, so it cannot be resumed (a
    built-in one is: tests/harness/test_resume.py). A fresh service recovers them; returns the run's events once
    each is ended and scored."""
    from services.trajectory.synthetic import SyntheticExecution

    server = gateway([])
    work = tmp_path / "executions"
    for i, (eid, (answered, calls)) in enumerate(executions.items()):
        if answered:
            (work / eid / "work").mkdir(parents=True)
            (work / eid / "work" / "hello.txt").write_text("hello world\n")
        log = SyntheticExecution(eid, query_id=eid.rsplit("-", 1)[0], run_id=run_id, task_id="create-file-1",
                                 group_size=len(executions), sample_index=i, seed=i)
        log.start(harness="claude-code")
        prompt = [1, 2, 3]
        for c in range(calls):
            log.call(prompt, [4 + c])
            prompt = [*prompt, 4 + c, 9]
        assert log.stream_id == stream_id_for("execution", eid)
        await store.append(log.events)
    svc = service(infra, store, bus, tmp_path, server, run_id)
    n = len(executions)
    try:
        await svc.start()
        return await wait_for_types(store, run_id, {"execution.timed_out": n, "execution.scored": n})
    finally:
        await svc.stop()
        server.stop()


async def test_restart_marks_unfinished_executions_timed_out_and_grades_preserved_work(store, bus, infra, tmp_path):
    # Three executions were running when the harness died: one had made two model calls and written the
    # answer, one had not started, and one had its workspace (here one that would pass) but no model call yet.
    done_id, empty_id, uncalled_id = "qc-s0", "qc-s1", "qc-s2"
    events = await recover_crashed(store, bus, infra, tmp_path, unique("run-"),
                                   {done_id: (True, 2), empty_id: (False, 0), uncalled_id: (True, 0)})
    timed_out = {e.data.execution_id: (e.data.budget, e.data.calls) for e in events if e.type == "execution.timed_out"}
    # The crash mark reports the calls the log holds, so the trajectory keeps the work done before the crash.
    assert timed_out == {done_id: ("crash", 2), empty_id: ("crash", 0), uncalled_id: ("crash", 0)}
    scored = {e.data.execution_id: e.data for e in events if e.type == "execution.scored"}
    assert scored[done_id].reward == 1.0 and scored[done_id].timed_out
    assert scored[empty_id].reward == 0.0
    # Graded for the record, but the harness ended it, not the policy: an infrastructure failure, not trained
    # (and one that made no model call scores 0 whatever its untouched workspace would score).
    assert scored[done_id].infra_failure == ("the harness stopped mid-execution and a claude-code agent cannot be "
                                             "resumed (its process went with the harness)")
    for eid in (empty_id, uncalled_id):
        assert scored[eid].reward == 0.0 and scored[eid].infra_failure == "the harness stopped before the first model call"


async def test_restart_scores_an_ended_but_unscored_execution_by_how_it_ended(store, bus, infra, tmp_path):
    """The harness died while grading: the end event is in the log, the score is not. The recovered score
    must say what the live path would have: not timed out, and an infrastructure failure when it was one."""
    from services.trajectory.synthetic import SyntheticExecution

    run_id = unique("run-")
    server = gateway([])
    work = tmp_path / "executions"
    submitted, refused = "qe-s0", "qe-s1"
    for i, eid in enumerate((submitted, refused)):
        (work / eid / "work").mkdir(parents=True)
        (work / eid / "work" / "hello.txt").write_text("hello world\n")
        log = SyntheticExecution(eid, query_id="qe", run_id=run_id, task_id="create-file-1", group_size=2,
                                 sample_index=i, seed=i)
        log.start()
        log.call([1, 2, 3], [4, 5])
        if eid == refused:
            log.finish(stop_reason="APIConnectionError: connection refused", infra_failure=True)
        else:
            log.finish()
        await store.append(log.events)
    svc = service(infra, store, bus, tmp_path, server, run_id)
    try:
        await svc.start()
        events = await wait_for_types(store, run_id, {"execution.scored": 2})
    finally:
        await svc.stop()
        server.stop()
    assert not [e for e in events if e.type == "execution.timed_out"]
    scored = {e.data.execution_id: e.data for e in events if e.type == "execution.scored"}
    assert (scored[submitted].timed_out, scored[submitted].infra_failure) == (False, None)
    assert (scored[refused].timed_out, scored[refused].infra_failure) == (False, "APIConnectionError: connection refused")
    assert scored[submitted].reward == 1.0


async def test_a_model_api_that_keeps_failing_ends_the_execution_as_an_infrastructure_failure(store, bus, infra, tmp_path):
    server = gateway([failure(500)] * 10_000)  # failing for longer than the agent's outage allowance (1 s)
    query = QueryDispatched(query_id="qf", task_id="create-file-1", group_size=1, seeds=[5], step=0, policy_version=0)
    events = await dispatch_and_wait(store, bus, infra, tmp_path, server, query,
                                     {"execution.finished": 1, "execution.scored": 1})
    (scored,) = [e.data for e in events if e.type == "execution.scored"]
    assert scored.reward == 0.0 and scored.infra_failure is not None
    assert scored.infra_failure.startswith("InternalServerError")
    (finished,) = [e.data for e in events if e.type == "execution.finished"]
    assert finished.infra_failure and finished.stop_reason == scored.infra_failure  # what a recovery reads


@pytest.mark.parametrize("log", ["refusal-recorded", "unreadable", "nothing-recorded"])
async def test_an_external_harness_exiting_after_a_refused_call_is_flagged_when_the_log_says_so(
    store, bus, infra, tmp_path, log: str
):
    """After an external agent exits, the service folds the execution's stream: a `call.refused` for the
    infrastructure's reasons, written by the gateway before the agent saw its 500, makes the exit an
    infrastructure failure. A log that cannot be read leaves the exit the agent's own; one that holds no call
    at all means the model API never answered it (the infrastructure's failure too)."""
    from tests.harness.test_external_harness import sdk_harness

    loop = asyncio.get_running_loop()

    async def write_refusal(headers: dict[str, str], status: int, kind: str, message: str) -> None:
        """The gateway's side: the refusal on the execution's stream before the error is answered."""
        token = headers.get("authorization", "").removeprefix("Bearer ").strip()
        execution_id = execution_of_token(SECRET.encode(), token)
        assert execution_id is not None
        refused = CallRefused(execution_id=execution_id, status=status, kind=kind, reason=message, infra=status >= 500)
        event = new_event(refused, run_id=run_ids[0], stream_id=stream_id_for("execution", execution_id), version=1,
                          occurred_at=utcnow())
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(store.append([event], expected_version="any"),
                                                                   loop))

    run_ids: list[str] = []
    # The script does not retry: one refused call, then exit 1.
    server = gateway([failure(500)], on_refused=write_refusal if log != "nothing-recorded" else None)
    reads: list[str] = []

    class ExternalHarnessService(HarnessService):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            run_ids.append(self.settings.run_id)

        def harness_config(self, name=None):  # type: ignore[override]  # noqa: ANN001
            return sdk_harness()

        async def read_call_account(self, execution_id: str):  # type: ignore[no-untyped-def]
            reads.append(execution_id)
            if log == "unreadable" and len(reads) == 1:  # the read at the agent's exit fails
                raise ConnectionError("postgres went away")
            return await super().read_call_account(execution_id)

    query = QueryDispatched(query_id="qx", task_id="create-file-1", group_size=1, seeds=[5], step=0, policy_version=0)
    events = await dispatch_and_wait(store, bus, infra, tmp_path, server, query,
                                     {"execution.finished": 1, "execution.scored": 1}, ExternalHarnessService)
    (finished,) = [e.data for e in events if e.type == "execution.finished"]
    (scored,) = [e.data for e in events if e.type == "execution.scored"]
    assert reads[0] == finished.execution_id
    match log:
        case "refusal-recorded":
            assert finished.stop_reason == "exit 1 after the model API refused its last call: 500 api_error: scripted failure"
            assert scored.infra_failure == finished.stop_reason
            assert [e.type for e in events if e.type.startswith("call.")] == ["call.refused"]
        case "unreadable":  # no account: the exit stays the agent's own outcome
            assert finished.stop_reason == "exit 1" and scored.infra_failure is None
        case "nothing-recorded":
            assert finished.stop_reason == "exit 1 before the gateway recorded any model call of it"
            assert scored.infra_failure == finished.stop_reason and finished.infra_failure
    assert finished.calls == 0
    assert scored.reward == 0.0


async def test_a_dispatch_naming_a_harness_runs_that_one_and_start_sweeps_orphans(
    store, bus, infra: Infra, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness a dispatch names is the agent that runs (not the service's default, which is builtin here);
    and a starting harness first kills what a dead one left running under the sandbox uids."""
    import services.harness.service as service_module

    swept: list[bool] = []
    real_sweep = service_module.UID_POOL.sweep_orphans

    def sweep() -> list[int]:
        swept.append(True)
        return real_sweep()

    monkeypatch.setattr(service_module.UID_POOL, "sweep_orphans", sweep)
    monkeypatch.delenv("GYRE_HARNESS_GATEWAY_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("GYRE_ROLLOUT_TOKEN_SECRET", "s" * 32)  # the gateway's secret, read when the harness has none
    asked: list[str | None] = []

    class Recording(HarnessService):
        def harness_config(self, name=None):  # type: ignore[override]  # noqa: ANN001
            asked.append(name)
            return super().harness_config("builtin")  # the agent the scripted server answers

    server = gateway([shell("printf 'hello world\\n' > /app/hello.txt"), submit()])
    query = QueryDispatched(query_id="qh", task_id="create-file-1", group_size=1, seeds=[3], step=0, policy_version=0,
                            harness="claude-code")
    events = await dispatch_and_wait(store, bus, infra, tmp_path, server, query, {"execution.scored": 1}, Recording,
                                     secret=None)
    (started,) = [e.data for e in events if e.type == "execution.started"]
    assert started.harness == "claude-code" and asked == ["claude-code"]
    assert swept == [True]
    assert {h["authorization"] for h in server.headers} == {
        f"Bearer {derive_execution_token(b's' * 32, started.execution_id)}"}


async def test_a_harness_started_without_the_token_secret_stops_with_a_named_error(
    store, bus, infra: Infra, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the secret no execution's token could be derived, so no agent could call the model: the service
    refuses to start, saying which variable it expected."""
    for name in ("GYRE_HARNESS_GATEWAY_TOKEN_SECRET", "GYRE_ROLLOUT_TOKEN_SECRET"):
        monkeypatch.delenv(name, raising=False)
    server = gateway([])
    svc = service(infra, store, bus, tmp_path, server, unique("run-"), secret=None)
    try:
        with pytest.raises(TokenSecretMissingError, match="GYRE_HARNESS_GATEWAY_TOKEN_SECRET or GYRE_ROLLOUT_TOKEN_SECRET"):
            await svc.start()
    finally:
        await svc.stop()
        server.stop()


def test_the_harness_a_dispatch_names_is_the_one_that_runs(tmp_path: Path) -> None:
    """`execution.started.harness` says which agent ran; the service runs that one, not its own default."""
    from services.harness.execution import BuiltinHarness
    from services.harness.external_harness import ExternalHarness
    from services.harness.service import HarnessSettings
    from shared.settings import Settings

    service = HarnessService(Settings(run_id="r"), HarnessSettings(harness="builtin", claude_code_dir=tmp_path))
    assert isinstance(service.harness_config(), BuiltinHarness)
    chosen = service.harness_config("claude-code")
    assert isinstance(chosen, ExternalHarness) and "--tools" not in chosen.command
    bash_only = HarnessService(Settings(run_id="r"), HarnessSettings(claude_code_dir=tmp_path,
                                                                     claude_code_tools="Bash"))  # as the variable
    assert bash_only.harness_config("claude-code").command[-2:] == ("--tools", "Bash")
    with pytest.raises(ValueError, match="unknown harness 'codex'"):
        service.harness_config("codex")


async def test_recovery_scores_an_execution_it_cannot_grade_and_goes_on(store, bus, infra, tmp_path, monkeypatch):
    """Grading one execution after the crash fails (its sandbox cannot start, say): it is scored 0 as an
    infrastructure failure, and the service starts and recovers the others rather than crash-loop."""
    import services.harness.service as harness_service
    from services.harness.sandbox_spec import SandboxError

    graded = harness_service.grade_preserved

    def grade_or_fail(task, state_dir, **kwargs):
        if state_dir.name == "qg-s0":
            raise SandboxError("no free sandbox uid")
        return graded(task, state_dir, **kwargs)

    monkeypatch.setattr(harness_service, "grade_preserved", grade_or_fail)
    events = await recover_crashed(store, bus, infra, tmp_path, unique("run-"),
                                   {"qg-s0": (True, 1), "qg-s1": (True, 1)})
    scored = {e.data.execution_id: e.data for e in events if e.type == "execution.scored"}
    assert scored["qg-s0"].reward == 0.0 and "no free sandbox uid" in scored["qg-s0"].infra_failure
    assert scored["qg-s1"].reward == 1.0 and "the harness stopped mid-execution" in scored["qg-s1"].infra_failure


async def test_an_execution_resumed_too_often_is_given_up_as_an_infrastructure_failure(store, bus, infra, tmp_path):
    """A built-in execution is resumed after each harness stop, MAX_RESUMES times at most: a harness that keeps
    stopping under it ends it as an infrastructure failure (graded for the record, not trained)."""
    from services.harness.service import MAX_RESUMES
    from services.trajectory.synthetic import SyntheticExecution
    from shared.events import ExecutionResumed

    run_id, eid = unique("run-"), "qr-s0"
    (tmp_path / "executions" / eid / "work").mkdir(parents=True)
    (tmp_path / "executions" / eid / "work" / "hello.txt").write_text("hello world\n")
    log = SyntheticExecution(eid, query_id="qr", run_id=run_id, task_id="create-file-1", group_size=1,
                             sample_index=0, seed=0)
    log.start()
    log.call([1, 2, 3], [4])
    for attempt in range(1, MAX_RESUMES + 1):
        log._emit(ExecutionResumed(execution_id=eid, replayed_calls=1, attempt=attempt))
    await store.append(log.events)
    server = gateway([])
    svc = service(infra, store, bus, tmp_path, server, run_id)
    try:
        await svc.start()
        events = await wait_for_types(store, run_id, {"execution.timed_out": 1, "execution.scored": 1})
    finally:
        await svc.stop()
        server.stop()
    assert sum(e.type == "execution.resumed" for e in events) == MAX_RESUMES  # no further attempt
    (scored,) = [e.data for e in events if e.type == "execution.scored"]
    assert scored.reward == 1.0
    assert scored.infra_failure == f"the harness stopped mid-execution and was resumed {MAX_RESUMES} times already"
