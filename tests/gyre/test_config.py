"""The run config: the shipped configs load and plan cleanly, bad configs are named key by key, the `GYRE_…`
variables and `--set` override the file, and every setting reaches the service that reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre import config as cfg
from gyre.cli import _mount, app
from gyre.config import ConfigError, RunConfig, load_config
from gyre.run_plan import plan_run

SHIPPED = sorted(Path("configs").glob("*.*"))


def test_configs_are_shipped() -> None:
    assert {p.name for p in SHIPPED} >= {"demo.yaml", "quick.toml", "claude-code.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_plans_without_error(path: Path) -> None:
    config, sources = load_config(path, environ={})
    assert sources == {}
    plan = plan_run(config)
    assert plan.errors == [], plan.errors
    assert plan.task_ids and plan.first_prompt_tokens
    assert plan.first_prompt_tokens + config.budgets.reply_tokens <= config.model.max_model_len, plan.warnings


def test_make_demo_runs_the_demo_config() -> None:
    """The defaults are the demo's, so `gyre run` with no config and `make demo` are the same run (the demo gives up
    sooner)."""
    demo = load_config(Path("configs/demo.yaml"), environ={})[0]
    assert demo.model_copy(update={"logging": RunConfig().logging}) == RunConfig()
    assert 'configs/demo.yaml' in Path("gyre/demo.py").read_text()


BAD = [
    ("scheduling:\n  stepz: 3\n", "scheduling.stepz: unknown setting; did you mean 'scheduling.steps'?"),
    ("schedule:\n  steps: 3\n", "schedule: unknown setting; did you mean 'scheduling'?"),
    ("scheduling:\n  steps: many\n", "scheduling.steps: Input should be a valid integer"),
    ("scheduling:\n  mode: fixed\n",
     "scheduling.mode: Input should be 'elastic', 'async', 'colocate' or 'reprefill' (got 'fixed')"),
    ("scheduling:\n  cells: 1\n", "scheduling.cells: Input should be greater than or equal to 2 (got 1)"),
    ("warm_start:\n  slip_rate: 1.5\n", "warm_start.slip_rate: Input should be less than or equal to 1"),
    ("scheduling: 3\n", "scheduling: Input should be a valid dictionary"),
    ("- a\n- b\n", "expected a mapping of sections, got list"),
    ("scheduling:\n  steps: [\n", "not valid YAML"),
    ("tasks:\n  train: [sum-numbers-1]\n  held_out: [sum-numbers-1]\n",
     "tasks.held_out: 'sum-numbers-1' is also in tasks.train"),
    ("budgets:\n  reply_tokens: 9000\n", "budgets.reply_tokens: 9000 leaves no room for a prompt"),
    ("model:\n  max_model_len: 40960\noptim:\n  micro_batch_tokens: 4096\n",
     "optim.micro_batch_tokens: 4096 is below model.max_model_len 40960"),
    ("scheduling:\n  kv_tokens_per_cell: 4096\n",
     "scheduling.kv_tokens_per_cell: 4096 cannot hold one sequence of model.max_model_len 8192"),
    ("harness:\n  claude_code_tools: [Bsh]\n",
     "harness.claude_code_tools: 'Bsh' is not one of Claude Code's tools; did you mean 'Bash'?"),
    ("scheduling:\n  kv_tokens_per_cell: 16384\n  mode: async\n  group_size: 2\n",
     "scheduling.kv_tokens_per_cell: 16384 holds 1 session(s) a cell (8,192 tokens reserved each, at the 90% fill), "
     "1 on async's 1 rollout cell(s): fewer than a query's group_size 2"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_config_is_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert message in str(caught.value)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)


PLAN_ERRORS = [
    ({"model": {"path": "/nonexistent/model"}}, "model.path: /nonexistent/model is not a folder"),
    ({"tasks": {"dir": "/nonexistent/tasks"}}, "tasks.dir: /nonexistent/tasks is not a folder"),
    ({"tasks": {"train": ["sum-numbers-1", "no-such-task"]}}, "tasks.train: no-such-task:"),
    ({"tasks": {"held_out": ["no-such-task"]}}, "tasks.held_out: no-such-task:"),
    ({"harness": {"kind": "claude-code", "claude_code_dir": "/nonexistent"}},
     "harness.claude_code_dir: no Claude Code under /nonexistent"),
    ({"warm_start": {"model": "/nonexistent/sft"}}, "warm_start.model: /nonexistent/sft is not a model folder"),
    ({"harness": {"kind": "claude-code", "claude_code_tools": ["Bash", "Read"]}},
     "harness.claude_code_tools: no recording of Claude Code's requests with tools Bash,Read (make it with "
     "`gyre harness record-claude-code --tools Bash,Read`)"),
]


@pytest.mark.parametrize(("data", "message"), PLAN_ERRORS, ids=[m.split(":")[0] for _, m in PLAN_ERRORS])
def test_the_plan_names_what_cannot_run(data: dict, message: str) -> None:
    plan = plan_run(RunConfig.model_validate(data))
    assert any(message in e for e in plan.errors), plan.errors
    with pytest.raises(ConfigError, match=message.split(":")[0]):
        plan.check()


def test_a_task_the_harness_cannot_run_is_left_out_with_its_reason_and_the_rest_go_on(tmp_path: Path) -> None:
    import shutil

    from gyre.report import RunReport, summary_lines

    tasks = tmp_path / "tasks"
    shutil.copytree("tasks/sum-numbers-1", tasks / "sum-numbers-1")
    shutil.copytree("tasks/sum-numbers-1", tasks / "swe-style")
    yaml_path = tasks / "swe-style" / "task.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("parser_name: pytest", "") + "parser_name: mlebench\n")
    plan = plan_run(RunConfig.model_validate({"tasks": {"dir": str(tasks), "train": ["sum-numbers-1", "swe-style"]}}))
    assert plan.errors == [] and plan.task_ids == ["sum-numbers-1"]
    assert list(plan.left_out) == ["swe-style"] and "parser_name" in plan.left_out["swe-style"]
    assert "'mlebench'" in plan.left_out["swe-style"]
    assert any(line.startswith("left out   swe-style: parser_name") for line in plan.lines(tmp_path / "run"))
    report = RunReport(run_id="r", tasks_left_out=plan.left_out)
    assert summary_lines(report)[-1].startswith("left out (cannot run here): swe-style: parser_name")
    assert json.loads(report.to_json())["tasks_left_out"] == plan.left_out

    alone = plan_run(RunConfig.model_validate({"tasks": {"dir": str(tasks), "train": ["swe-style"]}}))
    assert alone.errors == ["tasks.train: every task named was left out: nothing to train on"]


def test_variables_and_set_override_the_file_in_that_order(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[scheduling]\nsteps = 5\ngroup_size = 4\n[optim]\nlr = 1e-5\n[tasks]\ntrain = ["a", "b"]\n')
    config, sources = load_config(path, environ={"GYRE_GROUP_SIZE": "6", "GYRE_TRAINER_LR": "2e-5",
                                                 "GYRE_SCHEDULER_TASK_IDS": "c,d"},
                                  overrides={"optim.lr": "3e-5", "scheduling.warm": False})
    assert config.scheduling.steps == 5  # the file
    assert config.scheduling.group_size == 6 and sources["scheduling.group_size"] == "GYRE_GROUP_SIZE"
    assert config.optim.lr == 3e-5 and sources["optim.lr"] == "command line"
    assert config.tasks.train == ["c", "d"]
    assert config.scheduling.warm is False
    tools = load_config(None, environ={"GYRE_HARNESS_CLAUDE_CODE_TOOLS": "Bash, Read"},
                        overrides={"harness.kind": "claude-code"})[0]
    assert tools.harness.claude_code_tools == ["Bash", "Read"]
    assert cfg.environment(tools, Path("m"), ["t"])["GYRE_HARNESS_CLAUDE_CODE_TOOLS"] == "Bash,Read"
    with pytest.raises(ConfigError, match="GYRE_MODE: scheduling.mode"):
        load_config(path, environ={"GYRE_MODE": "fast"})
    assert cfg.parse_sets(["scheduling.steps=3", "tasks.train=a,b"]) == {"scheduling.steps": "3", "tasks.train": "a,b"}
    with pytest.raises(ConfigError, match="expected section.key=value"):
        cfg.parse_sets(["steps"])


def _service_settings() -> dict[str, set[str]]:
    """Every `GYRE_…` variable a service's settings class reads."""
    from services.harness.service import HarnessSettings
    from services.rollout.service import RolloutSettings
    from services.scheduler.cell_settings import CellSettings
    from services.scheduler.service import SchedulerSettings
    from services.trainer.options import RankOptions, TrainerOptions
    from shared.settings import Settings

    names: dict[str, set[str]] = {}
    for klass in (Settings, HarnessSettings, RolloutSettings, SchedulerSettings, CellSettings, TrainerOptions,
                  RankOptions):
        prefix = klass.model_config.get("env_prefix", "")
        for field in klass.model_fields:
            names.setdefault((prefix + field).upper(), set()).add(klass.__name__)
    return names


