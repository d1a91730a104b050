"""What a run config will do, checked before anything starts: the model, the tasks, the harness, the sandbox,
whether the harness's first prompt fits the context, and every process with its cell and devices.

`gyre run --dry-run` prints it; `gyre run` plans first and starts nothing when the plan has an error.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, RunConfig, flatten

LEARNABLE_FAMILIES: tuple[str, ...] = ("sum-numbers", "count-matches", "uppercase", "sort-lines")


@dataclass
class RunPlan:
    config: RunConfig
    sources: dict[str, str]  # overridden settings -> where the value came from
    task_ids: list[str] = field(default_factory=list)
    model: str = ""  # what the model is, in words
    first_prompt_tokens: int | None = None  # the harness's opening request, rendered and tokenized
    processes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Tasks named to train on that the harness cannot run here (a format it does not read, an image it cannot
    # make), with why: the run goes on without them and its report lists them.
    left_out: dict[str, str] = field(default_factory=dict)

    def leave_out(self, task_id: str, reason: str) -> None:
        self.left_out[task_id] = reason
        self.warnings.append(f"tasks: {task_id} left out: {reason}")
        if task_id in self.task_ids:
            self.task_ids.remove(task_id)

    def check(self) -> None:
        """Raise the plan's errors, one line each, so that nothing starts."""
        if self.errors:
            raise ConfigError("\n".join(self.errors))

    def lines(self, run_dir: Path) -> list[str]:
        c = self.config
        out = [f"model      {self.model}; context {c.model.max_model_len:,} tokens, dtype {c.model.dtype}"]
        out.append(f"tasks      {len(self.task_ids)} to train on from {c.tasks.dir}"
                   + (f"; {len(c.tasks.held_out)} held out" if c.tasks.held_out else "")
                   + f": {', '.join(self.task_ids[:6])}{' …' if len(self.task_ids) > 6 else ''}")
        calls = "unbounded" if c.budgets.calls is None else str(c.budgets.calls)
        wall = "the task's own timeout" if c.budgets.wall_s is None else f"{c.budgets.wall_s:g} s"
        prompt = "" if self.first_prompt_tokens is None else f"; first prompt {self.first_prompt_tokens:,} tokens"
        tools = ""
        if c.harness.kind == "claude-code":
            tools = f" (tools: {','.join(c.harness.claude_code_tools) or 'its default set'})"
        out.append(f"harness    {c.harness.kind}{tools} × {c.harness.concurrency} at once, sandbox {c.harness.sandbox}"
                   f"{prompt}")
        out.append(f"budgets    {calls} calls, {wall}, {c.budgets.reply_tokens} tokens per reply per execution")
        s = c.scheduling
        out.append(f"schedule   {s.mode} on {s.cells} cells ({s.device}), {s.steps} steps of {s.queries_per_step} "
                   f"queries × G={s.group_size}, staleness {s.max_staleness}, cap {s.cap_k}")
        warm = ("none" if c.warm_start.steps == 0 and c.warm_start.model is None else f"model {c.warm_start.model}"
                if c.warm_start.model else f"{c.warm_start.steps} SFT steps × {c.warm_start.conversations_per_step} "
                                           f"{c.demo_format()} demonstrations")
        out.append(f"optimise   lr {c.optim.lr:g}, clip [{c.optim.eps_low:g}, {c.optim.eps_high:g}], "
                   f"IS cap {c.optim.is_cap:g}; warm start {warm}")
        out.append(f"outputs    {run_dir}/ (logs/, checkpoints/, report.json, metrics-targets.json)")
        out += [f"left out   {task_id}: {reason}" for task_id, reason in self.left_out.items()]
        out += ["processes"] + [f"  {p}" for p in self.processes]
        if self.sources:
            out += ["overridden"] + [f"  {k} = {flatten(c)[k]!r} ({v})" for k, v in sorted(self.sources.items())]
        out += [f"warning: {w}" for w in self.warnings] + [f"error: {e}" for e in self.errors]
        return out


def learnable_tasks(tasks_dir: Path, families: tuple[str, ...] = LEARNABLE_FAMILIES) -> list[str]:
    """The shipped tasks of the learnable family (tasks/<family>-<n>), interleaved across families
    (count-matches-1, sort-lines-1, sum-numbers-1, uppercase-1, count-matches-2, …) so the scheduler's round-robin
    gives every step a mix of skills."""
    by_family: dict[str, list[str]] = {}
    for name in sorted(p.name for p in tasks_dir.iterdir() if p.name.rsplit("-", 1)[0] in families):
        by_family.setdefault(name.rsplit("-", 1)[0], []).append(name)
    columns = [by_family[f] for f in sorted(by_family)]
    return [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]


