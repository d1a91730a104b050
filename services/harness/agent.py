"""The built-in agent loop: a client of the gateway's Anthropic Messages API with shell, delegate and submit.

It compacts its context past a budget (a summary call, then a restart from system + summary), hands
sub-tasks to sub-agents with fresh contexts, re-samples malformed replies, and stops at its wall-clock
or call budget. Every deliberate branch goes to a BranchSink; the loop itself knows nothing of the bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import anthropic

from services.harness.agent_core import (
    DELEGATE,
    SHELL,
    SUBMIT,
    SUMMARY_PROMPT,
    TOOL_SCHEMAS,
    AgentCall,
    AgentConfig,
    AgentOutcome,
    AgentStatus,
    Branch,
    Budget,
    MalformedReply,
    ToolUse,
    ValidReply,
    context_tokens,
    cut_middle,
    format_shell_result,
    main_tools,
    restart_messages,
    should_compact,
    validate_reply,
)
from services.harness.sandbox_spec import ExecResult
from shared.calls import CALL_INDEX_HEADER, REPLAY_HEADER, call_seed


def _call_index(value: str | None) -> int | None:
    """The gateway's call-index header as a number; absent or malformed reads as absent."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


# Statuses with which an API refuses the request itself (malformed, a prompt past the context, too large):
# the agent's own doing, so the execution is a policy outcome. Every other API error (unreachable, 401 for a
# revoked token, 429 or 5xx after the retries) is the infrastructure's.
_OWN_REQUEST_STATUSES = frozenset({400, 413, 422})
MIN_TOOL_OUTPUT_CHARS = 200  # what each tool result of a turn keeps however many calls share the turn


def _own_request_refused(exc: anthropic.APIError) -> bool:
    return isinstance(exc, anthropic.APIStatusError) and exc.status_code in _OWN_REQUEST_STATUSES


class CommandRunner(Protocol):
    """Where the shell tool runs: a sandbox (Sandbox.exec fits)."""

    def exec(self, command: str, *, timeout_s: float) -> ExecResult: ...


class BranchSink(Protocol):
    def branched(self, branch: Branch) -> None: ...


class NullBranchSink:
    def branched(self, branch: Branch) -> None:
        return None


