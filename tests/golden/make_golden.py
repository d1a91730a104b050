"""Writes the golden execution logs (JSONL, `gyre replay --export` format) beside this file.

    .venv/bin/python tests/golden/make_golden.py

Hand-made executions over a byte-level toy tokenizer (text → UTF-8 bytes, role markers ≥ 256), so a printed
tree reads like the conversation. Ids and timestamps are derived from names: regenerating is byte-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from services.trajectory.replay import export_lines  # noqa: E402
from services.trajectory.state import BatchParams, RunLog, assemble_step_batch  # noqa: E402
from services.trajectory.synthetic import EPOCH, SyntheticExecution, stable_uuid  # noqa: E402
from shared.batch import BATCH_MEDIA_TYPE  # noqa: E402
from shared.blobs import blob_ref  # noqa: E402
from shared.events import BatchReady, Event, QueryDispatched, new_event  # noqa: E402

SYSTEM, USER, ASSISTANT, TOOL, END = 256, 257, 258, 259, 260


def t(text: str) -> list[int]:
    return list(text.encode())


def msg(role: int, text: str) -> list[int]:
    return [role, *t(text), END]


def prompt_of(*parts: list[int]) -> list[int]:
    """A chat prompt ending with the assistant header, as a chat template renders it."""
    out: list[int] = []
    for p in parts:
        out += p
    return out + [ASSISTANT]


def answer(text: str) -> list[int]:
    return [*t(text), END]


SYS = msg(SYSTEM, "You are a careful engineer working in /app. Use the shell tool.")


def compaction() -> SyntheticExecution:
    log = SyntheticExecution("golden-compaction", query_id="q-compaction", task_id="fix-tests")
    log.start()
    task = msg(USER, "Make the failing tests in /app/tests pass.")
    ctx = SYS + task
    for i, (cmd, out) in enumerate([("pytest -x", "1 failed: test_parse"), ("cat parse.py", "def parse(s): ..."),
                                    ("sed -i s/split/rsplit/ parse.py", ""), ("pytest -x", "3 passed")]):
        seq = log.call(prompt_of(ctx), answer(f"<shell>{cmd}</shell>")).call_index
        ctx = log.sequence(seq).tolist() + msg(TOOL, out)
    # The context passed the harness budget: compaction restarts from a summary.
    summary = msg(USER, "Summary so far: parse() split on the wrong separator; fixed with rsplit; tests pass.")
    log.branched("compaction", at_call_index=len(log.records), from_call_index=len(log.records) - 1,
                  reason="context 1200 tokens > budget 1000")
    c = log.call(prompt_of(SYS + task + summary), answer("<shell>git diff</shell>"))
    ctx = log.sequence(c.call_index).tolist() + msg(TOOL, "-  s.split(',')\n+  s.rsplit(',')")
    log.call(prompt_of(ctx), answer("<submit/>"))
    log.finish(elapsed_s=312.5)
    log.score(1.0, tests_passed=3, tests_total=3)
    return log


def delegation() -> SyntheticExecution:
    log = SyntheticExecution("golden-delegation", query_id="q-delegation", task_id="port-module")
    log.start()
    task = msg(USER, "Port utils.py to the new API.")
    c0 = log.call(prompt_of(SYS + task), answer("<delegate>List every caller of utils.load</delegate>"))
    sub_sys = msg(SYSTEM, "You are a sub-agent. Answer the question and stop.")
    sub_task = msg(USER, "List every caller of utils.load")
    log.branched("delegation", at_call_index=1, from_call_index=0, chain_id="agent-1")
    s0 = log.call(prompt_of(sub_sys + sub_task), answer("<shell>grep -rn utils.load</shell>"), chain_id="agent-1")
    s1 = log.call(prompt_of(log.sequence(s0.call_index).tolist() + msg(TOOL, "app.py:3\ncli.py:9")),
                  answer("app.py and cli.py"), chain_id="agent-1")
    ctx = log.sequence(c0.call_index).tolist() + msg(TOOL, "app.py and cli.py")
    c1 = log.call(prompt_of(ctx), answer("<shell>sed -i s/load/load_v2/ app.py cli.py</shell>"))
    log.call(prompt_of(log.sequence(c1.call_index).tolist() + msg(TOOL, "")), answer("<submit/>"))
    del s1
    log.finish(elapsed_s=120.0)
    log.score(0.5, tests_passed=1, tests_total=2)
    return log


def retries() -> SyntheticExecution:
    log = SyntheticExecution("golden-retries", query_id="q-retries", task_id="write-config")
    log.start()
    p = prompt_of(SYS + msg(USER, "Write config.yaml with port 8080."))
    log.call(p, answer("<shel"))  # malformed: the harness retries from the same prompt
    log.branched("retry", at_call_index=1, from_call_index=0, reason="malformed tool call")
    log.call(p, answer("<shell>echo 'port: 80"))  # malformed again, shares a prefix with the first sample
    log.branched("retry", at_call_index=2, from_call_index=0, reason="malformed tool call")
    good = log.call(p, answer("<shell>echo 'port: 8080' > config.yaml</shell>"))
    log.call(prompt_of(log.sequence(good.call_index).tolist() + msg(TOOL, "")), answer("<submit/>"))
    log.finish(elapsed_s=30.0)
    log.score(1.0, tests_passed=1, tests_total=1)
    return log


def drift() -> SyntheticExecution:
    """An external harness re-renders the assistant's message (normalised whitespace): no label, a fork."""
    log = SyntheticExecution("golden-drift", query_id="q-drift", task_id="count-lines")
    log.start()
    task = msg(USER, "How many lines in data.csv?")
    c0 = log.call(prompt_of(SYS + task), answer("<shell>wc  -l data.csv</shell>"))
    rerendered = SYS + task + answer("<shell>wc -l data.csv</shell>")  # double space collapsed
    c1 = log.call(prompt_of(rerendered + msg(TOOL, "42 data.csv")), answer("42"))
    log.call(prompt_of(log.sequence(c1.call_index).tolist() + msg(USER, "Submit it.")), answer("<submit>42</submit>"))
    del c0
    log.finish(elapsed_s=12.0)
    log.score(1.0, tests_passed=1, tests_total=1)
    return log


