"""Demonstrations of the generated task family for the supervised warm-start: fresh task instances from
taskgen, each solved by one shell call and a submit, written as the JSONL that `gyre train sft` reads.

The conversations are the built-in agent's (its system prompt, tools, tool-result text), so once rendered
with the chat template they are the very tokens the gateway puts in front of the model at RL time.
"""

from __future__ import annotations

import json
import random
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from services.harness import task_files, taskgen
from services.harness.agent_core import DELEGATE, SHELL, SUBMIT, SYSTEM_PROMPT, TOOL_SCHEMAS, format_shell_result
from shared.chat import ToolCall, chat_template, template_tool, template_tool_call

FAMILIES: tuple[str, ...] = ("create-file", "sum-numbers", "count-matches", "uppercase", "sort-lines", "move-file")
# What the harness service's agent offers (AgentConfig's default delegation depth of 1 adds `delegate`).
AGENT_TOOLS: tuple[str, ...] = (SHELL, DELEGATE, SUBMIT)
TOOL_OUTPUT_CHARS = 4000  # AgentConfig.tool_output_chars: the cut applied to a shell result

# Word pools for fresh instances: short lowercase words, so a command copies them token for token.
_WORDS: tuple[str, ...] = (
    "alpha", "apple", "bird", "blue", "cat", "cloud", "code", "data", "day", "dog", "east", "fast", "fire",
    "fish", "good", "green", "happy", "hello", "house", "ice", "jump", "king", "lake", "light", "lime",
    "moon", "morning", "music", "night", "north", "ocean", "open", "paper", "park", "quick", "rain", "red",
    "river", "road", "rock", "rocks", "sand", "ship", "sky", "slow", "snow", "song", "star", "stone", "sun",
    "tree", "water", "west", "wind", "world", "yellow", "zebra", "gyre", "test", "note", "plan", "time",
)
_FILE_STEMS: tuple[str, ...] = (
    "hello", "note", "notes", "answer", "greeting", "todo", "result", "output", "message", "log", "data",
    "info", "readme", "list", "memo", "report", "draft", "words", "text", "story", "poem", "word", "name",
)
_EXTENSIONS: tuple[str, ...] = ("txt", "txt", "txt", "md", "log", "csv")
_FOLDERS: tuple[str, ...] = ("archive", "backup", "old", "done", "store", "saved", "files", "docs", "keep")
_LEVELS: tuple[str, ...] = ("ERROR", "WARN", "INFO", "DEBUG", "timeout", "failed", "ok")


class DemoError(ValueError):
    """A demonstration was asked for something this generator does not cover."""


SLIPS: tuple[str, ...] = ("skip", "wrong-command")


class DemoInstance(BaseModel):
    """One fresh task instance: its family, parameters, the instruction the agent gets, and the command the
    demonstrator runs. `slip` names the demonstrator's mistake, if it made one: "skip" submits without running
    anything (`command` is None), "wrong-command" runs a plausible command that does not solve the task."""

    model_config = ConfigDict(frozen=True)

    family: str
    task_id: str
    params: dict[str, Any]
    instruction: str = Field(min_length=1)
    command: str | None = Field(default=None, min_length=1)
    slip: str | None = None

    def files(self) -> dict[str, str]:
        """The task folder's files, as taskgen writes them (task.yaml, tests, workspace...)."""
        files = _FAMILY_FUNCTIONS[self.family](self.task_id, **self.params)
        files["run-tests.sh"] = task_files.RUN_TESTS
        files["params.json"] = json.dumps(self.params, sort_keys=True) + "\n"
        return files


_FAMILY_FUNCTIONS: dict[str, Callable[..., task_files.Files]] = {
    "create-file": taskgen.create_file,
    "sum-numbers": taskgen.sum_numbers,
    "count-matches": taskgen.count_matches,
    "uppercase": taskgen.uppercase,
    "sort-lines": taskgen.sort_lines,
    "move-file": taskgen.move_file,
}


