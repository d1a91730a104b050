"""The gateway load benchmark at a small size: real gateway and worker processes, every answered call recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_gateway_load_benchmark_runs_and_records_every_call(infra, repo_root: Path) -> None:
    env = {**os.environ, "GYRE_NATS_URL": infra.nats_url, "GYRE_DATABASE_URL": infra.database_url}
    out = subprocess.run(
        [sys.executable, "bench/gateway_load.py", "--sessions", "40", "--seconds", "2", "--rate", "20",
         "--long-tokens", "2000", "--concurrency", "8", "--workers", "2"],
        cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gateway_load" and result["sessions"] == 40 and result["errors"] == {}
    assert result["calls_per_s_per_core"] > 0 and result["p99_added_ms"] > 0
    # Every call answered was written to the log before its answer, and nothing else was.
    assert result["recorded_calls"] == result["answered_calls"] > 40