def _tasks(plan: RunPlan) -> list[str]:
    """The tasks to train on, each checked to load; the instructions of those that did."""
    from services.harness.tasks import TaskFormatError, load_task

    c = plan.config
    tasks_dir = Path(c.tasks.dir)
    if not tasks_dir.is_dir():
        plan.errors.append(f"tasks.dir: {tasks_dir} is not a folder")
        return []
    plan.task_ids = list(c.tasks.train) or learnable_tasks(tasks_dir)
    if not plan.task_ids:
        plan.errors.append(f"tasks.train: empty, and {tasks_dir} holds none of the shipped family "
                           f"({', '.join(LEARNABLE_FAMILIES)}): name the tasks to train on")
    instructions = []
    for key, ids in (("tasks.train", list(plan.task_ids)), ("tasks.held_out", c.tasks.held_out)):
        for task_id in ids:
            try:
                instructions.append(load_task(tasks_dir / task_id).config.instruction)
            except TaskFormatError as exc:
                if (tasks_dir / task_id).is_dir():  # there, in a form the harness cannot run: the rest go on
                    plan.leave_out(task_id, exc.problem if exc.field is None else f"{exc.field}: {exc.problem}")
                else:  # not there at all: a mistake in the config
                    plan.errors.append(f"{key}: {task_id}: {str(exc).splitlines()[0]}")
            except OSError as exc:
                plan.errors.append(f"{key}: {task_id}: {str(exc).splitlines()[0]}")
    if c.tasks.train and not plan.task_ids:
        plan.errors.append("tasks.train: every task named was left out: nothing to train on")
    return instructions


def _model_dir(plan: RunPlan, scratch: Path) -> Path | None:
    """The model folder to check (a tiny one is created in `scratch`, as the run will create its own)."""
    c = plan.config
    if c.is_tiny():
        from gyre.tinymodel import model_info, tiny_model

        path = tiny_model(scratch / "model", seed=c.seed, size=c.model.path)  # type: ignore[arg-type]
        info = model_info(path)
        plan.model = f"{c.model.path} (created from seed {c.seed}: {info['parameters']:,} parameters)"
        return path
    path = Path(c.model.path)
    if not path.is_dir():
        plan.errors.append(f"model.path: {path} is not a folder (a local Hugging Face model, or tiny/small)")
        return None
    if not (path / "config.json").is_file():
        plan.errors.append(f"model.path: {path} has no config.json: not a Hugging Face model folder")
        return None
    config = json.loads((path / "config.json").read_text())
    plan.model = (f"{path} ({', '.join(config.get('architectures') or ['?'])}, "
                  f"{config.get('dtype') or config.get('torch_dtype') or 'float32'})")
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and c.model.max_model_len > longest:
        plan.errors.append(f"model.max_model_len: {c.model.max_model_len:,} is past what {path} was trained for "
                           f"(max_position_embeddings {longest:,})")
    return path


def _first_request(plan: RunPlan, instruction: str) -> dict[str, Any] | None:
    c = plan.config
    if c.harness.kind == "claude-code":
        from services.harness.claude_code_request import NoRecording, recorded_first_request, recording_for

        try:
            return recorded_first_request(instruction, recording_for(c.harness.claude_code_tools))[1]
        except NoRecording as exc:
            plan.errors.append(f"harness.claude_code_tools: {exc}")
            return None
    from services.harness.agent_core import AgentConfig, first_request

    return first_request(AgentConfig(model=c.model.served_name, max_tokens=c.budgets.reply_tokens), instruction)


