"""Every service's /metrics (shared/metrics.py): the facts it records become metrics, its health numbers gauges,
and the runtime counts what it handled, appended and dead-lettered; served on the health port beside /health."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shared.bus import ConsumerOptions
from shared.effects import Effects
from shared.events import (
    BatchReady,
    BlobRef,
    CellAssigned,
    CellReady,
    Event,
    ExecutionBranched,
    ExecutionScored,
    ExecutionTimedOut,
    KvMigrated,
    StepCompleted,
    new_event,
)
from shared.metrics import EventMetrics, HealthNumbers, metric_name
from shared.runtime import Service
from shared.settings import Settings
from tests.conftest import Infra, unique
from tests.shared.helpers import assigned

NOW = datetime(2026, 12, 5, tzinfo=UTC)


def _event(data) -> Event:  # type: ignore[no-untyped-def]
    return new_event(data, run_id="r", stream_id="s", version=1, occurred_at=NOW)


def test_recorded_facts_become_the_metrics_the_report_names() -> None:
    registry = CollectorRegistry()
    facts = EventMetrics(registry)
    facts.observe(_event(d) for d in [
        ExecutionScored(execution_id="e1", query_id="q", reward=1.0, tests_passed=2, tests_total=2),
        ExecutionScored(execution_id="e2", query_id="q", reward=0.0, tests_passed=0, tests_total=2,
                        infra_failure="APIConnectionError"),
        ExecutionTimedOut(execution_id="e3", budget="wall_clock", elapsed_s=9.0, calls=3),
        ExecutionBranched(execution_id="e1", kind="compaction", at_call_index=4, from_call_index=3, chain_id="main"),
        BatchReady(step=0, query_ids=["q"], executions=2, trees=2, micro_batches=1, unique_tokens=100,
                   flat_tokens=250, target_tokens=40, min_policy_version=3, max_policy_version=4,
                   batch=BlobRef(digest="sha256:" + "0" * 64, size=1),
                   trajectories_before_cap=12, trajectories_after_cap=8, capped_executions=1),
        StepCompleted(step=0, policy_version=5, world_size=2, seconds=12.5, metrics={"loss": 0.25, "clip_fraction": 0.1}),
        CellAssigned(cell_id="c0", role="rollout", policy="elastic"),
        CellAssigned(cell_id="c1", role="rollout", policy="elastic"),
        CellAssigned(cell_id="c1", role="train", policy="elastic"),
        CellReady(cell_id="c1", role="train", switch_seconds=3.5, warm=True, phases={"drain_s": 1.0, "wake_s": 2.0}),
        KvMigrated(execution_id="e1", from_cell="c0", to_cell="c1", tokens=10, bytes=4096, seconds=0.1,
                   method="kv"),
    ])
    value = registry.get_sample_value
    assert value("gyre_executions_scored_total", {"infra_failure": "false"}) == 1
    assert value("gyre_executions_scored_total", {"infra_failure": "true"}) == 1
    assert value("gyre_execution_reward_count") == 1 and value("gyre_execution_reward_sum") == 1.0
    assert value("gyre_executions_ended_total", {"end": "timed_out_wall_clock"}) == 1
    assert value("gyre_execution_branches_total", {"kind": "compaction"}) == 1
    assert value("gyre_batch_dedup_factor") == 2.5 and value("gyre_batch_policy_version_spread") == 1
    assert value("gyre_trajectories_before_cap_total") == 12 and value("gyre_capped_executions_total") == 1
    assert value("gyre_trainer_step_metric", {"name": "loss"}) == 0.25 and value("gyre_trainer_world_size") == 2
    assert value("gyre_trainer_step_seconds_sum") == 12.5 and value("gyre_policy_version") == 5
    assert value("gyre_cells", {"role": "rollout"}) == 1 and value("gyre_cells", {"role": "train"}) == 1
    assert value("gyre_cell_switches_total", {"warm": "true"}) == 1
    assert value("gyre_cell_switch_phase_seconds_total", {"phase": "wake_s"}) == 2.0
    assert value("gyre_kv_migrations_total", {"method": "kv", "fallback": "false"}) == 1
    assert value("gyre_kv_migrated_bytes_total") == 4096 and value("gyre_kv_prefill_tokens_avoided_total") == 10


def test_health_numbers_become_gauges_named_by_their_path() -> None:
    registry = CollectorRegistry()
    answer = {"running_executions": 3, "done": True, "batches": [0, 1], "mode": "async",
              "cells": {"c0": "rollout/active", "c1": "rollout/active", "c2": "train/starting"},
              "worker": {"sessions": 4, "kv": {"used_tokens": 512}}}
    registry.register(HealthNumbers("rollout-worker", lambda: answer))
    value = registry.get_sample_value
    assert value("gyre_rollout_worker_running_executions") == 3 and value("gyre_rollout_worker_done") == 1
    assert value("gyre_rollout_worker_batches") == 2 and value("gyre_rollout_worker_mode") is None
    assert value("gyre_rollout_worker_cells", {"value": "rollout/active"}) == 2
    assert value("gyre_rollout_worker_worker_kv_used_tokens") == 512
    assert metric_name("trainer", "step-time.s") == "gyre_trainer_step_time_s"
    broken = CollectorRegistry()
    broken.register(HealthNumbers("x", lambda: 1 / 0))  # type: ignore[arg-type,return-value]
    assert list(broken.collect()) == []


class Tagging(Service):
    """Handles `cell.assigned`: appends a `cell.assigned` of its own for each (a fact it records)."""

    name = "tagging"

    async def setup(self) -> None:
        self.on(["cell.assigned"], self.tag, options=ConsumerOptions(ack_wait_s=1.0, max_deliver=3,
                                                                      backoff_s=(0.1,), fetch_timeout_s=0.2))

    async def tag(self, event: Event) -> Effects:
        effects = Effects()
        effects.append([assigned(f"tagged-{event.data.cell_id}", 1, run_id=self.settings.run_id)])
        return effects

    def health(self) -> dict[str, object]:
        return {"tagged": self.processed}


async def _get(port: int, path: str) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    reply = await reader.read()
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


async def test_a_service_serves_what_it_handled_appended_and_dead_lettered_at_metrics(store, bus, infra: Infra) -> None:
    from gyre.local import free_port

    port = free_port()
    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=bus.prefix, run_id=unique("metrics-"), health_port=port)
    service = Tagging(settings)
    await service.start()
    try:
        for i in range(3):
            await bus.publish(assigned(f"c{i}", 1, run_id=settings.run_id))
        await bus.publish_raw(bus.subject("cell.assigned"), b"{not json", msg_id="broken")
        for _ in range(200):
            if service.processed >= 3 and service.bus is not None and service.bus.dead_letters["tagging"]:
                break
            await asyncio.sleep(0.05)
        head, body = await _get(port, "/metrics")
        health_head, health = await _get(port, "/health")
    finally:
        await service.stop()
    assert head.startswith(b"HTTP/1.1 200") and b"text/plain" in head
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert samples[("gyre_events_handled_total", (("consumer", "tagging"), ("type", "cell.assigned")))] == 3
    assert samples[("gyre_events_appended_total", (("type", "cell.assigned"),))] == 3
    assert samples[("gyre_handler_seconds_count", (("consumer", "tagging"),))] == 3
    assert samples[("gyre_cells", (("role", "rollout"),))] == 3  # the facts it recorded
    assert samples[("gyre_dead_letters", (("consumer", "tagging"),))] == 1
    assert samples[("gyre_service_healthy", ())] == 1 and samples[("gyre_failed_tasks", ())] == 0
    assert samples[("gyre_tagging_tagged", ())] == 3 and samples[("gyre_tagging_processed", ())] == 3
    lag = {labels: v for (name, labels), v in samples.items() if name == "gyre_consumer_pending"}
    assert lag and all(dict(labels)["consumer"].startswith("tagging") and v >= 0 for labels, v in lag.items())
    assert health_head.startswith(b"HTTP/1.1 200") and b'"service": "tagging"' in health


def test_a_health_number_never_shadows_a_metric_of_the_same_name() -> None:
    """The trainer's health holds `world_size`, which its recorded steps already show as a gauge: one family."""
    from shared.metrics import ServiceMetrics

    metrics = ServiceMetrics("trainer", health=lambda: {"world_size": 7, "generation": 2}, healthy=lambda: True,
                             dead_letters=dict)
    metrics.recorded([_event(StepCompleted(step=0, policy_version=1, world_size=2, seconds=1.0, metrics={}))])
    families = [f.name for f in text_string_to_metric_families(metrics.exposition().decode())]
    assert families.count("gyre_trainer_world_size") == 1 and "gyre_trainer_generation" in families
    assert metrics.registry.get_sample_value("gyre_trainer_world_size") == 2


