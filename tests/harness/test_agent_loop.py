"""Built-in agent loop against a scripted Anthropic server, with a real sandbox for the shell tool."""

from __future__ import annotations

import time

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.harness.agent import AgentLoop
from services.harness.agent_core import SUB_AGENT_PROMPT, SUMMARY_PROMPT, AgentConfig, Branch, Budget
from services.harness.execution import BuiltinHarness, run_execution
from services.harness.external_harness import GatewayAccess
from services.harness.outcomes import AgentStopped
from services.harness.process_sandbox import ProcessSandbox
from services.harness.sandbox_spec import SandboxSpec
from services.harness.tasks import load_task

from .scripted_server import ScriptedAnthropicServer, failure, lost, shell, slow, submit, text, tool

TOKEN = "exec-secret-token"


class RecordingSink:
    def __init__(self) -> None:
        self.branches: list[Branch] = []
        self.stopped: list[AgentStopped] = []

    def branched(self, branch: Branch) -> None:
        self.branches.append(branch)

    def agent_stopped(self, stopped: AgentStopped) -> None:
        self.stopped.append(stopped)


@pytest.fixture
def box(tmp_path: Path, best_backend: str) -> Iterator[ProcessSandbox]:
    sandbox = ProcessSandbox(tmp_path / "box", SandboxSpec(workdir="/app"), backend=best_backend)  # type: ignore[arg-type]
    yield sandbox
    sandbox.close(remove=True)


def run_loop(
    script: list[Any], box: ProcessSandbox, *, budget: Budget | None = None, call_index_header: bool = False, **config: Any
) -> tuple[Any, ScriptedAnthropicServer, RecordingSink]:
    sink = RecordingSink()
    with ScriptedAnthropicServer(script, token=TOKEN, call_index_header=call_index_header) as server:
        loop = AgentLoop.for_gateway(server.base_url, TOKEN, AgentConfig(**{"model": "tiny", "sdk_max_retries": 0, **config}), box, sink=sink)
        outcome = loop.run("Write hi to out.txt", budget)
    return outcome, server, sink


def test_shell_then_submit_runs_in_the_sandbox_and_extends_one_context(box: ProcessSandbox) -> None:
    outcome, server, sink = run_loop([shell("echo hi > out.txt"), submit("wrote it")], box)
    assert outcome.status == "submitted" and outcome.answer == "wrote it"
    assert (box.work_host / "out.txt").read_text() == "hi\n"
    assert [(c.index, c.chain, c.purpose) for c in outcome.call_log] == [(0, "main", "turn"), (1, "main", "turn")]
    first, second = server.requests
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assert second["messages"][-1]["content"][0]["type"] == "tool_result"
    assert "[exit code 0]" in second["messages"][-1]["content"][0]["content"]
    assert {t["name"] for t in first["tools"]} == {"shell", "delegate", "submit"}
    assert all(h["authorization"] == f"Bearer {TOKEN}" for h in server.headers)
    assert outcome.branches == () and sink.branches == []


def test_calls_are_numbered_by_the_gateway_when_a_reply_was_lost(box: ProcessSandbox) -> None:
    """The gateway recorded call 0 but its reply never arrived; the re-sent request is call 1 in the log.
    The loop numbers its calls, its branch events and its call count by the log, not by what it saw."""
    script = [lost(), tool("bash", {"command": "ls"}), shell("echo ok > out.txt"), submit()]
    outcome, server, sink = run_loop(script, box, call_index_header=True, sdk_max_retries=1)
    assert outcome.status == "submitted" and len(server.requests) == 4 and server.counted == 4
    assert [(c.index, c.purpose) for c in outcome.call_log] == [(1, "turn"), (2, "retry"), (3, "turn")]
    assert outcome.calls == 4  # what the log holds, so the end event leaves none of them out
    assert sink.branches == [Branch(kind="retry", at_call_index=2, from_call_index=1, chain="main", reason=outcome.call_log[0].malformed)]