def _chat_template(plan: RunPlan, model_dir: Path, instructions: list[str]) -> None:
    """The model's chat template renders tools and extends a conversation without rewriting it (token-in/
    token-out needs both), and the harness's first prompt fits the context."""
    from services.rollout.anthropic_api import parse_request
    from services.rollout.codec import TokenizerCodec
    from services.rollout.conversation import ChatMessage, Conversation
    from shared.tool_formats import ToolFormatError

    name = plan.config.model.path
    given = plan.config.model.tool_call_format
    try:  # the tool-call format is read off the template below, after the template's other checks
        codec = TokenizerCodec.from_model_dir(model_dir, tool_format="hermes" if given == "auto" else given)
    except Exception as exc:  # whatever transformers raises for a folder it cannot read
        plan.errors.append(f"model.path: {name}: its tokenizer does not load: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}")
        return
    body = _first_request(plan, max(instructions, key=len, default="Solve the task."))
    if body is None:
        return
    request = parse_request(body)
    try:
        prompt = codec.render(request.conversation, add_generation_prompt=True)
    except Exception as exc:  # a Jinja error: the template has no way to show tools
        plan.errors.append(f"model.path: {name}: its chat template cannot render tools: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}")
        return
    bare = Conversation(messages=request.conversation.messages)
    if request.conversation.tools and codec.render(bare, add_generation_prompt=True) == prompt:
        plan.errors.append(f"model.path: {name}: its chat template drops the tools (the prompt is the same without "
                           f"them), so the model cannot see what it may call")
    first = Conversation(messages=request.conversation.messages, tools=request.conversation.tools)
    longer = Conversation(messages=(*first.messages, ChatMessage(role="assistant", content="ok"),
                                    ChatMessage(role="user", content="go on")), tools=first.tools)
    shorter_text = codec.render(first, add_generation_prompt=False)
    if not codec.render(longer, add_generation_prompt=False).startswith(shorter_text):
        plan.errors.append(f"model.path: {name}: its chat template is not incremental (a longer conversation "
                           f"does not start with the shorter one's text), so token-in/token-out cannot extend "
                           f"prompts")
    try:
        fmt = codec.detect_tool_format() if given == "auto" else codec.tool_format
        plan.model += f"; tool calls written as {fmt.name}"
    except ToolFormatError as exc:
        plan.errors.append(f"model.path: {name}: {exc}; set model.tool_call_format to the format its replies use")
    except Exception as exc:  # a Jinja error on an assistant turn that calls a tool
        plan.errors.append(f"model.path: {name}: its chat template cannot render a tool call: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}")
    plan.first_prompt_tokens = len(codec.encode(prompt))
    c = plan.config
    need = plan.first_prompt_tokens + c.budgets.reply_tokens
    if need > c.model.max_model_len:
        plan.warnings.append(
            f"model.max_model_len {c.model.max_model_len:,} is too small for the {c.harness.kind} harness's first "
            f"prompt ({plan.first_prompt_tokens:,} tokens + {c.budgets.reply_tokens} to reply): every call would be "
            f"refused; set it to at least {need:,}")


def _harness(plan: RunPlan) -> None:
    c = plan.config.harness
    if c.kind == "claude-code":
        from services.harness.claude_code_request import installed_version

        found = installed_version(Path(c.claude_code_dir))
        if found is None:
            plan.errors.append(f"harness.claude_code_dir: no Claude Code under {c.claude_code_dir} "
                               f"(install it with `make claude-code`)")
        elif c.claude_code_version and found != c.claude_code_version:
            plan.errors.append(f"harness.claude_code_version: {c.claude_code_version} pinned, "
                               f"{found} installed under {c.claude_code_dir}")
    if c.sandbox == "docker":
        _docker(plan)
        return
    from services.harness.sandboxes import available_backends

    found_backends = available_backends()
    if c.sandbox != "auto" and c.sandbox not in found_backends:
        plan.errors.append(f"harness.sandbox: {c.sandbox} does not work here (working: "
                           f"{', '.join(found_backends) or 'none'})")
    elif not found_backends:
        plan.warnings.append("no sandbox backend works here (bwrap and unshare need root): every execution "
                             "will fail")


def _docker(plan: RunPlan) -> None:
    """The engine answers and every task's image can be made here (built at its first execution, then cached)."""
    from services.harness.docker_sandbox import docker_engine_available
    from services.harness.task_images import BaseImageMap, check_environment
    from services.harness.tasks import TaskFormatError, load_task

    if not docker_engine_available():
        plan.errors.append("harness.sandbox: docker: no Docker engine answers here (deploy/docker-engine.sh "
                           "installs and starts one, as root)")
        return
    base = BaseImageMap.parse(plan.config.harness.base_images)
    tasks_dir = Path(plan.config.tasks.dir)
    for task_id in [*plan.task_ids, *plan.config.tasks.held_out]:
        try:
            task = load_task(tasks_dir / task_id)
        except (TaskFormatError, OSError):
            continue  # named by the task check
        problems = check_environment(task, base)
        if problems:
            plan.leave_out(task_id, "; ".join(problems))
    if not plan.task_ids:
        plan.errors.append("tasks: no task's image can be made here: nothing to train on")