def test_the_grafana_dashboard_shows_only_documented_metrics() -> None:
    """deploy/grafana/gyre.json parses, and every metric its queries name is in docs/metrics.md's tables."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "deploy" / "grafana" / "gyre.json").read_text())
    documented = (root / "docs" / "metrics.md").read_text()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs and dashboard["uid"] == "gyre-run"
    named = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bgyre_[a-z0-9_]+", e)}
    assert named and all(f"`{m}`" in documented or f"`{m}_total`" in documented or f", `{m}" in documented
                         for m in named), sorted(m for m in named if m not in documented)


async def test_the_relay_reports_its_position_and_how_far_behind_the_log_it_is(store, bus, infra: Infra) -> None:
    from shared.relay import OutboxRelay

    relay = OutboxRelay(store, bus, dsn=infra.database_url, idle_wait_s=0.1, batch=2)
    await store.append([assigned(f"cell-r{i}", 1) for i in range(5)])
    assert await relay.run_once() == 5  # pages of two, each published then its position saved
    assert relay.position == await store.head_position() and relay.published == 5
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    await store.append([assigned("cell-late", 1)])
    for _ in range(100):
        if relay.published == 6:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # an idle turn after the page: caught up
    stop.set()
    await running
    assert relay.published == 6 and relay.behind == 0 and relay.position == await store.head_position()