class _Stop(Exception):
    def __init__(self, status: AgentStatus, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class _Chain:
    """One agent context: the main agent or a sub-agent."""

    def __init__(self, label: str, system: str, tools: tuple[str, ...], task: str, depth: int) -> None:
        self.label = label
        self.system = system
        self.tools = tools
        self.task = task
        self.depth = depth
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        self.last_usage: dict[str, int] | None = None
        self.pending_chars = len(task)


class AgentLoop:
    """Runs one execution's agent against the gateway; `run` returns when it submits, ends or runs out."""

    def __init__(
        self,
        client: anthropic.Anthropic,
        config: AgentConfig,
        runner: CommandRunner,
        *,
        sink: BranchSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        replay_calls: int = 0,
    ) -> None:
        self.client = client
        # Resumed after its harness stopped: its first `replay_calls` calls were answered before, and the gateway
        # answers them again from the log (REPLAY_HEADER) while the loop redoes its commands in a fresh workspace.
        self.replay_calls = replay_calls
        self.config = config
        self.runner = runner
        self.sink = sink or NullBranchSink()
        self.clock = clock
        self.sleep = sleep
        self.calls = 0
        self.call_log: list[AgentCall] = []
        self.branches: list[Branch] = []
        self._deadline: float | None = None
        self._max_calls: int | None = None
        self._sub_agents = 0
        self._pending_branch: Branch | None = None

    @classmethod
    def for_gateway(
        cls, base_url: str, token: str, config: AgentConfig, runner: CommandRunner, *, sink: BranchSink | None = None,
        replay_calls: int = 0,
    ) -> AgentLoop:
        """A loop whose client sends the execution's token as a bearer token, like Claude Code does."""
        client = anthropic.Anthropic(base_url=base_url, auth_token=token, api_key=None, max_retries=config.sdk_max_retries)
        return cls(client, config, runner, sink=sink, replay_calls=replay_calls)

    # --- public -----------------------------------------------------------------------------------------

    def run(self, instruction: str, budget: Budget | None = None) -> AgentOutcome:
        budget = budget or Budget()
        started = self.clock()
        self._deadline = None if budget.wall_clock_s is None else started + budget.wall_clock_s
        self._max_calls = budget.max_calls
        main = _Chain("main", self.config.system_prompt, main_tools(self.config), instruction, depth=0)
        status: AgentStatus
        answer: str | None = None
        error: str | None = None
        infra_failure = False
        try:
            status, answer = self._run_chain(main)
        except _Stop as stop:
            status, error = stop.status, str(stop)
        except anthropic.APIError as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            infra_failure = not _own_request_refused(exc)
        return AgentOutcome(
            status=status,
            answer=answer,
            calls=self.calls,
            elapsed_s=max(0.0, self.clock() - started),
            branches=tuple(self.branches),
            call_log=tuple(self.call_log),
            error=error,
            infra_failure=infra_failure,
        )

    # --- budgets ------------------------------------------------------------------------------------------

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - self.clock()

    def _check_budget(self, *, calls: bool = True) -> None:
        remaining = self._remaining()
        if remaining is not None and remaining <= 0:
            raise _Stop("timed_out", "wall-clock budget spent")
        if calls and self._max_calls is not None and self.calls >= self._max_calls:
            raise _Stop("calls_exhausted", f"call budget of {self._max_calls} spent")

    # --- model calls ----------------------------------------------------------------------------------------

    def _branch(self, branch: Branch) -> None:
        self.branches.append(branch)
        self.sink.branched(branch)

    def _call(self, chain: _Chain, purpose: Literal["turn", "retry", "summary"], messages: list[dict[str, Any]]) -> tuple[int, Any]:
        self._check_budget()
        kwargs: dict[str, Any] = {
            "model": self.config.model,
            "max_tokens": self.config.max_tokens,
            "system": chain.system,
            "messages": messages,
            "tools": [TOOL_SCHEMAS[name] for name in chain.tools],
        }
        if self.config.temperature is not None:
            kwargs["temperature"] = self.config.temperature
        if purpose == "summary":
            kwargs["tool_choice"] = {"type": "none"}
        if self.config.seed is not None:
            # Distinct per call, so re-samples (retries) differ while the whole run stays reproducible.
            kwargs["extra_body"] = {"seed": call_seed(self.config.seed, self.calls)}
        if self.calls < self.replay_calls:
            kwargs["extra_headers"] = {REPLAY_HEADER: str(self.calls)}
        response, recorded_as = self._create_within_budget(kwargs)
        # The gateway names the index it recorded the call under: after a reply lost on the way back and a
        # re-sent request, the log holds one call more than this loop saw, and numbering by the log keeps the
        # branch events and the end event's call count aligned with it. Other endpoints send no such header.
        index = recorded_as if recorded_as is not None and recorded_as >= self.calls else self.calls
        self.calls = index + 1
        usage = response.usage.model_dump() if response.usage is not None else None
        content = [block.model_dump() for block in response.content]
        chain.last_usage = usage
        chain.pending_chars = 0
        if self._pending_branch is not None:
            # A branch is announced with the index of its first call, known only once that call returned.
            self._branch(self._pending_branch.model_copy(update={"at_call_index": index}))
            self._pending_branch = None
        self.call_log.append(
            AgentCall(
                index=index,
                chain=chain.label,
                purpose=purpose,
                request_messages=len(messages),
                stop_reason=response.stop_reason,
                context_tokens=context_tokens(usage, 0),
                output_tokens=int((usage or {}).get("output_tokens") or 0),
                tool_calls=tuple(str(b.get("name")) for b in content if b.get("type") == "tool_use"),
            )
        )
        return index, response

    def _create_within_budget(self, kwargs: dict[str, Any]) -> tuple[Any, int | None]:
        """The reply and the call index the gateway recorded it under (None when not sent).

        Transient errors are retried here rather than in the SDK, so no retry outlives the deadline."""
        client = self.client.with_options(max_retries=0)
        attempt = 0
        first_failure: float | None = None
        while True:
            remaining = self._remaining()
            if remaining is not None:
                if remaining <= 0:
                    raise _Stop("timed_out", "wall-clock budget spent during a model call")
                kwargs["timeout"] = remaining
            try:
                raw = client.messages.with_raw_response.create(**kwargs)
                return raw.parse(), _call_index(raw.headers.get(CALL_INDEX_HEADER))
            except (anthropic.APIConnectionError, anthropic.RateLimitError, anthropic.InternalServerError) as exc:
                left = self._remaining()
                if left is not None and left <= 0:
                    raise _Stop("timed_out", "wall-clock budget spent during a model call") from exc
                first_failure = time.monotonic() if first_failure is None else first_failure
                if (attempt >= self.config.sdk_max_retries
                        and time.monotonic() - first_failure >= self.config.api_outage_s):
                    raise
                attempt += 1
                delay = min(8.0, 0.5 * 2 ** min(attempt, 4))  # capped before 2**attempt outgrows a float
                response = getattr(exc, "response", None)
                retry_after = response.headers.get("retry-after") if response is not None else None
                if retry_after is not None:
                    try:
                        delay = min(60.0, float(retry_after))
                    except ValueError:
                        pass
                self.sleep(delay if left is None else min(delay, left))

    def _sample(self, chain: _Chain) -> tuple[int, list[dict[str, Any]], ValidReply | MalformedReply]:
        """One turn: call, and re-sample from the same messages while the reply is malformed."""
        index, response = self._call(chain, "turn", chain.messages)
        content = [block.model_dump(exclude_none=True) for block in response.content]
        verdict = validate_reply(content, response.stop_reason, chain.tools)
        attempts = 0
        while isinstance(verdict, MalformedReply) and attempts < self.config.max_retries:
            attempts += 1
            self._mark_malformed(index, verdict.reason)
            self._pending_branch = Branch(kind="retry", at_call_index=0, from_call_index=index, chain=chain.label, reason=verdict.reason)
            index, response = self._call(chain, "retry", chain.messages)
            content = [block.model_dump(exclude_none=True) for block in response.content]
            verdict = validate_reply(content, response.stop_reason, chain.tools)
        if isinstance(verdict, MalformedReply):
            self._mark_malformed(index, verdict.reason)
        return index, content, verdict

    def _mark_malformed(self, index: int, reason: str) -> None:
        for position, record in enumerate(self.call_log):
            if record.index == index:
                self.call_log[position] = record.model_copy(update={"malformed": reason})

    # --- the loop ---------------------------------------------------------------------------------------------

    def _run_chain(self, chain: _Chain) -> tuple[AgentStatus, str | None]:
        while True:
            self._maybe_compact(chain)
            index, content, verdict = self._sample(chain)
            if isinstance(verdict, MalformedReply):
                # Retries spent: show the model its mistake and go on, so one bad habit cannot end the run.
                self._append_feedback(chain, content, verdict.reason)
                continue
            chain.messages.append({"role": "assistant", "content": content})
            if not verdict.tool_calls:
                return "ended", verdict.text
            results: list[dict[str, Any]] = []
            # One turn's tool results share `tool_output_chars` (each keeps at least MIN_TOOL_OUTPUT_CHARS), so
            # a turn of many calls cannot push the context, and the summary request that compacts it, past
            # the model's length: compaction is checked between turns, not inside one.
            room = self.config.tool_output_chars
            for call in verdict.tool_calls:
                if call.name == SUBMIT:
                    return "submitted", str(call.input.get("answer", verdict.text))
                output, is_error = self._run_tool(chain, call, index, max(MIN_TOOL_OUTPUT_CHARS, room))
                room -= len(output)
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": output, "is_error": is_error})
                chain.pending_chars += len(output)
            chain.messages.append({"role": "user", "content": results})

    def _append_feedback(self, chain: _Chain, content: list[dict[str, Any]], reason: str) -> None:
        note = f"Your previous reply could not be used: {reason}. Use the tools as described."
        tool_ids = [str(b.get("id")) for b in content if b.get("type") == "tool_use"]
        if tool_ids:
            chain.messages.append({"role": "assistant", "content": content})
            chain.messages.append(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": note, "is_error": True} for i in tool_ids]}
            )
        else:
            text = "".join(str(b.get("text", "")) for b in content if b.get("type") == "text").strip()
            if text:
                chain.messages.append({"role": "assistant", "content": text})
                chain.messages.append({"role": "user", "content": note})
            elif chain.messages[-1]["role"] == "user":
                # Nothing to show: say it in the pending user turn rather than breaking role alternation.
                last = chain.messages[-1]
                if isinstance(last["content"], str):
                    chain.messages[-1] = {"role": "user", "content": f"{last['content']}\n\n{note}"}
                else:
                    chain.messages[-1] = {"role": "user", "content": [*last["content"], {"type": "text", "text": note}]}
        chain.pending_chars += len(note)

    def _maybe_compact(self, chain: _Chain) -> None:
        tokens = context_tokens(chain.last_usage, chain.pending_chars)
        if not should_compact(tokens, self.config.compact_at_tokens, len(chain.messages)):
            return
        summary_request = [*chain.messages, {"role": "user", "content": SUMMARY_PROMPT}]
        if chain.messages[-1]["role"] == "user":
            # Keep roles alternating: fold the request into the pending user turn (usually tool results).
            last = chain.messages[-1]
            extra = [{"type": "text", "text": SUMMARY_PROMPT}]
            merged = extra if isinstance(last["content"], str) and not last["content"] else (
                [{"type": "text", "text": last["content"]}, *extra] if isinstance(last["content"], str) else [*last["content"], *extra]
            )
            summary_request = [*chain.messages[:-1], {"role": "user", "content": merged}]
        index, response = self._call(chain, "summary", summary_request)
        summary = "".join(block.text for block in response.content if getattr(block, "type", None) == "text").strip()
        chain.messages = restart_messages(chain.task, summary or "(the summary came back empty)")
        chain.last_usage = None
        chain.pending_chars = sum(len(str(m["content"])) for m in chain.messages)
        self._pending_branch = Branch(
            kind="compaction",
            at_call_index=0,
            from_call_index=index,
            chain=chain.label,
            reason=f"context of {tokens} tokens passed the budget of {self.config.compact_at_tokens}",
        )

    def _run_tool(self, chain: _Chain, call: ToolUse, call_index: int, limit: int) -> tuple[str, bool]:
        """Run one tool call; its result is cut to `limit` characters."""
        if call.name == SHELL:
            # The call budget counts model calls; the last call's command still runs.
            self._check_budget(calls=False)
            timeout = float(call.input.get("timeout_sec") or self.config.command_timeout_s)
            timeout = min(timeout, self.config.command_timeout_s)
            remaining = self._remaining()
            if remaining is not None:
                timeout = max(0.001, min(timeout, remaining))
            result = self.runner.exec(str(call.input["command"]), timeout_s=timeout)
            text = format_shell_result(result.exit_code, result.stdout, result.stderr, result.timed_out, limit)
            return text, not result.ok
        if call.name == DELEGATE:
            if chain.depth >= self.config.max_delegation_depth:
                return "delegation is not available at this depth; do the task yourself", True
            self._sub_agents += 1
            label = f"{chain.label}/delegate-{self._sub_agents}"
            depth = chain.depth + 1
            tools = (SHELL, DELEGATE, SUBMIT) if depth < self.config.max_delegation_depth else (SHELL, SUBMIT)
            sub = _Chain(label, self.config.sub_agent_prompt, tools, str(call.input["task"]), depth)
            self._pending_branch = Branch(kind="delegation", at_call_index=0, from_call_index=call_index, chain=label, reason=f"delegate tool call {call.id}")
            status, answer = self._run_chain(sub)
            if status == "submitted":
                return cut_middle(answer or "(the helper submitted no answer)", limit), False
            return cut_middle(f"the helper ended without submitting: {answer or ''}".strip(), limit), False
        raise AssertionError(f"validated tool {call.name!r} has no handler")
