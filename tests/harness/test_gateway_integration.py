"""The built-in loop and external harnesses against the real rollout gateway (HTTP, Anthropic API) over a
scripted engine.

The engine is the rollout tests' char-level fake, so the test is deterministic; the gateway, its token
check, tool-call parsing and call recording are the real ones. The loop runs in a real sandbox. The harness
and the gateway meet only as they do in a run: the token is derived from the secret both hold, the gateway
takes an execution up from its `execution.started`, and the harness reads the gateway's account of an
external agent's calls back from the execution's stream (here the recorder's in-memory log).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from services.harness.agent import AgentLoop
from services.harness.agent_core import AgentConfig, Branch, Budget
from services.harness.call_account import CallAccount, call_account
from services.harness.execution import BuiltinHarness, run_execution
from services.harness.external_harness import GatewayAccess
from services.harness.process_sandbox import ProcessSandbox
from services.harness.sandbox_spec import SandboxSpec
from services.harness.tasks import load_task
from shared.chat import format_tool_call
from shared.events import ExecutionStarted, new_event, stream_id_for
from shared.execution_tokens import derive_execution_token
from tests.rollout import fakes

from .conftest import TASKS


class Served:
    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server.started and self.server.servers):
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def gateway_stack(script: Any) -> Any:
    codec = fakes.CharCodec()
    return codec, fakes.build_stack([fakes.ScriptedEngine(codec, script, max_model_len=65536)], codec)


def token_of(execution_id: str) -> str:
    """The execution's token as the harness service derives it, from the secret the gateway holds too."""
    return derive_execution_token(fakes.TOKEN_SECRET, execution_id)


def announce(stack: Any, execution_id: str, *, seed: int, call_budget: int | None = None) -> None:
    """What the harness service's `execution.started` does: the event on the execution's stream, taken up by the
    gateway (whose first call of the execution settles seed and call budget from that log)."""
    started = ExecutionStarted(execution_id=execution_id, query_id="q", task_id="create-file-1", group_size=1,
                               sample_index=0, seed=seed, call_budget=call_budget)
    stack.recorder.storage.add([new_event(started, run_id=stack.recorder.run_id, version=1,
                                          stream_id=stream_id_for("execution", execution_id),
                                          occurred_at=datetime.now(UTC))])
    stack.core.take_up(started)


class Sink:
    def __init__(self) -> None:
        self.branches: list[Branch] = []

    def branched(self, branch: Branch) -> None:
        self.branches.append(branch)


@pytest.fixture
def box(tmp_path: Path, best_backend: str) -> Iterator[ProcessSandbox]:
    sandbox = ProcessSandbox(tmp_path / "box", SandboxSpec(), backend=best_backend)  # type: ignore[arg-type]
    yield sandbox
    sandbox.close(remove=True)


