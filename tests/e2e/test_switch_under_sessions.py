"""A cell switched both ways while live sessions run on it loses none of them: the switch benchmark's driver
(bench/switch.py) on real processes — outbox relay, rollout gateway, a cell agent with two cells (a vLLM CPU
worker and a trainer rank on each) and the trainer coordinator — one warm round: sessions call through the
gateway onto cell 0, cell 0 goes to training while they keep calling (their sessions move to cell 1) and comes
back. Every call the agents made succeeded and is recorded exactly once on its execution's stream; no timing is
asserted (the benchmark reports those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Infra

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
pytest.importorskip("vllm", reason="the switch needs vLLM workers (install the cpu or gpu extra)")

REPO = Path(__file__).resolve().parents[2]


def test_a_cell_switched_both_ways_under_live_sessions_loses_no_session(infra: Infra) -> None:
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url}
    result = subprocess.run(
        [sys.executable, "bench/switch.py", "--rounds", "1", "--sessions", "3", "--history-words", "120",
         "--path", "warm"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    check = out["details"]["checks"]["warm"]
    assert check["sessions"] == 3 and check["calls"] >= 3
    assert out["sessions_lost"] == 0 and check["lost"] == [], check["lost"]
    paths = out["details"]["paths"]["warm"]
    to_train, to_rollout = paths["rollout_to_train"], paths["train_to_rollout"]
    assert to_train["rounds"] == 1 and to_rollout["rounds"] == 1
    assert to_train["warm"] == [True] and to_rollout["warm"] == [True]
    # The sessions on the cell left it when it went to training, by their KV (on by default; over the bus).
    assert to_train["sessions_moved"] == {"kv": 3}, to_train