def test_every_setting_becomes_a_variable_some_service_reads(tmp_path: Path) -> None:
    read = _service_settings()
    read["GYRE_LOG_LEVEL"] = {"configure_logging"}
    for key, names in cfg.VARIABLES.items():
        for name in names:
            assert name in read, f"{key}: {name} is read by no service"
    env = cfg.environment(RunConfig(budgets={"calls": None}), tmp_path / "model", ["t1", "t2"])
    assert env["GYRE_MODEL_DIR"] == str(tmp_path / "model")
    assert env["GYRE_SCHEDULER_TASK_IDS"] == "t1,t2"
    assert env["GYRE_ROLLOUT_DTYPE"] == env["GYRE_TRAINER_PUBLISH_DTYPE"] == "auto"
    assert env["GYRE_CELL_COUNT"] == env["GYRE_SCHEDULER_MIN_CELLS"] == "2"
    # Async never moves a cell: no standby unless asked; the modes that switch keep one (a warm switch).
    assert env["GYRE_CELL_WARM"] == "false"
    for mode, warm, expected in (("elastic", None, "true"), ("colocate", None, "true"), ("async", True, "true"),
                                 ("elastic", False, "false")):
        config = RunConfig(scheduling={"mode": mode, "warm": warm})
        assert cfg.environment(config, tmp_path, ["t"])["GYRE_CELL_WARM"] == expected, (mode, warm)
    assert env["GYRE_MICRO_BATCH_TOKENS"] == "8192"  # unset: the context, so the longest sequence packs
    assert "GYRE_HARNESS_CALL_BUDGET" not in env  # no budget: the service's own default (none)
    from services.harness.service import HarnessSettings

    harness = HarnessSettings(**{k.removeprefix("GYRE_HARNESS_").lower(): v for k, v in env.items()
                                 if k.startswith("GYRE_HARNESS_")})
    assert harness.max_tokens == 64 and harness.wall_budget_s == 90 and harness.concurrency == 4