def test_without_the_header_calls_are_numbered_as_seen(box: ProcessSandbox) -> None:
    outcome, _, _ = run_loop([failure(500), shell("echo ok > out.txt"), submit()], box, sdk_max_retries=1)
    assert outcome.status == "submitted"
    assert [c.index for c in outcome.call_log] == [0, 1] and outcome.calls == 2


@pytest.mark.parametrize(("status", "infra"), [(500, True), (429, True), (401, True), (400, False), (413, False)])
def test_an_api_error_is_the_infrastructures_unless_the_request_itself_was_refused(
    box: ProcessSandbox, status: int, infra: bool
) -> None:
    outcome, _, _ = run_loop([shell("echo ok > out.txt"), failure(status)], box)
    assert outcome.status == "error" and outcome.calls == 1
    assert outcome.infra_failure is infra


def test_failed_command_reports_exit_code_and_stderr(box: ProcessSandbox) -> None:
    outcome, server, _ = run_loop([shell("cat missing.txt"), submit()], box)
    result = server.requests[1]["messages"][-1]["content"][0]
    assert result["is_error"] is True
    assert "[exit code 1]" in result["content"] and "No such file" in result["content"]


def test_retry_resamples_from_the_same_prefix_and_reports_a_retry_branch(box: ProcessSandbox) -> None:
    script = [tool("bash", {"command": "ls"}), shell("echo ok > out.txt"), submit()]
    outcome, server, sink = run_loop(script, box)
    assert outcome.status == "submitted"
    assert server.requests[1]["messages"] == server.requests[0]["messages"]
    assert [c.purpose for c in outcome.call_log] == ["turn", "retry", "turn"]
    assert outcome.call_log[0].malformed is not None and "unknown tool 'bash'" in outcome.call_log[0].malformed
    assert sink.branches == [Branch(kind="retry", at_call_index=1, from_call_index=0, chain="main", reason=outcome.call_log[0].malformed)]


@pytest.mark.parametrize(
    "bad_reply",
    [
        text('<tool_call>{"name": "shell", "argu'),
        text("half a thought", stop_reason="max_tokens"),
        text(""),
        tool("shell", {"cmd": "ls"}),
        tool("shell", {"command": 7}),
    ],
    ids=["unparsed-tool-call", "cut-off", "empty", "missing-field", "wrong-type"],
)
def test_malformed_replies_are_retried(box: ProcessSandbox, bad_reply: dict[str, Any]) -> None:
    outcome, server, sink = run_loop([bad_reply, submit()], box)
    assert outcome.status == "submitted"
    assert [b.kind for b in sink.branches] == ["retry"]
    assert server.requests[0]["messages"] == server.requests[1]["messages"]


def test_retries_exhausted_feed_the_error_back_and_continue(box: ProcessSandbox) -> None:
    bad = tool("nope", {})
    outcome, server, sink = run_loop([bad, bad, bad, submit()], box, max_retries=2)
    assert outcome.status == "submitted"
    assert [(b.kind, b.at_call_index, b.from_call_index) for b in sink.branches] == [("retry", 1, 0), ("retry", 2, 1)]
    assert [c.purpose for c in outcome.call_log] == ["turn", "retry", "retry", "turn"]
    last = server.requests[3]["messages"]
    assert last[-1]["content"][0]["is_error"] is True
    assert "could not be used" in last[-1]["content"][0]["content"]