def timeout() -> SyntheticExecution:
    log = SyntheticExecution("golden-timeout", query_id="q-timeout", task_id="build-kernel")
    log.start()
    ctx = SYS + msg(USER, "Build the project and make all 4 tests pass.")
    for cmd, out in [("make", "error: missing zlib"), ("apt-get install zlib1g-dev", "ok"), ("make", "built"),
                     ("pytest", "2 passed, 2 failed")]:
        c = log.call(prompt_of(ctx), answer(f"<shell>{cmd}</shell>"))
        ctx = log.sequence(c.call_index).tolist() + msg(TOOL, out)
    log.call(prompt_of(ctx), answer("<shell>vim src/"))  # cut off by the wall clock mid-generation
    log.time_out(elapsed_s=3600.0)
    log.score(0.5, tests_passed=2, tests_total=4, timed_out=True)  # the preserved work is graded
    return log


def claude_code() -> SyntheticExecution:
    """A Claude-Code-style session through the gateway: no branch labels, only what the gateway infers.

    Two Task sub-agents run interleaved with the main chain, a small side call titles the session, and the
    main chain compacts ("continued from a previous conversation") and carries on.
    """
    log = SyntheticExecution("golden-claude-code", query_id="q-claude-code", task_id="refactor-http")
    log.start()
    cc_sys = msg(SYSTEM, "You are Claude Code, an interactive CLI tool. Tools: Bash, Read, Edit, Task.")
    task = msg(USER, "Refactor the HTTP client into its own module and keep the tests green.")
    log.call(prompt_of(msg(SYSTEM, "Write a 3-word title.") + task), answer("HTTP client refactor"),
             chain_id="title")
    m = log.call(prompt_of(cc_sys + task), answer("<Task>find HTTP call sites</Task><Task>read the tests</Task>"))
    main = log.sequence(m.call_index).tolist()
    agent_sys = msg(SYSTEM, "You are a Claude Code sub-agent.")
    a1 = log.call(prompt_of(agent_sys + msg(USER, "find HTTP call sites")), answer("<Bash>rg requests.get</Bash>"),
                  chain_id="task-1")
    a2 = log.call(prompt_of(agent_sys + msg(USER, "read the tests")), answer("<Read>tests/test_http.py</Read>"),
                  chain_id="task-2")
    a1 = log.call(prompt_of(log.sequence(a1.call_index).tolist() + msg(TOOL, "api.py:10 sync.py:44")),
                  answer("Call sites: api.py:10, sync.py:44"), chain_id="task-1")
    a2 = log.call(prompt_of(log.sequence(a2.call_index).tolist() + msg(TOOL, "def test_get(): ...")),
                  answer("Tests mock requests.get"), chain_id="task-2")
    main += msg(TOOL, "Call sites: api.py:10, sync.py:44") + msg(TOOL, "Tests mock requests.get")
    for cmd, out in [("<Edit>http_client.py</Edit>", "created"), ("<Edit>api.py</Edit>", "ok"),
                     ("<Bash>pytest</Bash>", "1 failed")]:
        c = log.call(prompt_of(main), answer(cmd))
        main = log.sequence(c.call_index).tolist() + msg(TOOL, out)
    restart = msg(USER, "This session is being continued from a previous conversation that ran out of context. "
                        "Summary: http_client.py created, api.py migrated, sync.py still uses requests.")
    c = log.call(prompt_of(cc_sys + restart), answer("<Edit>sync.py</Edit>"))
    main = log.sequence(c.call_index).tolist() + msg(TOOL, "ok")
    c = log.call(prompt_of(main), answer("<Bash>pytest</Bash>"))
    main = log.sequence(c.call_index).tolist() + msg(TOOL, "5 passed")
    log.call(prompt_of(main), answer("Done: the HTTP client lives in http_client.py."))
    log.finish(elapsed_s=845.0)
    log.score(1.0, tests_passed=5, tests_total=5)
    return log


