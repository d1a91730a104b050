"""Pure core of the built-in agent loop: tool definitions, reply validation, context accounting, restarts,
and the loop's configuration, budget and outcome.

No I/O, no clock: the loop in agent.py feeds it plain dicts (Anthropic content blocks) and numbers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.tool_formats import has_tool_call_marker

SHELL = "shell"
DELEGATE = "delegate"
SUBMIT = "submit"

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    SHELL: {
        "name": SHELL,
        "description": "Run a bash command in the task's working directory and return its exit code and output. "
        "Each call is a fresh shell: files persist, shell variables and `cd` do not.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to run."},
                "timeout_sec": {"type": "number", "description": "Optional limit for this command in seconds."},
            },
            "required": ["command"],
        },
    },
    DELEGATE: {
        "name": DELEGATE,
        "description": "Hand a self-contained sub-task to a helper agent with a fresh context. It can run shell "
        "commands in the same workspace and returns its final answer as this tool's result.",
        "input_schema": {
            "type": "object",
            "properties": {"task": {"type": "string", "description": "What the helper must do and report."}},
            "required": ["task"],
        },
    },
    SUBMIT: {
        "name": SUBMIT,
        "description": "Call when the task is complete (or when you are done). Your work in the workspace is graded.",
        "input_schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "A short summary or final answer."}},
            "required": [],
        },
    },
}

SYSTEM_PROMPT = (
    "You are an autonomous agent working in a Linux sandbox with no network. Use the shell tool to inspect "
    "and change files in the working directory. When the task is complete, call submit."
)
SUB_AGENT_PROMPT = (
    "You are a helper agent working in a Linux sandbox with no network. Do the task you are given using the "
    "shell tool, then call submit with your findings as the answer."
)
SUMMARY_PROMPT = (
    "Your context is nearly full. Write a concise summary of the task, what you have done so far, the current "
    "state of the files, and what remains to do. Reply with the summary text only; do not call tools."
)


class ToolUse(BaseModel):
    """A `tool_use` block of the Anthropic API as the agent validated it (the API's id, name and input)."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    input: dict[str, Any]


class ValidReply(BaseModel):
    """A well-formed reply: its text and tool calls (none means the agent ended its turn with text)."""

    model_config = ConfigDict(frozen=True)

    text: str
    tool_calls: tuple[ToolUse, ...] = ()


class MalformedReply(BaseModel):
    model_config = ConfigDict(frozen=True)

    reason: str


def _check_input(name: str, value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"tool {name!r}: expected an object as input, got {type(value).__name__}"
    schema = TOOL_SCHEMAS[name]["input_schema"]
    for key in schema["required"]:
        if key not in value:
            return f"tool {name!r}: missing required field {key!r}"
    for key, spec in schema["properties"].items():
        if key not in value:
            continue
        expected = spec["type"]
        item = value[key]
        ok = isinstance(item, str) if expected == "string" else isinstance(item, int | float) and not isinstance(item, bool)
        if not ok:
            return f"tool {name!r}: field {key!r} should be a {expected}, got {type(item).__name__}"
    if name == SHELL and not str(value["command"]).strip():
        return "tool 'shell': empty command"
    return None


def validate_reply(content: list[dict[str, Any]], stop_reason: str | None, tools: tuple[str, ...]) -> ValidReply | MalformedReply:
    """Decide whether a reply can be acted on; anything else is re-sampled by the loop."""
    text = "".join(str(block.get("text", "")) for block in content if block.get("type") == "text")
    calls: list[ToolUse] = []
    for block in content:
        if block.get("type") != "tool_use":
            continue
        name = block.get("name")
        if name not in tools:
            return MalformedReply(reason=f"unknown tool {name!r}; expected one of {list(tools)}")
        problem = _check_input(str(name), block.get("input"))
        if problem is not None:
            return MalformedReply(reason=problem)
        calls.append(ToolUse(id=str(block.get("id", "")), name=str(name), input=dict(block["input"])))
    # A tool-call marker left in the text means the gateway could not parse a call the model tried to make.
    if has_tool_call_marker(text):
        return MalformedReply(reason="a tool call in the text could not be parsed")
    if stop_reason == "max_tokens" and not calls:
        return MalformedReply(reason="the reply was cut off at max_tokens")
    if not calls and not text.strip():
        return MalformedReply(reason="empty reply: no text and no tool call")
    return ValidReply(text=text, tool_calls=tuple(calls))


def context_tokens(usage: dict[str, int] | None, pending_chars: int) -> int:
    """Tokens the next request will carry: the last prompt and reply (from usage) plus new tool output."""
    used = 0
    if usage:
        used = sum(int(usage.get(key) or 0) for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens"))
    # Roughly four characters per token for the text appended since the last call.
    return used + pending_chars // 4


def should_compact(tokens: int, budget: int | None, message_count: int) -> bool:
    """Compact when the context passes its budget, unless it is already a fresh start (nothing to drop)."""
    return budget is not None and tokens > budget and message_count > 1


def main_tools(config: AgentConfig) -> tuple[str, ...]:
    """The main agent's tools: delegate only when it may hand work to sub-agents."""
    return (SHELL, DELEGATE, SUBMIT) if config.max_delegation_depth > 0 else (SHELL, SUBMIT)


def first_request(config: AgentConfig, instruction: str) -> dict[str, Any]:
    """The Messages request the main agent opens an execution with (what the run plan sizes the context by)."""
    return {
        "model": config.model,
        "max_tokens": config.max_tokens,
        "system": config.system_prompt,
        "messages": [{"role": "user", "content": instruction}],
        "tools": [TOOL_SCHEMAS[name] for name in main_tools(config)],
    }


def restart_messages(task: str, summary: str) -> list[dict[str, Any]]:
    """The new context after compaction: the original task and the summary, in one user turn."""
    return [
        {
            "role": "user",
            "content": f"{task}\n\nYou already worked on this task; your context was reset. "
            f"Summary of your progress so far:\n{summary}\n\nContinue from here.",
        }
    ]


def format_shell_result(exit_code: int | None, stdout: str, stderr: str, timed_out: bool, limit: int) -> str:
    """The text a shell tool call returns to the model, cut to `limit` characters keeping both ends."""
    status = "timed out (killed)" if timed_out else f"exit code {exit_code}"
    body = stdout
    if stderr.strip():
        body = f"{stdout}\n[stderr]\n{stderr}" if stdout else f"[stderr]\n{stderr}"
    return cut_middle(f"[{status}]\n{body}".rstrip(), limit)


def cut_middle(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping both ends (the status line and the last output)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


class Branch(BaseModel):
    """A deliberate branch of the call tree, as the loop reports it (the service turns it into an event)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["compaction", "delegation", "retry"]
    at_call_index: int = Field(ge=0)  # the first call on the new branch
    from_call_index: int | None = None  # the call the branch leaves from
    chain: str = "main"
    reason: str = ""


class AgentCall(BaseModel):
    """One model call as the loop saw it: its place, purpose and outcome (the loop's call log)."""

    model_config = ConfigDict(frozen=True)

    index: int
    chain: str
    purpose: Literal["turn", "retry", "summary"]
    request_messages: int
    stop_reason: str | None
    context_tokens: int
    output_tokens: int
    tool_calls: tuple[str, ...] = ()
    malformed: str | None = None


class AgentConfig(BaseModel):
    """How the built-in agent works: its model, prompts, context budget, retries and tool limits."""

    model_config = ConfigDict(frozen=True)

    model: str
    max_tokens: int = Field(default=1024, gt=0)
    temperature: float | None = None
    system_prompt: str = SYSTEM_PROMPT
    sub_agent_prompt: str = SUB_AGENT_PROMPT
    # Context budget in tokens: past it the chain is compacted before its next call.
    compact_at_tokens: int | None = Field(default=24_000, gt=0)
    max_retries: int = Field(default=2, ge=0)
    max_delegation_depth: int = Field(default=1, ge=0)
    command_timeout_s: float = Field(default=120.0, gt=0)
    tool_output_chars: int = Field(default=4000, gt=100)
    # Retries of transient API errors (connection, 429, 5xx), each within the wall-clock budget.
    sdk_max_retries: int = Field(default=2, ge=0)
    # Beyond those, how long such errors go on being retried (backing off to 8 s) since the first of a call:
    # a gateway or rollout worker that restarts is back within this, and an hours-long execution should not
    # end as an infrastructure failure for it. 0: only the `sdk_max_retries` retries.
    api_outage_s: float = Field(default=0.0, ge=0)
    # A seed to send as a body field (a Gyre extension the gateway uses for sampling). Under the harness
    # service the gateway already takes each execution's seed from its `execution.started`; this is for a loop
    # run against a gateway that has none.
    seed: int | None = None


class Budget(BaseModel):
    """Per-execution limits; None is unlimited."""

    model_config = ConfigDict(frozen=True)

    wall_clock_s: float | None = Field(default=None, gt=0)
    max_calls: int | None = Field(default=None, gt=0)


AgentStatus = Literal["submitted", "ended", "timed_out", "calls_exhausted", "error"]


class AgentOutcome(BaseModel):
    """How one run of the built-in agent ended: its status, answer, calls, branches and call log."""

    model_config = ConfigDict(frozen=True)

    status: AgentStatus
    answer: str | None = None
    calls: int
    elapsed_s: float
    branches: tuple[Branch, ...] = ()
    call_log: tuple[AgentCall, ...] = ()
    error: str | None = None
    infra_failure: bool = False  # the error came from the model API's side, not from the agent's own request

    @property
    def budget_ran_out(self) -> bool:
        return self.status in ("timed_out", "calls_exhausted")