def test_compaction_summarises_then_restarts_from_system_and_summary(box: ProcessSandbox) -> None:
    script = [
        shell("echo one > a.txt", input_tokens=500),
        text("SUMMARY: a.txt written, b.txt missing"),
        shell("echo two > b.txt"),
        submit(),
    ]
    outcome, server, sink = run_loop(script, box, compact_at_tokens=200)
    assert outcome.status == "submitted"
    summary_request = server.requests[1]
    assert summary_request["tool_choice"] == {"type": "none"}
    # The summary call continues the chain: task, the reply, then the tool result with the request folded in.
    assert summary_request["messages"][:1] == server.requests[0]["messages"]
    assert [m["role"] for m in summary_request["messages"]] == ["user", "assistant", "user"]
    assert summary_request["messages"][-1]["content"][0]["type"] == "tool_result"
    assert summary_request["messages"][-1]["content"][-1] == {"type": "text", "text": SUMMARY_PROMPT}
    restarted = server.requests[2]["messages"]
    assert len(restarted) == 1 and restarted[0]["role"] == "user"
    assert "Write hi to out.txt" in restarted[0]["content"] and "SUMMARY: a.txt written" in restarted[0]["content"]
    assert server.requests[2]["system"] == server.requests[0]["system"]
    assert [c.purpose for c in outcome.call_log] == ["turn", "summary", "turn", "turn"]
    assert [(b.kind, b.at_call_index, b.from_call_index, b.chain) for b in sink.branches] == [("compaction", 2, 1, "main")]
    assert (box.work_host / "a.txt").exists() and (box.work_host / "b.txt").exists()


def test_delegation_runs_a_sub_agent_with_fresh_context_and_returns_its_answer(box: ProcessSandbox) -> None:
    script = [
        tool("delegate", {"task": "Count the files in the working directory."}),
        shell("ls | wc -l"),
        submit("there are 0 files"),
        submit("main done"),
    ]
    outcome, server, sink = run_loop(script, box)
    assert outcome.status == "submitted" and outcome.answer == "main done"
    sub_first = server.requests[1]
    assert sub_first["messages"] == [{"role": "user", "content": "Count the files in the working directory."}]
    assert sub_first["system"] == SUB_AGENT_PROMPT
    assert {t["name"] for t in sub_first["tools"]} == {"shell", "submit"}
    back_in_main = server.requests[3]["messages"]
    assert back_in_main[: len(server.requests[0]["messages"])] == server.requests[0]["messages"]
    assert back_in_main[-1]["content"][0]["content"] == "there are 0 files"
    assert [(c.index, c.chain) for c in outcome.call_log] == [(0, "main"), (1, "main/delegate-1"), (2, "main/delegate-1"), (3, "main")]
    assert [(b.kind, b.at_call_index, b.from_call_index, b.chain) for b in sink.branches] == [("delegation", 1, 0, "main/delegate-1")]


def test_the_tool_results_of_one_turn_share_the_output_limit(box: ProcessSandbox) -> None:
    """Compaction is checked between turns, so one turn of many calls must not add more than
    `tool_output_chars` (each result keeps its status line): the summary request has to fit the model."""
    big = 'python3 -c "print(\'x\' * 10000)"'
    turn = {"content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "shell", "input": {"command": big}}
                        for i in range(3)], "stop_reason": "tool_use"}
    outcome, server, _ = run_loop([turn, submit()], box, tool_output_chars=3000)
    assert outcome.status == "submitted"
    results = server.requests[1]["messages"][-1]["content"]
    assert len(results) == 3 and all(r["content"].startswith("[exit code 0]") for r in results)
    assert sum(len(r["content"]) for r in results) <= 3000 + 2 * 200 + 3 * 60  # the limit, the floor, the markers


def test_call_budget_stops_the_agent(box: ProcessSandbox) -> None:
    outcome, server, _ = run_loop([shell(f"echo {i} >> log.txt") for i in range(10)], box, budget=Budget(max_calls=3))
    assert outcome.status == "calls_exhausted" and outcome.calls == 3
    assert len(server.requests) == 3
    assert (box.work_host / "log.txt").read_text().split() == ["0", "1", "2"]


