"""Every service's Prometheus metrics, served at `/metrics` on its health port (`GYRE_HEALTH_PORT`).

One registry per service, filled from three things the service already knows, so nothing is counted twice or
kept up to date by hand:
- the runtime (`ServiceMetrics`): events handled per consumer and type, redeliveries it had already handled,
  seconds in handlers, events it appended per type, background tasks that failed, dead letters, and whether the
  service is healthy;
- the facts it records (`EventMetrics.observe`, called for each event the service appends): a step's loss in the
  trainer, a batch's dedup in the trajectory service, a cell's switch in the scheduler, an execution's end and
  reward in the harness, a KV move or a weight load in a worker; each under the name the report uses;
- the numbers of its health answer, read when scraped (`gyre_<service>_<key>`: running executions, a worker's
  live sessions, the trainer's world size ...).
docs/metrics.md is the table of every metric, what it means and which to watch.
"""

from __future__ import annotations

import re
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from shared.events import (
    BatchReady,
    CellAssigned,
    CellReady,
    Event,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionResumed,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
    QueryDispatched,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: a handler's milliseconds to a training step's or a cell switch's minutes.
SECONDS_BUCKETS = (0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> str:
    """`gyre_` and the parts joined by `_`, every character a Prometheus name cannot hold made `_`."""
    return "_".join(["gyre", *(_NOT_A_NAME.sub("_", part).strip("_").lower() for part in parts if part)])


class EventMetrics:
    """The facts a service records, as metrics: `observe` each event it appends."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queries = Counter("gyre_queries_dispatched", "Queries the scheduler dispatched.", registry=r)
        self.started = Counter("gyre_executions_started", "Executions started.", registry=r)
        self.ended = Counter("gyre_executions_ended", "Executions ended, by how: finished (the agent stopped) or "
                             "timed_out_<budget>.", ["end"], registry=r)
        self.scored = Counter("gyre_executions_scored", "Executions scored; infra_failure=true ones are not "
                              "trained.", ["infra_failure"], registry=r)
        self.reward = Histogram("gyre_execution_reward", "Rewards of scored executions the infrastructure did not "
                                "end.", buckets=REWARD_BUCKETS, registry=r)
        self.branches = Counter("gyre_execution_branches", "Branches of executions, by kind.", ["kind"], registry=r)
        self.resumed = Counter("gyre_executions_resumed", "Executions a restarted harness resumed.", registry=r)
        self.replayed = Counter("gyre_replayed_calls", "Calls resumed executions replayed from the log.", registry=r)
        self.batches = Counter("gyre_batches", "Training batches built.", registry=r)
        self.unique_tokens = Counter("gyre_batch_unique_tokens", "Tokens trained, each shared prefix once.", registry=r)
        self.flat_tokens = Counter("gyre_batch_flat_tokens", "Tokens the same trajectories hold flat.", registry=r)
        self.dedup = Gauge("gyre_batch_dedup_factor", "The latest batch's flat / unique tokens.", registry=r)
        self.before_cap = Counter("gyre_trajectories_before_cap", "Trajectories of trained executions before the "
                                  "cap.", registry=r)
        self.after_cap = Counter("gyre_trajectories_after_cap", "Trajectories trained (after the cap).", registry=r)
        self.capped = Counter("gyre_capped_executions", "Executions the trajectory cap cut.", registry=r)
        self.stale = Counter("gyre_stale_executions", "Executions left out as beyond the staleness bound.",
                             registry=r)
        self.version_spread = Gauge("gyre_batch_policy_version_spread", "The latest batch's newest minus oldest "
                                    "policy version (its staleness).", registry=r)
        self.steps = Counter("gyre_trainer_steps", "Training steps completed.", registry=r)
        self.step_seconds = Histogram("gyre_trainer_step_seconds", "Seconds a training step took.",
                                      buckets=SECONDS_BUCKETS, registry=r)
        self.world_size = Gauge("gyre_trainer_world_size", "Ranks that trained the latest step.", registry=r)
        self.policy_version = Gauge("gyre_policy_version", "The latest policy version this service recorded.",
                                    registry=r)
        self.step_metric = Gauge("gyre_trainer_step_metric", "The latest step's training metrics, by name (loss, "
                                 "clip_fraction, is_weight_mean, grad_norm, staleness_max, ...).", ["name"],
                                 registry=r)
        self.cells = Gauge("gyre_cells", "Cells by the role the scheduler last gave them.", ["role"], registry=r)
        self.switches = Counter("gyre_cell_switches", "Cell switches completed, warm or by restart.", ["warm"],
                                registry=r)
        self.switch_seconds = Histogram("gyre_cell_switch_seconds", "Seconds from a cell's order to its readiness.",
                                        buckets=SECONDS_BUCKETS, registry=r)
        self.switch_phase = Counter("gyre_cell_switch_phase_seconds", "Seconds cell switches spent in each phase.",
                                    ["phase"], registry=r)
        self.migrations = Counter("gyre_kv_migrations", "Sessions moved between workers, by method and whether "
                                  "the KV move fell back to recompute.", ["method", "fallback"], registry=r)
        self.kv_bytes = Counter("gyre_kv_migrated_bytes", "KV bytes moved between workers.", registry=r)
        self.prefill_avoided = Counter("gyre_kv_prefill_tokens_avoided", "Prompt tokens moved sessions took from "
                                       "their moved KV instead of prefilling them again.", registry=r)
        self.weights_published = Counter("gyre_weights_published", "Weight versions published.", registry=r)
        self.weights_bytes = Counter("gyre_weights_published_bytes", "Bytes of published weights.", registry=r)
        self.weights_loaded = Counter("gyre_weights_loaded", "Weight versions workers loaded.", registry=r)
        self._roles: dict[str, str] = {}

    def observe(self, events: Iterable[Event]) -> None:
        for event in events:
            self._observe(event.data)

    def _observe(self, data: object) -> None:  # noqa: C901 (one case per fact; flat is the readable form)
        match data:
            case QueryDispatched():
                self.queries.inc()
            case ExecutionStarted():
                self.started.inc()
            case ExecutionFinished():
                self.ended.labels(end="finished").inc()
            case ExecutionTimedOut(budget=budget):
                self.ended.labels(end=f"timed_out_{budget}").inc()
            case ExecutionScored(infra_failure=infra, reward=reward):
                self.scored.labels(infra_failure=str(infra is not None).lower()).inc()
                if infra is None:
                    self.reward.observe(reward)
            case ExecutionBranched(kind=kind):
                self.branches.labels(kind=kind).inc()
            case ExecutionResumed(replayed_calls=replayed):
                self.resumed.inc()
                self.replayed.inc(replayed)
            case BatchReady():
                self.batches.inc()
                self.unique_tokens.inc(data.unique_tokens)
                self.flat_tokens.inc(data.flat_tokens)
                if data.unique_tokens:
                    self.dedup.set(data.flat_tokens / data.unique_tokens)
                self.before_cap.inc(data.trajectories_before_cap)
                self.after_cap.inc(data.trajectories_after_cap)
                self.capped.inc(data.capped_executions)
                self.stale.inc(data.stale_executions)
                self.version_spread.set(data.max_policy_version - data.min_policy_version)
            case StepCompleted():
                self.steps.inc()
                self.step_seconds.observe(data.seconds)
                self.world_size.set(data.world_size)
                self.policy_version.set(data.policy_version)
                for name, value in data.metrics.items():
                    self.step_metric.labels(name=name).set(value)
            case CellAssigned(cell_id=cell_id, role=role):
                self._roles[cell_id] = str(getattr(role, "value", role))
                for role_name, count in Tally(self._roles.values()).items():
                    self.cells.labels(role=role_name).set(count)
            case CellReady():
                self.switches.labels(warm=str(bool(data.warm)).lower()).inc()
                self.switch_seconds.observe(data.switch_seconds)
                for phase, seconds in data.phases.items():
                    self.switch_phase.labels(phase=phase).inc(seconds)
            case KvMigrated():
                self.migrations.labels(method=data.method, fallback=str(bool(data.fallback)).lower()).inc()
                self.kv_bytes.inc(data.bytes)
                if data.method == "kv":  # as the scheduler's fold counts it (RunView.prefill_tokens_avoided)
                    self.prefill_avoided.inc(data.tokens)
            case WeightsPublished():
                self.weights_published.inc()
                self.weights_bytes.inc(data.bytes)
                self.policy_version.set(data.version)
            case WeightsLoaded():
                self.weights_loaded.inc()
                self.policy_version.set(data.version)


class HealthNumbers(Collector):
    """The numbers of a service's health answer, as gauges read when scraped: `gyre_<service>_<key>` for each
    number (a bool is 0 or 1, a list its length), nested keys joined by `_`; a mapping of names to words (the
    scheduler's cells to "role/state") becomes one gauge labelled by each word, counting it."""

    def __init__(self, service: str, health: Callable[[], Mapping[str, Any]], *,
                 taken: frozenset[str] = frozenset()) -> None:
        self.service = service
        self.health = health
        self.taken = taken  # names the registry's own metrics hold: a health number never shadows one

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            answer = dict(self.health())
        except Exception:  # a service mid-start has no answer yet: nothing to show, not a failed scrape
            return
        yield from self._families([self.service], answer)

    def _families(self, path: list[str], answer: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
        for key, value in answer.items():
            name = metric_name(*path, str(key))
            if name in self.taken:
                continue
            if isinstance(value, bool | int | float):
                yield GaugeMetricFamily(name, f"{self.service} health: {key}", value=float(value))
            elif isinstance(value, list | tuple):
                yield GaugeMetricFamily(name, f"{self.service} health: how many {key}", value=float(len(value)))
            elif isinstance(value, Mapping) and value and all(isinstance(v, str) for v in value.values()):
                family = GaugeMetricFamily(name, f"{self.service} health: {key} by value", labels=["value"])
                for word, count in sorted(Tally(value.values()).items()):
                    family.add_metric([word], float(count))
                yield family
            elif isinstance(value, Mapping):
                yield from self._families([*path, str(key)], value)


class ServiceMetrics:
    """A service's registry: the runtime's own metrics, the facts it records (`events`), its health numbers, and
    any registry the service keeps besides (the gateway's)."""

    content_type = CONTENT_TYPE

    def __init__(self, service: str, *, health: Callable[[], Mapping[str, Any]],
                 healthy: Callable[[], bool], dead_letters: Callable[[], Mapping[str, int]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.handled = Counter("gyre_events_handled", "Events handled, by consumer and type.", ["consumer", "type"],
                               registry=r)
        self.duplicates = Counter("gyre_events_redelivered_handled", "Redeliveries of events already handled "
                                  "(acked, nothing done again).", ["consumer"], registry=r)
        self.handler_seconds = Histogram("gyre_handler_seconds", "Seconds an event's handler took, effects "
                                         "recorded.", ["consumer"], buckets=SECONDS_BUCKETS, registry=r)
        self.appended = Counter("gyre_events_appended", "Events this service appended to the log, by type.",
                                ["type"], registry=r)
        self.failed_tasks = Gauge("gyre_failed_tasks", "Background tasks that ended with an error (the service is "
                                  "then unhealthy).", registry=r)
        self.up = Gauge("gyre_service_healthy", "1 when the service answers its health check as healthy.",
                        registry=r)
        self.up.set_function(lambda: float(healthy()))
        self.dead_letters = Gauge("gyre_dead_letters", "Events this service's consumers dead-lettered (malformed or "
                                  "out of redeliveries), by consumer.", ["consumer"], registry=r)
        self._dead_letters = dead_letters
        self.pending = Gauge("gyre_consumer_pending", "Events on the bus this service's consumer has not yet been "
                             "delivered, by consumer (its lag).", ["consumer"], registry=r)
        self.ack_pending = Gauge("gyre_consumer_ack_pending", "Events delivered to the consumer and not yet acked "
                                 "(being handled), by consumer.", ["consumer"], registry=r)
        self.events = EventMetrics(r)
        taken = frozenset(family.name for family in r.collect())
        r.register(HealthNumbers(service, health, taken=taken))
        self._also: list[CollectorRegistry] = []

    def also(self, registry: CollectorRegistry) -> None:
        """Serve another registry of the process with this one (the gateway's call metrics)."""
        self._also.append(registry)

    def recorded(self, events: Iterable[Event]) -> None:
        """Events the service appended (committed): counted by type and observed as facts."""
        events = list(events)
        for event in events:
            self.appended.labels(type=event.type).inc()
        self.events.observe(events)

    def exposition(self) -> bytes:
        for consumer, count in self._dead_letters().items():
            self.dead_letters.labels(consumer=consumer).set(count)
        return b"".join(generate_latest(registry) for registry in [self.registry, *self._also])


__all__ = ["CONTENT_TYPE", "EventMetrics", "HealthNumbers", "ServiceMetrics", "metric_name"]