def demo_command(family: str, params: dict[str, Any]) -> str:
    """The shell command a demonstration runs (in the working directory /app).

    Relative paths and unquoted words where that is safe: the shorter the command, and the more its tokens
    repeat the instruction's, the easier it is for a tiny model to copy.
    """
    match family:
        case "create-file":
            text = str(params["text"])
            words = text.split(" ")
            # Unquoted only when echo gives back exactly the text (plain words, single spaces).
            value = text if all(w.isalnum() for w in words) and " ".join(words) == text else shlex.quote(text)
            return f"echo {value} > {params['name']}"
        case "sum-numbers":
            return "awk '{s+=$1} END {print s}' numbers.txt > sum.txt"
        case "count-matches":
            return f"grep -c {shlex.quote(str(params['word']))} log.txt > count.txt"
        case "uppercase":
            return "tr a-z A-Z < in.txt > out.txt"
        case "sort-lines":
            return "LC_ALL=C sort names.txt > sorted.txt"
        case "move-file":
            return f"mkdir -p {params['folder']} && mv {params['name']} {params['folder']}/"
        case other:
            raise DemoError(f"no demonstration for family {other!r}; expected one of {list(FAMILIES)}")


def slip_command(family: str, params: dict[str, Any]) -> str:
    """A plausible command that does not solve the task: the output file appears, its content is wrong.

    What a careless demonstrator types (copy instead of transform, count lines instead of summing, list
    matches instead of counting them); graded by the task's own tests it earns partial credit.
    """
    match family:
        case "create-file":
            return f"touch {params['name']}"
        case "sum-numbers":
            return "wc -l < numbers.txt > sum.txt"
        case "count-matches":
            return f"grep {shlex.quote(str(params['word']))} log.txt > count.txt"
        case "uppercase":
            return "cp in.txt out.txt"
        case "sort-lines":
            return "cp names.txt sorted.txt"
        case "move-file":
            return f"mkdir -p {params['folder']} && cp {params['name']} {params['folder']}/"
        case other:
            raise DemoError(f"no demonstration for family {other!r}; expected one of {list(FAMILIES)}")