def test_transient_server_errors_are_retried_within_the_budget(box: ProcessSandbox) -> None:
    outcome, server, sink = run_loop([failure(500), failure(429), submit()], box, sdk_max_retries=2)
    assert outcome.status == "submitted" and outcome.calls == 1
    assert len(server.requests) == 3
    assert sink.branches == []  # a transport retry is the same call, not a re-sample


def test_persistent_server_errors_end_the_run_with_error(box: ProcessSandbox) -> None:
    outcome, server, _ = run_loop([failure(500)] * 3, box, sdk_max_retries=1)
    assert outcome.status == "error" and len(server.requests) == 2


def test_an_outage_of_the_model_api_is_ridden_out_for_its_allowance(box: ProcessSandbox) -> None:
    """A gateway or worker restarting refuses calls for seconds: with an outage allowance the agent keeps
    retrying (backing off) past its retry count, and the execution goes on; without one it ends."""
    outage = [failure(503), failure(429), failure(500), failure(503)]
    outcome, server, sink = run_loop([*outage, submit()], box, sdk_max_retries=1, api_outage_s=60)
    assert outcome.status == "submitted" and len(server.requests) == 5 and sink.branches == []
    outcome, server, _ = run_loop([*outage, submit()], box, sdk_max_retries=1)
    assert outcome.status == "error" and len(server.requests) == 2
    started = time.monotonic()  # the scripted server says retry-after 0: the agent retries at once
    outcome, server, _ = run_loop([failure(503)] * 10_000, box, sdk_max_retries=0, api_outage_s=1.0)
    assert outcome.status == "error" and 1.0 <= time.monotonic() - started < 30  # given up after the allowance


def test_model_call_past_the_deadline_times_out_without_sdk_retries(box: ProcessSandbox) -> None:
    outcome, server, _ = run_loop([slow(submit(), 8), submit(), submit()], box, budget=Budget(wall_clock_s=2), sdk_max_retries=2)
    assert outcome.status == "timed_out" and outcome.calls == 0
    assert len(server.requests) == 1


def test_text_reply_without_tools_ends_the_run(box: ProcessSandbox) -> None:
    outcome, _, _ = run_loop([text("I am done.")], box)
    assert outcome.status == "ended" and outcome.answer == "I am done."


def test_gateway_error_ends_with_error_status(box: ProcessSandbox) -> None:
    outcome, _, _ = run_loop([], box)  # the scripted server answers 400: script exhausted
    assert outcome.status == "error" and "script exhausted" in (outcome.error or "")


def partial_task(root: Path) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "task.yaml").write_text("instruction: Create a.txt and b.txt in /app.\nmax_agent_timeout_sec: 600\n")
    (root / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\n"
        "def test_a():\n    assert Path('/app/a.txt').is_file()\n\n"
        "def test_b():\n    assert Path('/app/b.txt').is_file()\n"
    )
    return root


def test_timeout_grades_the_preserved_partial_work(tmp_path: Path, best_backend: str) -> None:
    task = load_task(partial_task(tmp_path / "task"))
    sink = RecordingSink()
    script = [shell("echo A > a.txt"), shell("sleep 120 && echo B > b.txt"), submit()]
    with ScriptedAnthropicServer(script, token=TOKEN) as server:
        result = run_execution(
            execution_id="execution-timeout",
            task=task,
            harness=BuiltinHarness(agent=AgentConfig(model="x", sdk_max_retries=0)),
            gateway=GatewayAccess(base_url=server.base_url, token=TOKEN, model="tiny"),
            state_dir=tmp_path / "state",
            budget=Budget(wall_clock_s=4),
            backend=best_backend,
            observer=sink,
        )
    assert result.stopped.status == "timed_out" and result.stopped.budget == "wall_clock"
    assert sink.stopped == [result.stopped]
    assert result.grade.score == 0.5 and result.grade.passed == 1
    assert (result.state_dir / "work" / "a.txt").read_text() == "A\n"
    assert server.requests[0]["model"] == "tiny"
