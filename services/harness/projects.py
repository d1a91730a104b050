"""The long-horizon task family: projects of a few modules, each built from its spec, checked by a build whose time
the task states and the generator draws from a heavy-tailed distribution (like agents' builds and test suites).

An execution runs the build, hands each failing module to a sub-agent (`delegate`; the helper builds that module
to see what it must hold, builds it, checks it, submits), checks the build again and submits: tens of model calls,
minutes of environment time for the slow projects, and with a small context budget
(`budgets.compact_at_tokens`) the main agent compacts on the way. Graded per module by the task's tests, so a
partly fixed project earns partial credit. `demo_records` writes the warm start's demonstrations of it: the main
agent's conversation (cut at its compactions, each ending in the summary the agent writes), and each helper's.
"""

from __future__ import annotations

import math
import random
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

from services.harness.agent_core import (
    DELEGATE,
    SHELL,
    SUB_AGENT_PROMPT,
    SUBMIT,
    SUMMARY_PROMPT,
    SYSTEM_PROMPT,
    format_shell_result,
    restart_messages,
)
from services.harness.task_files import TEST_HEADER, Files
from shared.chat import ToolCall, template_tool_call

FAMILY = "project"
KINDS: tuple[str, ...] = ("upper", "sort", "sum", "count")
TOOL_OUTPUT_CHARS = 4000  # AgentConfig.tool_output_chars
# Build times: log-normal around BUILD_MEDIAN_S with a heavy right tail, cut at BUILD_CAP_S. A module's own check
# (`bash build.sh m2`) takes its share of a full build.
BUILD_MEDIAN_S = 3.0
BUILD_LOG_SD = 1.0
BUILD_CAP_S = 60.0
SHIPPED_TRAIN = 12  # tasks/project-1 … project-12 train; project-13 … project-18 are held out
SHIPPED_HELD_OUT = 6
_WORDS = ("alpha", "bird", "cloud", "delta", "echo", "fire", "green", "house", "lake", "moon", "night", "ocean",
          "paper", "river", "stone", "tree", "water", "wind", "zebra", "gyre")
_LEVELS = ("ERROR", "WARN", "INFO")


class ProjectError(ValueError):
    """A project's parameters are not ones this family can build."""


# ---------------------------------------------------------------- one module


def describe(module: dict[str, Any]) -> str:
    """What `src/<name>.txt` must hold, in the words the build prints and the helper is told."""
    name, kind = module["name"], module["kind"]
    match kind:
        case "upper":
            return f"specs/{name}.txt in upper case"
        case "sort":
            return f"the lines of specs/{name}.txt sorted"
        case "sum":
            return f"the sum of the numbers in specs/{name}.txt"
        case "count":
            return f"the number of lines of specs/{name}.txt that contain {module['word']}"
    raise ProjectError(f"module {name}: kind {kind!r} is not one of {list(KINDS)}")


def fix_command(module: dict[str, Any]) -> str:
    """The command that builds a module right (what a careful helper runs)."""
    name, kind = module["name"], module["kind"]
    spec, out = f"specs/{name}.txt", f"src/{name}.txt"
    match kind:
        case "upper":
            return f"tr a-z A-Z < {spec} > {out}"
        case "sort":
            return f"LC_ALL=C sort {spec} > {out}"
        case "sum":
            return f"awk '{{s+=$1}} END {{print s}}' {spec} > {out}"
        case "count":
            return f"grep -c {shlex.quote(module['word'])} {spec} > {out}"
    raise ProjectError(f"module {name}: kind {kind!r} is not one of {list(KINDS)}")


def slip_command(module: dict[str, Any]) -> str:
    """A careless helper's command: the module's file appears, with the spec copied instead of built."""
    return f"cp specs/{module['name']}.txt src/{module['name']}.txt"


