"""The driver of test_nodes.py's KV move, run on node a (`python -m tests.deploy.kv_across_nodes CELL_FROM CELL_TO`
in its namespace, with the run's environment): one execution calls through the gateway onto a worker on one node,
the scheduler's order (`kv.migration_ordered`, appended as the scheduler appends it) moves its session to a worker
on another node, and the next call runs there from the moved KV. Prints the move and the calls as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

from shared.events import (
    CallCompleted,
    ExecutionStarted,
    KvMigrated,
    KvMigrationOrdered,
    QueryDispatched,
    WeightsLoaded,
    execution_id_for,
    new_event,
    stream_id_for,
)
from shared.execution_tokens import derive_execution_token
from shared.store import EventStore
from tests.e2e.agent import Agent, until_the_gateway_routes_to


async def main(source: str, target: str) -> dict[str, Any]:
    run_id = os.environ["GYRE_RUN_ID"]
    store = await EventStore.connect(os.environ["GYRE_DATABASE_URL"])

    async def events() -> list[Any]:
        return [s.event for s in await store.read_all(run_id=run_id)]

    async def wait(found: Any, what: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if result := found(await events()):
                return result
            await asyncio.sleep(0.5)
        raise SystemExit(f"timed out waiting for {what}")

    async def append(data: Any, stream: str) -> None:
        event = new_event(data, run_id=run_id, stream_id=stream, version=1, occurred_at=datetime.now(UTC))
        await store.append([event], expected_version="any")

    try:
        await wait(lambda evs: {e.data.cell_id for e in evs if isinstance(e.data, WeightsLoaded)} >= {source, target},
                   "both workers serving", 900)
        url = f"http://127.0.0.1:{os.environ['GYRE_ROLLOUT_PORT']}"
        await until_the_gateway_routes_to(url, {source, target})
        execution_id = execution_id_for("q-kv", 0)
        await append(QueryDispatched(query_id="q-kv", task_id="none", group_size=1, seeds=[7], step=0,
                                     policy_version=0, placements=[source]), "query-q-kv")
        await append(ExecutionStarted(execution_id=execution_id, query_id="q-kv", task_id="none", group_size=1,
                                      sample_index=0, seed=7, call_budget=100, cell_id=source),
                     stream_id_for("execution", execution_id))
        token = derive_execution_token(os.environ["GYRE_ROLLOUT_TOKEN_SECRET"].encode(), execution_id)
        agent = Agent(url, token,
                      os.environ.get("GYRE_ROLLOUT_MODEL_NAME", "gyre-tiny"))
        await agent.call_when_taken_up()
        await append(KvMigrationOrdered(execution_id=execution_id, from_cell=source, to_cell=target,
                                        policy="elastic", reason="test"), stream_id_for("cell", source))
        moved = await wait(lambda evs: next((e.data for e in evs if isinstance(e.data, KvMigrated)
                                             and e.data.execution_id == execution_id), None), "kv.migrated", 300)
        await agent.call()
        calls = sorted((e.data for e in await events() if isinstance(e.data, CallCompleted)
                        and e.data.execution_id == execution_id), key=lambda c: c.call_index)
        return {"migrated": moved.model_dump(mode="json"), "cells": [c.cell_id for c in calls],
                "cache_read": agent.usages[-1].get("cache_read_input_tokens", 0)}
    finally:
        await store.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
