"""The long-horizon task family: its build (run for real in bash), its tests' expectations, and its demonstrations
(delegation, compaction, slips) in the chat-template shape the warm start trains on."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from services.harness import projects
from services.harness.agent_core import SUMMARY_PROMPT, restart_messages
from services.harness.demos import write_demos
from services.harness.task_files import write_task
from services.harness.tasks import load_task

TASKS = Path(__file__).resolve().parents[2] / "tasks"


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("task_id", [task_id for task_id, _ in projects.shipped()])
def test_every_shipped_project_builds_red_then_green_with_the_fix_commands(task_id: str, tmp_path: Path) -> None:
    """The build says what the demonstrations say it says; the fix commands make it pass and match the tests'
    expectations; the task states its build time, and the shipped folder is what the generator writes."""
    params = dict(projects.shipped())[task_id]
    task = load_task(TASKS / task_id)
    assert task.config.model_extra is not None and task.config.model_extra["build_seconds"] == params["build_seconds"]
    assert f"about {params['build_seconds']:.0f} s" in task.config.instruction
    # The same project with a quick build, run for real.
    folder = write_task(tmp_path / task_id, projects.project(task_id, params["modules"], 0.01))
    work = tmp_path / "app"
    shutil.copytree(folder / "workspace", work)
    modules = params["modules"]
    red = _bash("bash build.sh", work)
    assert (red.stdout, red.returncode) == projects.build_output(modules, set())
    for m in modules:
        assert _bash(projects.fix_command(m), work).returncode == 0
        assert (work / "src" / f"{m['name']}.txt").read_text().strip() == projects.expected(m)
        one = _bash(f"bash build.sh {m['name']}", work)
        assert (one.stdout, one.returncode) == projects.build_output([m], {m["name"]})
    green = _bash("bash build.sh", work)
    assert (green.stdout, green.returncode) == projects.build_output(modules, {m["name"] for m in modules})


def test_a_slipped_module_fails_its_check(tmp_path: Path) -> None:
    params = projects.sample_params(random.Random(3))
    folder = write_task(tmp_path / "p", projects.project("p", params["modules"], 0.01))
    work = tmp_path / "app"
    shutil.copytree(folder / "workspace", work)
    m = next(m for m in params["modules"] if m["kind"] != "sort" or len(m["lines"]) > 1)
    _bash(projects.slip_command(m), work)
    check = _bash(f"bash build.sh {m['name']}", work)
    assert (check.stdout, check.returncode) == projects.build_output([m], set())


def test_build_times_are_heavy_tailed_and_capped() -> None:
    rng = random.Random(0)
    times = sorted(projects.sample_build_seconds(rng) for _ in range(4000))
    median, p95 = times[len(times) // 2], times[int(len(times) * 0.95)]
    assert 2.5 < median < 3.5
    assert p95 > 4 * median, "a long right tail"
    assert times[-1] <= projects.BUILD_CAP_S


def test_the_demonstrations_delegate_compact_and_restart_from_the_summary() -> None:
    rng = random.Random(1)
    params = {"modules": projects.sample_params(random.Random(5), min_modules=6, max_modules=6)["modules"],
              "build_seconds": 3.0}
    records = projects.demo_records(params, rng, main_system="MAIN", helper_system="HELPER", compact_every=(2, 2))
    mains = [r for r in records if r[0]["content"] == "MAIN"]
    helpers = [r for r in records if r[0]["content"] == "HELPER"]
    assert len(helpers) == 6 and len(mains) == 3, "six delegations, compacted after every two"
    task = projects.instruction(params["modules"], 3.0)
    for piece in mains[:-1]:
        assert piece[-2] == {"role": "user", "content": SUMMARY_PROMPT}
        assert piece[-1]["role"] == "assistant" and "Still to fix" in piece[-1]["content"]
    for before, after in zip(mains, mains[1:]):
        assert after[1]["content"] == restart_messages(task, before[-1]["content"])[0]["content"]
        assert "bash build.sh" in json.dumps(after[2]["tool_calls"]), "a restarted agent runs the build again"
    last = mains[-1][-1]["tool_calls"][0]["function"]
    assert last["name"] == "submit"
    names = [c["function"]["name"] for r in mains for m in r if m["role"] == "assistant" and m.get("tool_calls")
             for c in m["tool_calls"]]
    assert names.count("delegate") == 6
    for helper, module in zip(helpers, params["modules"]):
        assert helper[1]["content"] == projects.helper_task(module)
        assert helper[2]["tool_calls"][0]["function"]["arguments"]["command"] == f"bash build.sh {module['name']}"
        assert helper[4]["tool_calls"][0]["function"]["arguments"]["command"] == projects.fix_command(module)


def test_a_careless_demonstrator_leaves_modules_unbuilt_and_says_so() -> None:
    params = projects.sample_params(random.Random(7), min_modules=5, max_modules=5)
    records = projects.demo_records(params, random.Random(2), main_system="MAIN", helper_system="HELPER",
                                    slip_rate=1.0)
    helpers = [r for r in records if r[0]["content"] == "HELPER"]
    mains = [r for r in records if r[0]["content"] == "MAIN"]
    if not helpers:  # the main agent submitted after the first build
        assert len(mains) == 1 and mains[0][-1]["tool_calls"][0]["function"]["name"] == "submit"
        return
    for helper in helpers:
        assert helper[4]["tool_calls"][0]["function"]["arguments"]["command"].startswith("cp ")
        assert helper[-2]["content"].startswith("[exit code 1]\nFAIL")


def test_write_demos_mixes_the_project_family_in_by_its_share(tmp_path: Path) -> None:
    out = tmp_path / "d.jsonl"
    assert write_demos(out, seed=0, count=60, families=("uppercase", "project")) == 60
    records = [json.loads(line) for line in out.read_text().splitlines()]
    families = [r["demo"]["family"] for r in records]
    assert families.count("project") == 30 and families.count("uppercase") == 30
    shipped = {json.dumps(p, sort_keys=True) for _, p in projects.shipped()}
    assert not any(json.dumps(r["demo"].get("params"), sort_keys=True) in shipped for r in records)
