"""Claude Code in the loop on the real engine: `gyre run --config configs/claude-code-all-tools.yaml` (Claude
Code with its default 24 tools) for one step of two executions of a shipped task. Each execution runs the pinned
Claude Code CLI in its sandbox against the gateway, served by a vLLM CPU worker; its calls (Claude Code's own
~30,000-token requests) are recorded, its tree is built, the step trains, and `gyre replay --verify` rebuilds the
batch from the log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Infra
from tests.harness.test_external_harness import claude_code_dir

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")


@pytest.mark.skipif(claude_code_dir() is None, reason=(
    "Claude Code is not installed: `make test` fetches the pinned CLI from the npm registry (make claude-code), "
    "which did not provide it on this machine"))
async def test_one_step_of_claude_code_on_the_real_engine_trains_and_replays(store, bus, infra: Infra,
                                                                              tmp_path: Path):
    install = claude_code_dir()
    assert install is not None
    runs = tmp_path / "runs"
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "COLUMNS": "200"}
    sets = {"logging.runs_dir": runs, "harness.claude_code_dir": install, "scheduling.steps": 1,
            "scheduling.group_size": 2, "tasks.train": "uppercase-1", "warm_start.steps": 0, "budgets.calls": 3}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    config = "configs/claude-code-all-tools.yaml"
    done = subprocess.run([sys.executable, "-m", "gyre.cli", "run", "--config", config, *args], env=env,
                          capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    run_id = run_dir.name

    events = [s.event for s in await store.read_all(run_id=run_id)]
    started = [e.data for e in events if e.type == "execution.started"]
    assert len(started) == 2 and {s.harness for s in started} == {"claude-code"}
    calls = [e.data for e in events if e.type == "call.completed"]
    assert calls and {c.execution_id for c in calls} == {s.execution_id for s in started}
    # Claude Code's own request: its system prompt and 24 tools, ~30,000 tokens, every reply within the budget.
    assert min(c.prompt_tokens for c in calls) > 20_000
    assert max(c.completion_tokens for c in calls) <= 256
    # The gateway's call budget is what ends an execution that keeps calling: the only refusal allowed.
    refused = [e.data for e in events if e.type == "call.refused"]
    assert all(r.budget_spent and not r.infra for r in refused), refused
    (batch,) = [e.data for e in events if e.type == "batch.ready"]
    assert batch.executions == 2 and batch.target_tokens > 0
    assert [e.data.step for e in events if e.type == "step.completed"] == [0]
    assert "claude-code" in (run_dir / "config.yaml").read_text()
    replay = subprocess.run([sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and " NO " not in replay.stdout, replay.stdout[-3000:] + replay.stderr[-2000:]
