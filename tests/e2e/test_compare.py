"""A short `gyre compare`: the same seeded workload under async and elastic, one `gyre run` after the other, each
replayed and verified, then the comparison report (compare.json, its images) with the calibrated simulator's
prediction beside each mode's measured wall-clock; then `gyre eval` scores the async run's start and its last
checkpoint on a task it never trained on. No timing is asserted: only that the modes completed and what the
reports hold."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Infra

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
pytest.importorskip("vllm", reason="the loop needs the vLLM engine (install the cpu or gpu extra)")


async def test_compare_runs_each_mode_and_writes_the_comparison(store, bus, infra: Infra, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url,
           "GYRE_DB_SCHEMA": store.schema, "GYRE_SUBJECT_PREFIX": bus.prefix, "GYRE_ACK_WAIT_S": "5",
           "COLUMNS": "200"}
    sets = [f"--set=logging.runs_dir={runs}", "--set=tasks.train=uppercase-1,sort-lines-1",
            "--set=scheduling.group_size=2", "--set=scheduling.pin_cells=true",
            "--set=scheduling.kv_tokens_per_cell=18432"]  # each engine sized as an accelerator cell's: 2 sessions
    # In a thread: the fixtures' connections live on this event loop, which must go on answering their pings.
    argv = [sys.executable, "-m", "gyre.cli", "compare", "--config", "configs/quick.toml", "--modes", "async,elastic",
            "--steps", "1", *sets]
    result = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=1400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    out = next(p for p in runs.iterdir() if p.name.startswith("compare-") and p.is_dir() and
               (p / "compare.json").is_file())
    report = json.loads((out / "compare.json").read_text())
    assert list(report["modes"]) == ["async", "elastic"]
    for mode, m in report["modes"].items():
        assert m["steps"] == 1 and m["wall_s"] > 0, mode
        assert m["replay_verified"] is True, mode
        assert m["curve"] and m["curve"][0]["executions"] == 2
        assert abs(sum(m["cell_share"].values()) - 1.0) < 1e-3
        assert m["sim_wall_s"] > 0
        assert (runs / m["run_id"] / "report.json").is_file()
    assert report["elastic_vs_async"] > 0
    assert "async" in report["curves"]
    sim = report["simulator"]
    assert sim["calibrated_on"] == "elastic" and set(sim["relative_error"]) == {"async", "elastic"}
    assert sim["fitted"]["train_tokens_per_cell_s"] > 0
    # The engines allocated the KV asked for (whole blocks), said so, and the scheduler and the fit admitted by it.
    assert sim["fitted"]["kv_capacity_tokens"] == 18432
    for image in ("compare_timelines.png", "compare_curves.png", "compare_shares.png"):
        assert (out / image).stat().st_size > 5_000
    assert "elastic vs async" in result.stdout

    # The held-out evaluation of the async run: its start and its last checkpoint, through a worker and a gateway.
    async_run = runs / report["modes"]["async"]["run_id"]
    argv = [sys.executable, "-m", "gyre.cli", "eval", "--run", str(async_run), "--tasks", "uppercase-2",
            "--samples", "2"]
    scored = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=900)
    assert scored.returncode == 0, (scored.stdout + scored.stderr)[-4000:]
    evaluation = json.loads((async_run / "eval.json").read_text())
    assert evaluation["tasks"] == ["uppercase-2"] and evaluation["samples"] == 2
    for label in ("before", "after"):
        assert len(evaluation[label]["scores"]["uppercase-2"]) == 2
        assert 0.0 <= evaluation[label]["pass_at_1"] <= 1.0 and 0.0 <= evaluation[label]["mean_score"] <= 1.0
