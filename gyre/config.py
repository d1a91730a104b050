"""The run config: one validated file (YAML or TOML) that holds every setting of a `gyre run`, the `GYRE_…`
variables and `--set`/CLI flags as overrides of it, and the environment it gives every process of the run.

Precedence, highest first: CLI flags and `--set section.key=value`, the `GYRE_…` variable a setting maps to,
the config file, the defaults below. A bad value is one `ConfigError` line naming the key and what is wrong.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

TINY_MODELS = ("tiny", "small")  # created locally from the run's seed (gyre/tinymodel.py)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """A run config that cannot be run: the message is one line naming the file, the key and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    # A local Hugging Face causal LM folder (config.json, weights, tokenizer), or `tiny`/`small` for the
    # seeded models Gyre creates itself (nothing is downloaded).
    path: str = "tiny"
    dtype: Dtype = "auto"  # served and published in: auto is the checkpoint's own
    max_model_len: int = Field(default=8192, ge=256)  # the context the workers and the gateway allow
    served_name: str = Field(default="gyre-tiny", min_length=1)  # the model name clients ask the gateway for
    # How the model writes a tool call in its replies (shared/tool_formats.py): auto reads it off the chat template.
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"


class TasksSection(_Section):
    dir: Path = Path("tasks")  # a folder of Terminal-Bench task folders
    train: list[str] = Field(default_factory=list)  # empty: the shipped learnable shell-task family
    held_out: list[str] = Field(default_factory=list)  # never trained on (checked to load and not in `train`)


class HarnessSection(_Section):
    kind: Literal["builtin", "claude-code"] = "builtin"
    # Claude Code: the folder holding node_modules/@anthropic-ai/claude-code (`make claude-code`) and the version
    # the run expects there; a different installed version is an error, not a silent change of agent.
    claude_code_dir: Path = Path(".cache/claude-code")
    claude_code_version: str | None = None
    # The built-in tools Claude Code offers the model (its --tools; empty: its default set of 24, whose
    # definitions make its first request ~30,100 tokens with the tiny model's tokenizer). A set other than the
    # default needs a recording of its requests (`gyre harness record-claude-code --tools ...`).
    claude_code_tools: list[str] = Field(default_factory=list)
    concurrency: int = Field(default=4, ge=1)  # executions the harness runs at once
    sandbox: Literal["auto", "bwrap", "unshare", "docker"] = "auto"
    # Docker: where each task Dockerfile's FROM comes from, `ref=image,...,*=default` (no registry is reachable;
    # empty: everything onto the local gyre-base:bookworm that deploy/docker-engine.sh builds).
    base_images: str = ""

    @field_validator("claude_code_tools")
    @classmethod
    def _claude_code_tools(cls, value: list[str]) -> list[str]:
        from services.harness.claude_code_request import load_recording

        if not value:
            return value
        known = [tool["name"] for tool in load_recording()["request"].get("tools", [])]
        for name in value:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
                raise ValueError(f"{name!r} is not one of Claude Code's tools"
                                 f"{f'; did you mean {near[0]!r}?' if near else ''}")
        return value

    @field_validator("base_images")
    @classmethod
    def _base_images(cls, value: str) -> str:
        from services.harness.task_images import BaseImageMap

        BaseImageMap.parse(value)
        return value


class BudgetsSection(_Section):
    calls: int | None = Field(default=3, ge=1)  # model calls per execution (None: the wall clock alone)
    wall_s: float | None = Field(default=90.0, gt=0)  # per execution, capped by the task's own timeout
    reply_tokens: int = Field(default=64, ge=1)  # per reply: the builtin agent asks for it, the gateway caps any ask
    compact_at_tokens: int = Field(default=6000, ge=1)  # the builtin agent compacts its context past this