def _cells(plan: RunPlan) -> None:
    s = plan.config.scheduling
    if s.device == "cpu":
        if s.accelerators_per_cell > 1:
            plan.warnings.append(f"scheduling.accelerators_per_cell {s.accelerators_per_cell} means nothing on cpu")
        cores = os.cpu_count() or 1
        if s.cells > cores:
            plan.warnings.append(f"scheduling.cells {s.cells} on {cores} CPU cores: the cells will share cores")
    elif s.device.startswith("cuda"):
        try:
            import torch

            visible = torch.cuda.device_count()
        except ImportError:
            visible = 0
        wanted = s.cells * s.accelerators_per_cell
        if wanted > visible:
            plan.warnings.append(f"scheduling: {s.cells} cells × {s.accelerators_per_cell} GPUs want {wanted}, "
                                 f"{visible} visible: the last cells get no device")
    if s.pin_cells:
        if s.device != "cpu":
            plan.warnings.append("scheduling.pin_cells: only cpu cells are pinned to cores; a GPU cell has its own")
        elif s.cells * s.accelerators_per_cell > len(os.sched_getaffinity(0)):
            plan.warnings.append(f"scheduling.pin_cells: {s.cells} cells × {s.accelerators_per_cell} cores want "
                                 f"{s.cells * s.accelerators_per_cell}, this machine has "
                                 f"{len(os.sched_getaffinity(0))}: nothing is pinned")
    if s.mode == "async" and s.cells < 2:
        plan.errors.append("scheduling.cells: async needs one cell to roll out and one to train")
    gateways = ["gateway"] if s.gateways == 1 else [
        f"gateway {i} of {s.gateways} (each execution sticks to one)" for i in range(s.gateways)]
    base = ["relay", "trajectory", "trainer (coordinator, holds no model)", *gateways, "harness", "scheduler"]
    plan.processes = base + ["cells (agent)"]
    for i in range(s.cells):
        devices = ",".join(str(d) for d in range(i * s.accelerators_per_cell, (i + 1) * s.accelerators_per_cell))
        pinned = s.pin_cells and s.cells * s.accelerators_per_cell <= len(os.sched_getaffinity(0))
        where = f"{s.device}:{devices}" if s.device != "cpu" else (f"cpu cores {devices}" if pinned else "cpu")
        plan.processes.append(
            f"cell {i} ({where}): rollout worker and trainer rank, one standing by (warm switch)" if s.warm_cells
            else f"cell {i} ({where}): its role's process, a rollout worker or a trainer rank "
                 f"({'async never switches a cell' if s.mode == 'async' and s.warm is None else 'switch by restart'})")


def plan_run(config: RunConfig, sources: dict[str, str] | None = None) -> RunPlan:
    """Check `config` against this machine and say what the run will start (no process is started)."""
    plan = RunPlan(config=config, sources=dict(sources or {}))
    instructions = _tasks(plan)
    _harness(plan)
    _cells(plan)
    if config.warm_start.steps > 0 and config.warm_start.model is None and config.demo_format() != config.harness.kind:
        plan.warnings.append(f"warm_start.format: the demonstrations are in the {config.demo_format()} format, the "
                             f"run's harness is {config.harness.kind}")
    if "project" in config.warm_start.families and config.demo_format() == "claude-code":
        plan.errors.append("warm_start.families: the project family is demonstrated in the builtin agent's format "
                           "only (its demonstrations delegate and compact as the builtin agent does)")
    if config.warm_start.model is not None and not (Path(config.warm_start.model) / "config.json").is_file():
        plan.errors.append(f"warm_start.model: {config.warm_start.model} is not a model folder (no config.json)")
    with tempfile.TemporaryDirectory(prefix="gyre-plan-") as scratch:
        model_dir = _model_dir(plan, Path(scratch))
        if model_dir is not None:
            _chat_template(plan, model_dir, instructions)
    return plan


__all__ = ["LEARNABLE_FAMILIES", "RunPlan", "learnable_tasks", "plan_run"]