def expected(module: dict[str, Any]) -> str:
    """The module's right content, as the tests compare it (stripped)."""
    lines = [str(x) for x in module["lines"]]
    match module["kind"]:
        case "upper":
            return "\n".join(lines).upper()
        case "sort":
            return "\n".join(sorted(lines))
        case "sum":
            return str(sum(int(x) for x in lines))
        case "count":
            return str(sum(1 for line in lines if module["word"] in line))
    raise ProjectError(f"module {module['name']}: kind {module['kind']!r} is not one of {list(KINDS)}")


def _want_expr(module: dict[str, Any]) -> str:
    """The shell expression the build computes a module's right content with (the fix command's own pipeline)."""
    return fix_command(module).rsplit(" > ", 1)[0]


# ---------------------------------------------------------------- one task


def module_seconds(build_seconds: float, modules: int) -> float:
    return round(max(0.5, build_seconds / modules), 2)


def build_script(modules: Sequence[dict[str, Any]], build_seconds: float) -> str:
    names = " ".join(m["name"] for m in modules)
    cases = "".join(
        f"    {m['name']}) want=\"$({_want_expr(m)})\"; what={shlex.quote(describe(m))} ;;\n" for m in modules
    )
    return f"""#!/bin/bash
# Builds and tests the project: every module, or the ones named. A full build takes {build_seconds} s, one module
# its share. Prints "ok <module>" or "FAIL <module>: <what it must hold>" per module; exit 1 if any failed.
cd "$(dirname "$0")"
if [ $# -gt 0 ]; then modules="$*"; sleep {module_seconds(build_seconds, len(modules))}
else modules="{names}"; sleep {build_seconds}; fi
fail=0
for m in $modules; do
  case $m in
{cases}    *) echo "FAIL $m: no such module"; fail=1; continue ;;
  esac
  if [ -f "src/$m.txt" ] && [ "$(cat "src/$m.txt")" = "$want" ]; then echo "ok $m"
  else echo "FAIL $m: src/$m.txt must hold $what"; fail=1; fi
done
exit $fail
"""


def instruction(modules: Sequence[dict[str, Any]], build_seconds: float) -> str:
    names = ", ".join(m["name"] for m in modules)
    return (f"This project has {len(modules)} modules ({names}); each one, src/<module>.txt, is built from its spec "
            f"in specs/. Run bash build.sh to build and test them all (a full build takes about "
            f"{build_seconds:.0f} s); it names each module that fails and what it must hold. Hand each failing "
            f"module to a helper with the delegate tool, run the build again, then submit.")


def project(task_id: str, modules: list[dict[str, Any]], build_seconds: float) -> Files:
    """The task folder's files: task.yaml (its build time stated), the workspace (build.sh, specs/, src/), the
    reference solution and one test per module."""
    if not modules:
        raise ProjectError(f"{task_id}: a project needs at least one module")
    text = instruction(modules, build_seconds)
    tests = "".join(f"""

def test_{m['name']}():
    path = APP / "src" / "{m['name']}.txt"
    assert path.is_file() and path.read_text().strip() == {expected(m)!r}
""" for m in modules)
    files: Files = {
        "task.yaml": "\n".join([
            "instruction: |-", *("  " + line for line in text.splitlines()), "author_name: Gyre",
            "difficulty: medium", "category: software-engineering", f"family: {FAMILY}",
            f"build_seconds: {build_seconds}", "tags: [generated, long-horizon]", "parser_name: pytest",
            "max_agent_timeout_sec: 900", "max_test_timeout_sec: 60", "",
        ]),
        "workspace/build.sh": build_script(modules, build_seconds),
        "workspace/src/.keep": "",
        "solution.sh": "#!/bin/bash\ncd /app\n" + "".join(fix_command(m) + "\n" for m in modules),
        "tests/test_outputs.py": TEST_HEADER.format(task_id=task_id) + tests,
    }
    for m in modules:
        files[f"workspace/specs/{m['name']}.txt"] = "".join(f"{line}\n" for line in m["lines"])
    return files