class SchedulingSection(_Section):
    mode: Literal["elastic", "async", "colocate", "reprefill"] = "async"
    cells: int = Field(default=2, ge=2)  # on this machine; each runs a rollout worker or a trainer rank
    gateways: int = Field(default=1, ge=1)  # gateway processes; each execution sticks to one (shared.gateways)
    device: str = "cpu"  # cpu, or cuda: cell i gets accelerators [i*k, (i+1)*k)
    accelerators_per_cell: int = Field(default=1, ge=1)  # on cpu, with pin_cells: the cores each cell gets
    pin_cells: bool = False  # on cpu: each cell's processes on cores of their own, where the machine has enough
    # The KV each cell's engine allocates, in tokens, as an accelerator's memory would bound it (the scheduler
    # admits sessions against it); unset: what the memory given to the KV cache holds.
    kv_tokens_per_cell: int | None = Field(default=None, ge=1)
    # A switch wakes the cell's standing-by process instead of restarting it. Unset: by mode, a standby where cells
    # switch (elastic, colocate, reprefill) and none in async, which never moves a cell: there a standby would only
    # hold a second process's memory (on an accelerator, an idle trainer rank's or a sleeping engine's) for nothing.
    warm: bool | None = None
    steps: int = Field(default=30, ge=1)
    group_size: int = Field(default=8, ge=1)  # executions per query (G)
    queries_per_step: int = Field(default=2, ge=1)
    max_staleness: int = Field(default=1, ge=0)  # policy versions a rollout may lag the trainer
    cap_k: int = Field(default=8, ge=1)  # trajectories kept per execution
    task_order: Literal["round_robin", "seeded"] = "round_robin"
    tick_s: float = Field(default=0.5, gt=0)
    # The elastic policy's hysteresis, scaled by default to steps of seconds (the tiny model's).
    elastic_min_dwell_s: float = Field(default=10.0, ge=0)
    elastic_train_horizon_s: float = Field(default=30.0, gt=0)
    elastic_margin: int = Field(default=0, ge=0)

    @property
    def warm_cells(self) -> bool:
        """Whether each cell keeps both roles' processes (`warm`, or the mode's default when unset)."""
        return self.warm if self.warm is not None else self.mode != "async"


class OptimSection(_Section):
    lr: float = Field(default=3e-4, gt=0)
    grad_clip: float = Field(default=1.0, gt=0)
    eps_low: float = Field(default=3e-4, gt=0)  # the sequence-level ratio clip, below and above 1
    eps_high: float = Field(default=4e-4, gt=0)
    is_cap: float = Field(default=2.0, gt=0)  # truncated importance weight for stale rollouts
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Tokens per packed micro-batch; a sequence is never split, so at least the longest one (unset: the context,
    # model.max_model_len).
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    drop_zero_variance: bool = True  # groups whose rewards are all equal carry no advantage


class WarmStartSection(_Section):
    # Supervised warm start on an imperfect demonstrator's demonstrations of the learnable family
    # (services/harness/demos.py); steps 0 skips it. `model` uses an already warm-started model instead.
    steps: int = Field(default=150, ge=0)
    # The demonstrations' format: the harness's own (auto), the builtin agent's, or Claude Code's (built on its
    # recorded requests, rendered as the gateway renders them: gyre/claude_code_demos.py).
    format: Literal["auto", "builtin", "claude-code"] = "auto"
    conversations_per_step: int = Field(default=32, ge=1)
    lr: float = Field(default=2e-3, gt=0)
    slip_rate: float = Field(default=0.7, ge=0, le=1)
    model: Path | None = None
    # The task families demonstrated: empty, the learnable shell family's (gyre/run_plan.py LEARNABLE_FAMILIES);
    # `project` is the long-horizon family (services/harness/projects.py), builtin format only.
    families: list[str] = Field(default_factory=list)

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: list[str]) -> list[str]:
        from services.harness.demos import FAMILIES
        from services.harness.projects import FAMILY

        known = (*FAMILIES, FAMILY)
        unknown = [f for f in value if f not in known]
        if unknown:
            raise ValueError(f"unknown families {unknown}; expected some of {list(known)}")
        return value