def test_a_resolved_config_loads_back_as_itself(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"seed": 3, "tasks": {"train": ["a"]}, "scheduling": {"mode": "elastic"}})
    path = tmp_path / "config.yaml"
    path.write_text(cfg.dump(config))
    assert load_config(path, environ={})[0] == config


def _tiny_with_template(tmp_path: Path, template: str) -> Path:
    from gyre.tinymodel import create_tiny_model

    model = create_tiny_model(tmp_path / "model", seed=0, size="tiny")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


def test_a_chat_template_that_cannot_extend_a_prompt_is_named_at_start(tmp_path: Path) -> None:
    """A template that renders only the latest turns (history dropped) breaks token-in/token-out."""
    model = _tiny_with_template(tmp_path, (
        "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    plan = plan_run(RunConfig.model_validate({"model": {"path": str(model)}}))
    assert any("its chat template is not incremental" in e and str(model) in e for e in plan.errors), plan.errors


def test_a_chat_template_without_tools_is_named_at_start(tmp_path: Path) -> None:
    model = _tiny_with_template(tmp_path, (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    plan = plan_run(RunConfig.model_validate({"model": {"path": str(model)}}))
    assert any("its chat template drops the tools" in e for e in plan.errors), plan.errors


def test_claude_codes_first_prompt_is_sized_and_a_short_context_warned() -> None:
    plan = plan_run(RunConfig.model_validate({"harness": {"kind": "claude-code"}, "warm_start": {"steps": 0}}))
    assert plan.first_prompt_tokens is not None and plan.first_prompt_tokens > 20_000
    assert any("model.max_model_len 8,192 is too small for the claude-code harness's first prompt" in w
               for w in plan.warnings), plan.warnings


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    _mount("run")
    result = CliRunner().invoke(app, ["run", "--config", "configs/quick.toml", "--dry-run", "--set",
                                      f"logging.runs_dir={tmp_path}"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for part in ("model      tiny", "cell 1 (cpu)", "first prompt", "logging.runs_dir"):
        assert part in result.output
    assert not any(tmp_path.iterdir())  # no run folder, no process
    bad = CliRunner().invoke(app, ["run", "--dry-run", "--set", "tasks.train=no-such-task"], env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "error: tasks.train: no-such-task" in bad.output


def test_resume_needs_a_run_that_started(tmp_path: Path) -> None:
    _mount("run")
    result = CliRunner().invoke(app, ["run", "--resume", "run-missing", "--set", f"logging.runs_dir={tmp_path}"],
                                env={"COLUMNS": "200", "GYRE_LOG_LEVEL": "INFO"})
    assert result.exit_code == 2
    assert "--resume run-missing: no" in result.output