def sample_params(rng: random.Random, *, min_modules: int = 3, max_modules: int = 6) -> dict[str, Any]:
    """A fresh project: its modules (kinds and data) and its build time."""
    modules = []
    for i in range(rng.randint(min_modules, max_modules)):
        kind = rng.choice(KINDS)
        module: dict[str, Any] = {"name": f"m{i + 1}", "kind": kind}
        match kind:
            case "upper":
                module["lines"] = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))]
            case "sort":
                module["lines"] = rng.sample(_WORDS, rng.randint(3, 5))
            case "sum":
                module["lines"] = [rng.randint(1, 99) for _ in range(rng.randint(2, 5))]
            case "count":
                word = rng.choice(_LEVELS)
                lines = [f"{rng.choice(_LEVELS)} {rng.choice(_WORDS)}" for _ in range(rng.randint(3, 6))]
                lines[rng.randrange(len(lines))] = f"{word} {rng.choice(_WORDS)}"
                module.update(word=word, lines=lines)
        modules.append(module)
    return {"modules": modules, "build_seconds": sample_build_seconds(rng)}


def sample_build_seconds(rng: random.Random) -> float:
    return round(min(BUILD_CAP_S, math.exp(rng.gauss(math.log(BUILD_MEDIAN_S), BUILD_LOG_SD))), 1)


def shipped() -> Iterator[tuple[str, dict[str, Any]]]:
    """The shipped projects (tasks/project-<n>): the first SHIPPED_TRAIN to train on, the rest held out."""
    rng = random.Random(20261206)
    for i in range(SHIPPED_TRAIN + SHIPPED_HELD_OUT):
        yield f"{FAMILY}-{i + 1}", sample_params(rng)


def held_out_ids() -> list[str]:
    return [f"{FAMILY}-{i + 1}" for i in range(SHIPPED_TRAIN, SHIPPED_TRAIN + SHIPPED_HELD_OUT)]


def train_ids() -> list[str]:
    return [f"{FAMILY}-{i + 1}" for i in range(SHIPPED_TRAIN)]


# ---------------------------------------------------------------- demonstrations


def build_output(modules: Sequence[dict[str, Any]], fixed: set[str]) -> tuple[str, int]:
    """What `bash build.sh [names…]` prints for `modules` when those in `fixed` are right, and its exit code."""
    lines = [f"ok {m['name']}" if m["name"] in fixed else f"FAIL {m['name']}: src/{m['name']}.txt must hold "
             f"{describe(m)}" for m in modules]
    return "\n".join(lines) + "\n", int(len(fixed & {m["name"] for m in modules}) < len(modules))


def _shell_result(output: str, code: int) -> str:
    return format_shell_result(code, output, "", False, TOOL_OUTPUT_CHARS)


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call = template_tool_call(ToolCall(name=name, arguments=arguments))
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def helper_task(module: dict[str, Any]) -> str:
    """What the main agent hands a helper: the module's name and how to find out what it must hold (the build of
    that module says), so the main agent copies a name, not the build's words."""
    name = module["name"]
    return (f"Fix module {name}: run bash build.sh {name} to see what src/{name}.txt must hold, build it, check it "
            f"with the same command, then submit.")