def _sample_params(family: str, rng: random.Random) -> dict[str, Any]:
    match family:
        case "create-file":
            name = f"{rng.choice(_FILE_STEMS)}.{rng.choice(_EXTENSIONS)}"
            n = rng.choice((1, 2, 2, 2, 3))
            text = str(rng.randint(0, 999)) if rng.random() < 0.1 else " ".join(rng.choice(_WORDS) for _ in range(n))
            return {"name": name, "text": text}
        case "sum-numbers":
            return {"numbers": [rng.randint(-20, 120) for _ in range(rng.randint(2, 6))]}
        case "count-matches":
            word = rng.choice(_LEVELS)
            lines = [f"{rng.choice(_LEVELS)} {rng.choice(_WORDS)}" for _ in range(rng.randint(3, 7))]
            # At least one match: `grep -c` exits 1 on none, and the demonstrated result says exit code 0.
            lines[rng.randrange(len(lines))] = f"{word} {rng.choice(_WORDS)}"
            return {"word": word, "lines": lines}
        case "uppercase":
            return {"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 4)))}
        case "sort-lines":
            return {"words": rng.sample(_WORDS, rng.randint(3, 6))}
        case "move-file":
            return {"name": f"{rng.choice(_FILE_STEMS)}.{rng.choice(_EXTENSIONS)}", "folder": rng.choice(_FOLDERS)}
        case other:
            raise DemoError(f"no demonstration for family {other!r}; expected one of {list(FAMILIES)}")


def shipped_params() -> dict[str, dict[str, Any]]:
    """The parameters of the tasks taskgen ships under tasks/ (held out of the demonstrations by default)."""
    return {task_id: dict(params) for task_id, _, params in taskgen._families()}  # noqa: SLF001 - taskgen's own list


def make_instance(family: str, params: dict[str, Any], task_id: str, slip: str | None = None) -> DemoInstance:
    if family not in _FAMILY_FUNCTIONS:
        raise DemoError(f"no demonstration for family {family!r}; expected one of {list(FAMILIES)}")
    if slip is not None and slip not in SLIPS:
        raise DemoError(f"slip: expected one of {list(SLIPS)} or none, got {slip!r}")
    files = _FAMILY_FUNCTIONS[family](task_id, **params)
    instruction = str(yaml.safe_load(files["task.yaml"])["instruction"])
    command = {None: demo_command, "wrong-command": slip_command}.get(slip, lambda *_: None)(family, params)
    return DemoInstance(family=family, task_id=task_id, params=params, instruction=instruction, command=command, slip=slip)


def sample_instances(
    *,
    seed: int,
    count: int,
    families: Sequence[str] = FAMILIES,
    weights: Sequence[float] | None = None,
    exclude: Iterable[dict[str, Any]] = (),
    slip_rate: float = 0.0,
) -> list[DemoInstance]:
    """`count` fresh instances drawn with their own seeded generator; parameter sets in `exclude` (by default
    callers pass the shipped tasks') are never drawn, so the shipped tasks stay unseen.

    With `slip_rate` > 0 the demonstrator is imperfect: that fraction of the demonstrations carry a slip, half
    of them "skip" and half "wrong-command". A model imitating it solves the tasks only part of the time, and
    the gap is what RL, graded by the tasks' own tests, has to close.
    """
    if count < 0:
        raise DemoError(f"count: expected a non-negative number, got {count}")
    if not 0.0 <= slip_rate <= 1.0:
        raise DemoError(f"slip_rate: expected a fraction in [0, 1], got {slip_rate}")
    unknown = [f for f in families if f not in _FAMILY_FUNCTIONS]
    if unknown or not families:
        raise DemoError(f"families: expected a non-empty subset of {list(FAMILIES)}, got {list(families)}")
    excluded = {json.dumps(p, sort_keys=True) for p in exclude}
    rng = random.Random(seed)
    out: list[DemoInstance] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * (count + 1):
            raise DemoError(f"could not draw {count} instances outside the {len(excluded)} excluded parameter sets")
        family = rng.choices(list(families), weights=list(weights) if weights else None)[0]
        params = _sample_params(family, rng)
        slip = rng.choice(SLIPS) if slip_rate > 0 and rng.random() < slip_rate else None
        if json.dumps(params, sort_keys=True) in excluded:
            continue
        out.append(make_instance(family, params, f"demo-{family}-{len(out)}", slip))
    return out


def tools_system_text(system_prompt: str = SYSTEM_PROMPT, tools: Sequence[str] = AGENT_TOOLS) -> str:
    """The system turn's text as the chat template renders a system prompt together with tools.

    `gyre train sft` renders messages without a tools argument, so the tools block rides inside the system
    message; the template renders both to the same text.
    """
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # Hugging Face's tojson: plain json.dumps (no HTML escaping, non-ASCII kept), which the gateway renders with.
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    rendered = env.from_string(chat_template()).render(
        messages=[{"role": "system", "content": system_prompt}], tools=[tool_function(name) for name in tools],
        add_generation_prompt=False,
    )
    head, tail = "<|im_start|>system\n", "<|im_end|>\n"
    if not (rendered.startswith(head) and rendered.endswith(tail)):
        raise DemoError(f"expected the chat template to render one ChatML system turn, got {rendered[:80]!r}...")
    return rendered[len(head) : -len(tail)]


def tool_function(name: str) -> dict[str, Any]:
    """An agent tool in the OpenAI function shape the gateway hands the chat template."""
    schema = TOOL_SCHEMAS[name]
    return template_tool(schema["name"], schema["description"], schema["input_schema"])


def shell_result(command_output: str = "", exit_code: int = 0) -> str:
    """The shell tool's result text for a command that printed `command_output` (the agent's own format)."""
    return format_shell_result(exit_code, command_output, "", False, TOOL_OUTPUT_CHARS)


def demo_messages(instance: DemoInstance, system_text: str) -> list[dict[str, Any]]:
    """The conversation in chat-template shape: system (with tools), task, shell call, its result, submit
    (a "skip" slip submits straight away)."""
    if instance.command is None:
        return [
            {"role": "system", "content": system_text},
            {"role": "user", "content": instance.instruction},
            {"role": "assistant", "content": "", "tool_calls": [_call(SUBMIT, {})]},
        ]
    return [
        {"role": "system", "content": system_text},
        {"role": "user", "content": instance.instruction},
        {"role": "assistant", "content": "", "tool_calls": [_call(SHELL, {"command": instance.command})]},
        {"role": "tool", "content": shell_result()},
        {"role": "assistant", "content": "", "tool_calls": [_call(SUBMIT, {})]},
    ]


def anthropic_turns(instance: DemoInstance) -> list[dict[str, Any]]:
    """The same conversation as the agent loop's Anthropic `messages` (system and tools go beside them)."""
    if instance.command is None:
        return [
            {"role": "user", "content": instance.instruction},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_demo_0", "name": SUBMIT, "input": {}}]},
        ]
    return [
        {"role": "user", "content": instance.instruction},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_demo_0", "name": SHELL, "input": {"command": instance.command}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_demo_0", "content": shell_result(), "is_error": False}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_demo_1", "name": SUBMIT, "input": {}}]},
    ]


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return template_tool_call(ToolCall(name=name, arguments=arguments))


