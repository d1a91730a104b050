"""What the end-to-end loop tests share: one run's environment on the test's schema and subject prefix."""

from __future__ import annotations

from pathlib import Path

from gyre.launcher import loop_environment
from gyre.local import free_port
from gyre.tinymodel import tiny_model
from tests.conftest import Infra


def loop_test_environment(
    store, bus, infra: Infra, tmp_path: Path, *, run_id: str, steps: int, group_size: int, task_ids: list[str],
    mode: str = "async", cells: int = 2, extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Every process's environment for a short run of the untrained tiny model (async on two cells unless told)."""
    model_dir = tiny_model(tmp_path / "model", seed=0, size="tiny")
    return loop_environment(
        run_id=run_id, nats_url=infra.nats_url, database_url=infra.database_url, model_dir=model_dir,
        run_dir=tmp_path, mode=mode, steps=steps, group_size=group_size, max_staleness=1, seed=0,
        task_ids=task_ids, gateway_port=free_port(), cells=cells,
        extra={
            "GYRE_DB_SCHEMA": store.schema,
            "GYRE_SUBJECT_PREFIX": bus.prefix,
            "GYRE_DROP_ZERO_VARIANCE": "false",  # an untrained model scores 0: train on every batch anyway
            "GYRE_HARNESS_WALL_BUDGET_S": "300",  # the call budget ends executions; this only bounds a stuck one
            "GYRE_HARNESS_CALL_BUDGET": "3",
            "GYRE_HARNESS_MAX_TOKENS": "48",
            "GYRE_ROLLOUT_MAX_MODEL_LEN": "8192",
            "GYRE_ACK_WAIT_S": "5",  # what a killed service held comes back within seconds, not half a minute
            **(extra or {}),
        },
    )