def test_execution_through_the_gateway_is_graded_and_every_call_recorded(tmp_path: Path, best_backend: str) -> None:
    codec_holder: list[Any] = []

    def script(prompt: list[int]) -> str:
        text = codec_holder[0].decode(prompt)
        if "</tool_response>" in text[-400:] or "tool_response" in text[-400:]:
            return format_tool_call("submit", {"answer": "file written"})
        return format_tool_call("shell", {"command": "printf 'hello world\\n' > hello.txt"}, "Writing the file.")

    codec, stack = gateway_stack(script)
    codec_holder.append(codec)
    token = token_of("execution-gw-1")
    with Served(stack.app) as base_url:
        result = run_execution(
            execution_id="execution-gw-1",
            task=load_task(TASKS / "create-file-1"),
            harness=BuiltinHarness(agent=AgentConfig(model="tiny", sdk_max_retries=0)),
            gateway=GatewayAccess(base_url=base_url, token=token, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.agent is not None and result.agent.status == "submitted", result.agent
    assert result.grade.score == 1.0
    recorded = stack.recorder.calls("execution-gw-1")
    assert [c.call_index for c in recorded] == [c.index for c in result.agent.call_log] == [0, 1]
    # The second call continues the first: same chain, no branch.
    assert {c.chain_id for c in recorded} == {"main"}
    assert recorded[1].parent_call_index == 0


def test_retry_through_the_gateway_resends_the_same_prompt(box: ProcessSandbox) -> None:
    replies = iter(['<tool_call>\n{"name": "shell", "argum\n</tool_call>', format_tool_call("submit", {})])
    codec, stack = gateway_stack(lambda prompt: next(replies))
    token = token_of("execution-gw-2")
    sink = Sink()
    with Served(stack.app) as base_url:
        loop = AgentLoop.for_gateway(base_url, token, AgentConfig(model="tiny", sdk_max_retries=0), box, sink=sink)
        outcome = loop.run("Do nothing, then submit.", Budget(max_calls=5))
    assert outcome.status == "submitted"
    assert [(b.kind, b.at_call_index, b.from_call_index) for b in sink.branches] == [("retry", 1, 0)]
    engine = stack.engines[0]
    assert engine.prompts[0] == engine.prompts[1]
    assert len(stack.recorder.calls("execution-gw-2")) == 2


def test_compaction_summary_call_is_accepted_by_the_gateway(box: ProcessSandbox) -> None:
    replies = iter(
        [
            format_tool_call("shell", {"command": "echo step one > a.txt"}),
            "Summary: a.txt holds step one.",
            format_tool_call("submit", {"answer": "ok"}),
        ]
    )
    codec, stack = gateway_stack(lambda prompt: next(replies))
    token = token_of("execution-gw-3")
    sink = Sink()
    with Served(stack.app) as base_url:
        loop = AgentLoop.for_gateway(base_url, token, AgentConfig(model="tiny", sdk_max_retries=0, compact_at_tokens=100), box, sink=sink)
        outcome = loop.run("Write step one to a.txt.", Budget(max_calls=6))
    assert outcome.status == "submitted", outcome
    assert [c.purpose for c in outcome.call_log] == ["turn", "summary", "turn"]
    assert [(b.kind, b.at_call_index, b.from_call_index) for b in sink.branches] == [("compaction", 2, 1)]
    restarted = codec.decode(stack.engines[0].prompts[2])
    assert "Summary: a.txt holds step one." in restarted


def test_external_sdk_script_through_the_relay_is_recorded_and_graded(tmp_path: Path, best_backend: str) -> None:
    from .test_external_harness import sdk_harness

    codec, stack = gateway_stack(lambda prompt: "hello world")
    token = token_of("execution-gw-ext")
    with Served(stack.app) as base_url:
        result = run_execution(
            execution_id="execution-gw-ext",
            task=load_task(TASKS / "create-file-1"),
            harness=sdk_harness(),
            gateway=GatewayAccess(base_url=base_url, token=token, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.external is not None and result.external.exit_code == 0, result.external
    assert result.grade.score == 1.0
    recorded = stack.recorder.calls("execution-gw-ext")
    assert len(recorded) == 1 and recorded[0].api == "anthropic"


def test_external_harness_with_a_wrong_token_is_refused_by_the_gateway(tmp_path: Path, best_backend: str) -> None:
    from .test_external_harness import sdk_harness

    codec, stack = gateway_stack(lambda prompt: "hello world")
    with Served(stack.app) as base_url:
        result = run_execution(
            execution_id="execution-gw-bad",
            task=load_task(TASKS / "create-file-1"),
            harness=sdk_harness(),
            gateway=GatewayAccess(base_url=base_url, token="not-a-token", model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.external is not None and result.external.exit_code != 0
    assert "401" in result.external.stderr_tail or "authentication" in result.external.stderr_tail.lower()
    assert result.grade.score < 1.0
    assert stack.recorder.calls("execution-gw-bad") == []


def test_claude_code_through_the_relay_to_the_real_gateway(tmp_path: Path, best_backend: str) -> None:
    from services.harness.external_harness import claude_code

    from .test_external_harness import claude_code_dir

    install = claude_code_dir()
    if install is None:
        pytest.skip("Claude Code is not installed (set GYRE_CLAUDE_CODE_DIR to the folder holding node_modules/@anthropic-ai/claude-code)")
    codec_holder: list[Any] = []

    def script(prompt: list[int]) -> str:
        tail = codec_holder[0].decode(prompt[-3000:])
        if "tool_response" in tail:
            return "Done: hello.txt written."
        return format_tool_call("Bash", {"command": "printf 'hello world\\n' > hello.txt", "description": "write"})

    codec = fakes.CharCodec()
    codec_holder.append(codec)
    stack = fakes.build_stack([fakes.ScriptedEngine(codec, script, max_model_len=1_000_000)], codec)
    token = token_of("execution-gw-claude")
    with Served(stack.app) as base_url:
        result = run_execution(
            execution_id="execution-gw-claude",
            task=load_task(TASKS / "create-file-1"),
            harness=claude_code(install, "tiny"),
            gateway=GatewayAccess(base_url=base_url, token=token, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
        )
    assert result.external is not None and result.external.exit_code == 0, result.external
    assert result.grade.score == 1.0
    assert len(stack.recorder.calls("execution-gw-claude")) >= 2


class StreamAccountObserver:
    """Folds the execution's stream into its call account when the external agent exits, as the harness service
    does from the event store (here the gateway's recorder holds the log)."""

    def __init__(self, stack: Any, execution_id: str) -> None:
        self.stack, self.stream = stack, stream_id_for("execution", execution_id)
        self.asked = 0

    def branched(self, branch: Branch) -> None:
        return None

    def agent_stopped(self, stopped: Any) -> None:
        return None

    def call_account(self) -> CallAccount | None:
        self.asked += 1
        return call_account(e.data for e in self.stack.recorder.events if e.stream_id == self.stream)


@pytest.mark.parametrize("refused", [True, False], ids=["gateway-failed-it", "its-own-exit"])
def test_an_external_harness_that_exits_after_the_gateway_failed_it_is_an_infrastructure_failure(
    tmp_path: Path, best_backend: str, refused: bool
) -> None:
    from .test_external_harness import sdk_harness

    codec, stack = gateway_stack(lambda prompt: "hello world")
    token = token_of("execution-gw-500")
    if refused:
        stack.recorder.fail_next = ConnectionError("postgres went away")  # the call cannot be recorded: 500
        harness = sdk_harness()
    else:  # the script is answered, then exits 3 on its own
        harness = sdk_harness("--exit-after", "3")
    with Served(stack.app) as base_url:
        observer = StreamAccountObserver(stack, "execution-gw-500")
        result = run_execution(
            execution_id="execution-gw-500",
            task=load_task(TASKS / "create-file-1"),
            harness=harness,
            gateway=GatewayAccess(base_url=base_url, token=token, model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
            observer=observer,
        )
    assert result.external is not None and result.external.exit_code != 0, result.external
    assert observer.asked == 1
    if refused:
        # The gateway wrote the refusal on the stream before the agent saw its 500; the harness folds it.
        assert [(r.status, r.infra) for r in stack.recorder.refusals("execution-gw-500")] == [(500, True)]
        assert result.stopped.status == "error" and result.stopped.infra_failure
        assert result.stopped.stop_reason.startswith("exit 1 after the model API refused its last call: 500 api_error")
        assert stack.recorder.calls("execution-gw-500") == []
    else:
        assert result.stopped.status == "finished" and not result.stopped.infra_failure
        assert result.stopped.stop_reason == "exit 3"
        assert len(stack.recorder.calls("execution-gw-500")) == 1
        assert result.stopped.calls == 1  # the end event's count, from the same read


def test_the_gateway_holds_an_external_harness_to_its_call_budget(tmp_path: Path, best_backend: str) -> None:
    """An external agent cannot count its calls for the harness: the gateway takes the call budget from the
    execution's `execution.started`, refuses the call past it (recording the refusal), the agent exits on the
    error, and the execution ends timed out on its call budget."""
    from .test_external_harness import sdk_harness

    codec, stack = gateway_stack(lambda prompt: "hello world")
    announce(stack, "execution-gw-budget", seed=3, call_budget=2)
    with Served(stack.app) as base_url:
        observer = StreamAccountObserver(stack, "execution-gw-budget")
        result = run_execution(
            execution_id="execution-gw-budget",
            task=load_task(TASKS / "create-file-1"),
            harness=sdk_harness("--calls", "5"),
            gateway=GatewayAccess(base_url=base_url, token=token_of("execution-gw-budget"), model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
            observer=observer,
        )
    assert result.external is not None and result.external.exit_code != 0, result.external
    assert (result.stopped.status, result.stopped.budget) == ("timed_out", "calls")
    assert len(stack.recorder.calls("execution-gw-budget")) == 2
    assert [r.budget_spent for r in stack.recorder.refusals("execution-gw-budget")] == [True]


def test_an_external_harness_whose_token_the_gateway_does_not_know_fails_on_the_infrastructure(
    tmp_path: Path, best_backend: str
) -> None:
    """A token the gateway cannot verify (another secret: a misconfigured run) names no execution, so nothing is
    recorded on the stream; the agent exits on its 401 having made no recorded call, and that is the
    infrastructure's failure, not a policy outcome."""
    from .test_external_harness import sdk_harness

    codec, stack = gateway_stack(lambda prompt: "hello world")
    with Served(stack.app) as base_url:
        observer = StreamAccountObserver(stack, "execution-gw-secret")
        result = run_execution(
            execution_id="execution-gw-secret",
            task=load_task(TASKS / "create-file-1"),
            harness=sdk_harness(),
            gateway=GatewayAccess(base_url=base_url, token=derive_execution_token(b"another-secret", "execution-gw-secret"),
                                  model="tiny"),
            state_dir=tmp_path / "state",
            backend=best_backend,
            observer=observer,
        )
    assert result.external is not None and result.external.exit_code != 0, result.external
    assert [e for e in stack.recorder.events if e.stream_id == stream_id_for("execution", "execution-gw-secret")] == []
    assert result.stopped.status == "error" and result.stopped.infra_failure
    assert result.stopped.stop_reason == "exit 1 before the gateway recorded any model call of it"


def steps_stack(*commands: str) -> Any:
    """A gateway whose engine asks for each shell command in turn, one per tool result the prompt holds, then
    for a submit."""
    steps = [*(format_tool_call("shell", {"command": c}) for c in commands), format_tool_call("submit", {"answer": "done"})]
    codec = fakes.CharCodec()

    def script(prompt: list[int]) -> str:
        return steps[min(codec.decode(prompt).count("</tool_response>"), len(steps) - 1)]

    return fakes.build_stack([fakes.ScriptedEngine(codec, script, max_model_len=65536)], codec)


def _resumable_run(stack: Any, base_url: str, execution_id: str, state_dir: Path, backend: str, *,
                   max_calls: int, replay_calls: int = 0) -> Any:
    return run_execution(
        execution_id=execution_id, task=load_task(TASKS / "create-file-1"),
        harness=BuiltinHarness(agent=AgentConfig(model="tiny", sdk_max_retries=0)),
        gateway=GatewayAccess(base_url=base_url, token=token_of(execution_id), model="tiny"),
        state_dir=state_dir, backend=backend, budget=Budget(max_calls=max_calls), replay_calls=replay_calls,
    )


def test_a_resumed_agent_replays_its_answered_calls_from_the_log_then_goes_on_live(tmp_path: Path,
                                                                                    best_backend: str) -> None:
    """The harness stopped after two answered calls (here: a call budget of two ends the first loop there). A
    loop resumed in a fresh sandbox makes those two calls again, answered from the log without generating,
    redoes their commands, and goes on live: the log holds each call once and the work is done once."""
    stack = steps_stack("printf 'hello ' > hello.txt", "printf 'world\\n' >> hello.txt")
    with Served(stack.app) as base_url:
        first = _resumable_run(stack, base_url, "execution-resume-1", tmp_path / "first", best_backend, max_calls=2)
        assert first.agent is not None and first.agent.status != "submitted"
        assert len(stack.engines[0].prompts) == 2
        resumed = _resumable_run(stack, base_url, "execution-resume-1", tmp_path / "resumed", best_backend,
                                 max_calls=5, replay_calls=2)
    assert resumed.agent is not None and resumed.agent.status == "submitted", resumed.agent
    assert len(stack.engines[0].prompts) == 3, "only the call after the replayed ones was generated"
    recorded = stack.recorder.calls("execution-resume-1")
    assert [c.call_index for c in recorded] == [c.index for c in resumed.agent.call_log] == [0, 1, 2]
    assert [c.parent_call_index for c in recorded] == [None, 0, 1] and {c.chain_id for c in recorded} == {"main"}
    assert (tmp_path / "resumed" / "work" / "hello.txt").read_text() == "hello world\n"
    assert resumed.grade.score == 1.0
    assert stack.core.metrics.replayed.labels(api="anthropic")._value.get() == 2


def test_a_replay_whose_prompt_differs_is_served_live_as_a_fork(tmp_path: Path, best_backend: str) -> None:
    """A command that answers otherwise the second time (the time of day) changes the next prompt: that call is
    not the recorded one, so the gateway generates it, recorded after the earlier calls as a branch."""
    stack = steps_stack("date +%s%N", "printf 'hello world\\n' > hello.txt")
    with Served(stack.app) as base_url:
        _resumable_run(stack, base_url, "execution-resume-2", tmp_path / "first", best_backend, max_calls=2)
        resumed = _resumable_run(stack, base_url, "execution-resume-2", tmp_path / "resumed", best_backend,
                                 max_calls=6, replay_calls=2)
    assert resumed.agent is not None and resumed.agent.status == "submitted", resumed.agent
    recorded = stack.recorder.calls("execution-resume-2")
    assert [c.call_index for c in recorded] == [0, 1, 2, 3]
    # A branch off call 1 (its prompt shares call 1's up to the differing output), not a continuation of it.
    assert recorded[2].branch_hint not in (None, "continuation") and recorded[2].parent_call_index == 1
    assert [c.index for c in resumed.agent.call_log] == [0, 2, 3]
    assert len(stack.engines[0].prompts) == 4  # calls 0 and 1, then the diverged call and the submit
    assert resumed.grade.score == 1.0