def group() -> tuple[list[Event], dict[str, bytes]]:
    """One query's group of 4 executions (one timed out) for step 0, plus the batch the live service emitted."""
    events: list[Event] = []
    blobs: dict[str, bytes] = {}
    dispatched = new_event(
        QueryDispatched(query_id="q-group", task_id="sum-csv", group_size=4, seeds=[0, 1, 2, 3], step=0,
                        policy_version=0),
        run_id="golden-run", stream_id="query-q-group", version=1, occurred_at=EPOCH,
        event_id=stable_uuid("golden-run", "q-group"),
    )
    events.append(dispatched)
    rewards = [1.0, 0.0, 0.5, 0.25]
    for i, reward in enumerate(rewards):
        log = SyntheticExecution(f"golden-group-{i}", query_id="q-group", run_id="golden-run", task_id="sum-csv",
                                 group_size=4, sample_index=i, seed=i)
        log.start()
        p = prompt_of(SYS + msg(USER, "Sum column 2 of data.csv."))
        first = log.call(p, answer(f"<shell>awk '{{s+=${2 if i % 2 == 0 else 1}}}END{{print s}}' data.csv</shell>"))
        if i == 1:
            log.branched("retry", at_call_index=1, from_call_index=0)
            first = log.call(p, answer("<shell>python -c 'sum'</shell>"))
        ctx = log.sequence(first.call_index).tolist() + msg(TOOL, str(10 * i))
        log.call(prompt_of(ctx), answer(f"<submit>{10 * i}</submit>"))
        if i == 3:
            log.time_out(elapsed_s=600.0)
            log.score(reward, tests_passed=1, tests_total=4, timed_out=True)
        else:
            log.finish(elapsed_s=60.0 + i)
            log.score(reward, tests_passed=int(4 * reward), tests_total=4)
        events += log.events
        blobs.update(log.blobs)
    run = RunLog()
    run.apply_all(events)
    params = BatchParams(budget=256, cap_k=2, eps=1e-6, drop_zero_variance=True, max_staleness=1)
    batch = assemble_step_batch(run, 0, lambda ref: blobs[ref.digest], params)
    data = batch.encode()
    ref = blob_ref(data, BATCH_MEDIA_TYPE)
    blobs[ref.digest] = data
    stats = batch.meta
    events.append(new_event(
        BatchReady(step=0, batch=ref, query_ids=["q-group"], executions=len(batch.executions),
                   trees=len(batch.executions), micro_batches=len(batch.micro_batches),
                   unique_tokens=int(stats["unique_tokens"]), flat_tokens=int(stats["flat_tokens"]),
                   target_tokens=int(stats["target_tokens"]), min_policy_version=int(stats["min_policy_version"]),
                   max_policy_version=int(stats["max_policy_version"])),
        run_id="golden-run", stream_id="batch-0", version=1, occurred_at=EPOCH,
        event_id=stable_uuid("golden-run", "batch", 0),
    ))
    return events, blobs


SCENARIOS = {
    "compaction": compaction,
    "delegation": delegation,
    "retries": retries,
    "drift": drift,
    "timeout": timeout,
    "claude_code": claude_code,
}


def main() -> None:
    for name, make in SCENARIOS.items():
        log = make()
        lines = export_lines(log.events, lambda ref, blobs=log.blobs: blobs[ref.digest])
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    events, blobs = group()
    (HERE / "group.jsonl").write_text("\n".join(export_lines(events, lambda ref: blobs[ref.digest])) + "\n")
    print(json.dumps({"written": sorted([*SCENARIOS, "group"])}))


if __name__ == "__main__":
    main()