def demo_records(params: dict[str, Any], rng: random.Random, *, main_system: str, helper_system: str,
                 slip_rate: float = 0.0, compact_every: tuple[int, int] = (2, 3)) -> list[list[dict[str, Any]]]:
    """One execution's demonstrations, in chat-template messages: the main agent's conversation cut at each
    compaction (a piece ends with the summary request and the summary it writes; the next starts from the task and
    that summary, and runs the build again), and each helper's. The demonstrator slips at `slip_rate`: a helper
    copies the spec instead of building the module (and reports the failed check), or the main agent submits
    straight after the first build."""
    modules = params["modules"]
    task = instruction(modules, params["build_seconds"])
    fixed: set[str] = set()
    records: list[list[dict[str, Any]]] = []
    piece: list[dict[str, Any]] = [{"role": "system", "content": main_system}, {"role": "user", "content": task}]

    def build(names: Sequence[dict[str, Any]] = modules) -> None:
        piece.append(_call(SHELL, {"command": "bash build.sh"}))
        piece.append({"role": "tool", "content": _shell_result(*build_output(names, fixed))})

    build()
    if slip_rate > 0 and rng.random() < slip_rate / 4:
        records.append([*piece, _call(SUBMIT, {"answer": "built"})])
        return records
    until_compaction = rng.randint(*compact_every)
    for module in [m for m in modules if m["name"] not in fixed]:
        if until_compaction == 0:
            remaining = [m["name"] for m in modules if m["name"] not in fixed]
            summary = (f"I ran bash build.sh and handed failing modules to helpers. Fixed: "
                       f"{', '.join(sorted(fixed)) or 'none'}. Still to fix: {', '.join(remaining)}.")
            records.append([*piece, {"role": "user", "content": SUMMARY_PROMPT},
                            {"role": "assistant", "content": summary}])
            piece = [{"role": "system", "content": main_system},
                     {"role": "user", "content": restart_messages(task, summary)[0]["content"]}]
            build()
            until_compaction = rng.randint(*compact_every)
        slipped = slip_rate > 0 and rng.random() < slip_rate
        answer = _helper(records, module, helper_system, slipped)
        if not slipped:
            fixed.add(module["name"])
        piece.append(_call(DELEGATE, {"task": helper_task(module)}))
        piece.append({"role": "tool", "content": answer})
        until_compaction -= 1
    build()
    records.append([*piece, _call(SUBMIT, {"answer": "all modules built" if len(fixed) == len(modules) else "done"})])
    return records


def _helper(records: list[list[dict[str, Any]]], module: dict[str, Any], system: str, slipped: bool) -> str:
    """Add a helper's conversation (see what the module must hold, build it, check it, submit); returns the answer
    it submits."""
    name = module["name"]
    output, code = build_output([module], set() if slipped else {name})
    answer = output.strip()
    records.append([
        {"role": "system", "content": system},
        {"role": "user", "content": helper_task(module)},
        _call(SHELL, {"command": f"bash build.sh {name}"}),
        {"role": "tool", "content": _shell_result(*build_output([module], set()))},
        _call(SHELL, {"command": slip_command(module) if slipped else fix_command(module)}),
        {"role": "tool", "content": _shell_result("", 0)},
        _call(SHELL, {"command": f"bash build.sh {name}"}),
        {"role": "tool", "content": _shell_result(output, code)},
        _call(SUBMIT, {"answer": answer}),
    ])
    return answer


MAIN_TOOLS = (SHELL, DELEGATE, SUBMIT)  # the main agent's (delegation depth 1), and a helper's
HELPER_TOOLS = (SHELL, SUBMIT)
PROMPTS = (SYSTEM_PROMPT, SUB_AGENT_PROMPT)


def sample_demos(*, seed: int, count: int, main_system: str, helper_system: str, slip_rate: float = 0.0,
                 exclude: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """`count` records (JSONL-ready) from fresh projects, never one whose parameters are in `exclude`; the system
    turns are the main agent's and a helper's as the gateway renders them with their tools (demos.py)."""
    import json

    rng = random.Random(seed)
    excluded = {json.dumps(p, sort_keys=True) for p in exclude}
    out: list[dict[str, Any]] = []
    n = 0
    while len(out) < count:
        params = sample_params(rng)
        if json.dumps(params, sort_keys=True) in excluded:
            continue
        n += 1
        for messages in demo_records(params, rng, main_system=main_system, helper_system=helper_system,
                                     slip_rate=slip_rate):
            out.append({"messages": messages, "demo": {"family": FAMILY, "task_id": f"demo-{FAMILY}-{n}"}})
    return out[:count]