def demo_records(instances: Sequence[DemoInstance], system_text: str) -> list[dict[str, Any]]:
    """JSONL records for `gyre train sft`: the messages, plus which instance they demonstrate."""
    return [
        {
            "messages": demo_messages(i, system_text),
            "demo": {"family": i.family, "task_id": i.task_id, "params": i.params, "slip": i.slip},
        }
        for i in instances
    ]


def write_demos(
    out: Path,
    *,
    seed: int,
    count: int,
    families: Sequence[str] = FAMILIES,
    weights: Sequence[float] | None = None,
    include_shipped: bool = False,
    slip_rate: float = 0.0,
) -> int:
    """Write `count` demonstrations to `out` (JSONL); the shipped tasks' parameters are held out unless asked.

    The long-horizon family (`project`, services/harness/projects.py) counts as one family among those named: its
    share of `count` is records of its executions (main agent pieces and helpers), the rest one per instance."""
    from services.harness import projects

    exclude = [] if include_shipped else list(shipped_params().values())
    shell = [f for f in families if f != projects.FAMILY]
    if weights is not None and len(shell) != len(families):
        raise DemoError("weights: not with the project family, whose demonstrations are whole executions")
    n_project = 0 if len(shell) == len(families) else round(count * (len(families) - len(shell)) / len(families))
    records: list[dict[str, Any]] = []
    if shell:
        instances = sample_instances(
            seed=seed, count=count - n_project, families=shell, weights=weights, exclude=exclude, slip_rate=slip_rate
        )
        records = demo_records(instances, tools_system_text())
    if n_project:
        main_system, helper_system = (tools_system_text(prompt, tools)
                                      for prompt, tools in zip(projects.PROMPTS, (projects.MAIN_TOOLS,
                                                                                  projects.HELPER_TOOLS)))
        records += projects.sample_demos(seed=seed, count=n_project, main_system=main_system,
                                         helper_system=helper_system, slip_rate=slip_rate, exclude=exclude)
        random.Random(seed).shuffle(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return len(records)


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m services.harness.demos", description=__doc__)
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated families (and `project`, the long-horizon one)")
    parser.add_argument("--weights", default="", help="comma-separated sampling weights, one per family")
    parser.add_argument("--include-shipped", action="store_true", help="also draw the shipped tasks' parameters")
    parser.add_argument("--slip-rate", type=float, default=0.0, help="fraction of demonstrations with a mistake")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    if weights is not None and len(weights) != len(families):
        raise SystemExit(f"--weights: expected {len(families)} numbers (one per family), got {len(weights)}")
    n = write_demos(
        args.out, seed=args.seed, count=args.count, families=families, weights=weights,
        include_shipped=args.include_shipped, slip_rate=args.slip_rate,
    )
    print(json.dumps({"demos": n, "out": str(args.out)}))


if __name__ == "__main__":
    _main(sys.argv[1:])