class LoggingSection(_Section):
    runs_dir: Path = Path("runs")  # runs/<run_id>/: logs, checkpoints, report
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    timeout_s: float = Field(default=3600.0, gt=0)  # the launcher gives up after this
    # Experiment trackers that get each step's metrics (the report's names) and the run's config: none, or any of
    # wandb and tensorboard (the `trackers` extra installs them; gyre/trackers.py).
    trackers: list[Literal["wandb", "tensorboard"]] = Field(default_factory=list)
    wandb_project: str = "gyre"
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files under the run folder, no network


class RunConfig(_Section):
    seed: int = 0
    model: ModelSection = ModelSection()
    tasks: TasksSection = TasksSection()
    harness: HarnessSection = HarnessSection()
    budgets: BudgetsSection = BudgetsSection()
    scheduling: SchedulingSection = SchedulingSection()
    optim: OptimSection = OptimSection()
    warm_start: WarmStartSection = WarmStartSection()
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        overlap = sorted(set(self.tasks.train) & set(self.tasks.held_out))
        if overlap:
            raise ValueError(f"tasks.held_out: {overlap[0]!r} is also in tasks.train")
        micro = self.optim.micro_batch_tokens
        if micro is not None and micro < self.model.max_model_len:
            raise ValueError(f"optim.micro_batch_tokens: {micro} is below model.max_model_len "
                             f"{self.model.max_model_len}: a sequence that long could not be packed (none is split); "
                             f"raise it or leave it unset")
        if self.budgets.reply_tokens >= self.model.max_model_len:
            raise ValueError(f"budgets.reply_tokens: {self.budgets.reply_tokens} leaves no room for a prompt in "
                             f"model.max_model_len {self.model.max_model_len}")
        if self.scheduling.kv_tokens_per_cell is not None:
            self._check_kv(self.scheduling.kv_tokens_per_cell)
        return self

    def _check_kv(self, kv: int) -> None:
        """A cell's KV holds one whole sequence, and a query starts only when its whole group has room (the
        scheduler's session reserve at its fill, on the mode's rollout cells at their fewest: async's half split,
        every cell otherwise); one that never can would leave the run waiting for ever."""
        from services.scheduler.policies import FILL as fill
        from services.scheduler.policies import SESSION_RESERVE_TOKENS as reserve

        if kv < self.model.max_model_len:
            raise ValueError(f"scheduling.kv_tokens_per_cell: {kv} cannot hold one sequence of model.max_model_len "
                             f"{self.model.max_model_len}")
        s = self.scheduling
        per_cell = int(kv * fill) // reserve
        cells = max(1, s.cells // 2) if s.mode == "async" else s.cells
        if per_cell * cells < s.group_size:
            raise ValueError(f"scheduling.kv_tokens_per_cell: {kv} holds {per_cell} session(s) a cell ({reserve:,} "
                             f"tokens reserved each, at the {fill:.0%} fill), {per_cell * cells} on {s.mode}'s "
                             f"{cells} rollout cell(s): fewer than a query's group_size {s.group_size}, so no query "
                             f"could start")

    def is_tiny(self) -> bool:
        return self.model.path in TINY_MODELS

    def demo_format(self) -> str:
        """The warm start's demonstrations' format (auto: the harness's)."""
        return self.harness.kind if self.warm_start.format == "auto" else self.warm_start.format


# Each setting's `GYRE_…` variables: the process settings it becomes (all of them), the first also being the
# variable that overrides it. Settings with none live only in the launcher (warm start, logging, held-out ids).
VARIABLES: dict[str, tuple[str, ...]] = {
    "seed": ("GYRE_SCHEDULER_SEED",),
    "model.path": ("GYRE_MODEL_DIR",),
    "model.dtype": ("GYRE_ROLLOUT_DTYPE", "GYRE_TRAINER_PUBLISH_DTYPE"),
    "model.max_model_len": ("GYRE_ROLLOUT_MAX_MODEL_LEN",),
    "model.served_name": ("GYRE_ROLLOUT_MODEL_NAME", "GYRE_HARNESS_MODEL_NAME"),
    "model.tool_call_format": ("GYRE_ROLLOUT_TOOL_CALL_FORMAT",),
    "tasks.dir": ("GYRE_HARNESS_TASKS_DIR",),
    "tasks.train": ("GYRE_SCHEDULER_TASK_IDS",),
    "harness.kind": ("GYRE_HARNESS_HARNESS",),
    "harness.claude_code_dir": ("GYRE_HARNESS_CLAUDE_CODE_DIR",),
    "harness.claude_code_tools": ("GYRE_HARNESS_CLAUDE_CODE_TOOLS",),
    "harness.concurrency": ("GYRE_HARNESS_CONCURRENCY",),
    "harness.sandbox": ("GYRE_HARNESS_BACKEND",),
    "harness.base_images": ("GYRE_HARNESS_BASE_IMAGES",),
    "budgets.calls": ("GYRE_HARNESS_CALL_BUDGET",),
    "budgets.wall_s": ("GYRE_HARNESS_WALL_BUDGET_S",),
    "budgets.reply_tokens": ("GYRE_HARNESS_MAX_TOKENS", "GYRE_ROLLOUT_MAX_REPLY_TOKENS"),
    "budgets.compact_at_tokens": ("GYRE_HARNESS_COMPACT_AT_TOKENS",),
    "scheduling.mode": ("GYRE_MODE",),
    "scheduling.cells": ("GYRE_CELL_COUNT", "GYRE_SCHEDULER_MIN_CELLS"),
    "scheduling.device": ("GYRE_CELL_DEVICE",),
    "scheduling.accelerators_per_cell": ("GYRE_CELL_ACCELERATORS",),
    "scheduling.pin_cells": ("GYRE_CELL_PIN_CORES",),
    "scheduling.kv_tokens_per_cell": ("GYRE_ROLLOUT_KV_CAPACITY_TOKENS",),
    "scheduling.warm": ("GYRE_CELL_WARM",),
    "scheduling.steps": ("GYRE_SCHEDULER_TOTAL_STEPS",),
    "scheduling.group_size": ("GYRE_GROUP_SIZE",),
    "scheduling.queries_per_step": ("GYRE_SCHEDULER_QUERIES_PER_STEP",),
    "scheduling.max_staleness": ("GYRE_MAX_STALENESS",),
    "scheduling.cap_k": ("GYRE_CAP_K",),
    "scheduling.task_order": ("GYRE_SCHEDULER_TASK_ORDER",),
    "scheduling.tick_s": ("GYRE_SCHEDULER_TICK_S",),
    "scheduling.elastic_min_dwell_s": ("GYRE_SCHEDULER_ELASTIC_MIN_DWELL_S",),
    "scheduling.elastic_train_horizon_s": ("GYRE_SCHEDULER_ELASTIC_TRAIN_HORIZON_S",),
    "scheduling.elastic_margin": ("GYRE_SCHEDULER_ELASTIC_MARGIN",),
    "optim.lr": ("GYRE_TRAINER_LR",),
    "optim.grad_clip": ("GYRE_TRAINER_GRAD_CLIP",),
    "optim.eps_low": ("GYRE_EPS_LOW",),
    "optim.eps_high": ("GYRE_EPS_HIGH",),
    "optim.is_cap": ("GYRE_IS_CAP",),
    "optim.precision": ("GYRE_TRAINER_PRECISION",),
    "optim.micro_batch_tokens": ("GYRE_MICRO_BATCH_TOKENS",),
    "optim.drop_zero_variance": ("GYRE_DROP_ZERO_VARIANCE",),
    "logging.level": ("GYRE_LOG_LEVEL",),
}
LIST_SETTINGS = frozenset({"tasks.train", "tasks.held_out", "logging.trackers", "warm_start.families",
                           "harness.claude_code_tools"})


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every setting's dotted name, in declaration order."""
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from leaves(kind, f"{prefix}{name}.")
        else:
            yield prefix + name


def read_file(path: Path) -> dict[str, Any]:
    """A config file's mapping (YAML, or TOML by its `.toml` suffix)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text()
    try:
        loaded = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: "
                          f"{str(exc).splitlines()[0]}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(loaded).__name__}")
    return loaded


def parse_value(key: str, text: str) -> Any:
    """A `--set` or `GYRE_…` value as the setting reads it: YAML scalars (3, 0.5, true, null) and, for the task
    lists, comma-separated ids."""
    if key in LIST_SETTINGS:
        text = text.strip()
        return yaml.safe_load(text) if text.startswith("[") else [t.strip() for t in text.split(",") if t.strip()]
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for section in sections:
        node = tree.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(sections)}: expected a section (a mapping), got {type(node).__name__}")
        tree = node
    tree[leaf] = value


def _unknown(key: str) -> ConfigError:
    known = list(leaves(RunConfig)) + [k.split(".")[0] for k in leaves(RunConfig)]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ConfigError(f"{key}: unknown setting{hint}")


def _message(exc: ValidationError, where: str, sources: Mapping[str, str]) -> ConfigError:
    """The first problem pydantic found, as one line naming the key and where its value came from (the file, a
    `GYRE_…` variable or the command line), with the nearest valid key when it is unknown."""
    error = exc.errors()[0]
    key = ".".join(str(p) for p in error["loc"])
    where = sources.get(key, where)
    if error["type"] == "extra_forbidden":
        return ConfigError(f"{where}: {_unknown(key)}")
    given = f" (got {error['input']!r})" if error["type"] not in ("missing",) and not isinstance(
        error.get("input"), dict) else ""
    text = error["msg"].removeprefix("Value error, ")
    return ConfigError(f"{where}: {key + ': ' if key else ''}{text}{given}")


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[RunConfig, dict[str, str]]:
    """The run config from `path` (None: the defaults), the `GYRE_…` variables of `environ` that map to a setting,
    then `overrides` (dotted keys: CLI flags and `--set`); with where each overridden setting came from."""
    tree: dict[str, Any] = read_file(path) if path is not None else {}
    where = str(path) if path is not None else "config"
    sources: dict[str, str] = {}
    environ = os.environ if environ is None else environ
    for key, names in VARIABLES.items():
        if names[0] in environ:
            _put(tree, key, parse_value(key, environ[names[0]]))
            sources[key] = names[0]
    for key, value in (overrides or {}).items():
        if key not in set(leaves(RunConfig)):
            raise ConfigError(f"--set {_unknown(key)}")
        _put(tree, key, parse_value(key, value) if isinstance(value, str) else value)
        sources[key] = "command line"
    try:
        return RunConfig.model_validate(tree), sources
    except ValidationError as exc:
        raise _message(exc, where, sources) from None


def parse_sets(items: list[str]) -> dict[str, str]:
    """`--set section.key=value` options as a mapping of overrides."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value
    return out


def flatten(config: RunConfig) -> dict[str, Any]:
    """Every setting by its dotted name (the form `--dry-run` prints and `--set` takes)."""
    data = config.model_dump(mode="json")
    out: dict[str, Any] = {}
    for key in leaves(RunConfig):
        node: Any = data
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def environment(config: RunConfig, model_dir: Path, task_ids: list[str]) -> dict[str, str]:
    """The `GYRE_…` settings every process of the run reads, from the config (the model folder and the tasks
    resolved by the launcher)."""
    values = flatten(config)
    values["model.path"] = str(model_dir)
    values["tasks.train"] = task_ids
    values["tasks.dir"] = str(Path(config.tasks.dir).resolve())
    values["harness.claude_code_dir"] = str(Path(config.harness.claude_code_dir).resolve())
    values["optim.micro_batch_tokens"] = config.optim.micro_batch_tokens or config.model.max_model_len
    values["scheduling.warm"] = config.scheduling.warm_cells
    env: dict[str, str] = {}
    for key, names in VARIABLES.items():
        value = values[key]
        if value is None:
            continue  # unset: the service's own default (no budget)
        text = ",".join(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) \
            else str(value)
        for name in names:
            env[name] = text
    return env


def dump(config: RunConfig) -> str:
    """The config as YAML, loadable again (the resolved config a run keeps beside its logs)."""
    return str(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


__all__ = ["ConfigError", "RunConfig", "VARIABLES", "dump", "environment", "flatten", "leaves", "load_config",
           "parse_sets"]
