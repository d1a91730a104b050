"""The gateway's Prometheus metrics (`GET /metrics`): calls answered and refused (by API, kind and status),
the time a call spends in the gateway, tokens in and out, live executions and workers. One registry per gateway
(a process may hold several in tests); names and labels follow Prometheus conventions (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds a call spends in the gateway (generation included): from a stand-in engine's milliseconds to a long
# generation's minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter("gyre_gateway_calls", "Model calls answered with a completion.", ["api"], registry=r)
        self.refusals = Counter("gyre_gateway_refusals", "Model calls refused, by API error kind and HTTP status.",
                                ["api", "kind", "status"], registry=r)
        self.latency = Histogram("gyre_gateway_call_seconds", "Seconds an answered call spent in the gateway, "
                                 "generation included.", ["api"], buckets=LATENCY_BUCKETS, registry=r)
        self.replayed = Counter("gyre_gateway_replayed_calls",
                                "Calls of resumed executions answered from the log (no generation), by API.", ["api"],
                                registry=r)
        self.prompt_tokens = Counter("gyre_gateway_prompt_tokens", "Prompt tokens of answered calls.", registry=r)
        self.cached_tokens = Counter("gyre_gateway_cached_prompt_tokens",
                                     "Prompt tokens the engine served from its prefix cache or moved KV.", registry=r)
        self.completion_tokens = Counter("gyre_gateway_completion_tokens", "Tokens generated for answered calls.",
                                         registry=r)
        self.live_executions = Gauge("gyre_gateway_live_executions",
                                     "Executions the gateway holds state for (taken up, not ended).", registry=r)
        self.live_workers = Gauge("gyre_gateway_live_workers", "Rollout workers whose heartbeat is current.",
                                  registry=r)

    def watch(self, *, executions: Callable[[], int], workers: Callable[[], int]) -> None:
        """Read the live counts when scraped (nothing to keep up to date)."""
        self.live_executions.set_function(executions)
        self.live_workers.set_function(workers)

    def answered(self, api: str, *, seconds: float, prompt: int, cached: int, completion: int) -> None:
        self.calls.labels(api=api).inc()
        self.latency.labels(api=api).observe(seconds)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(completion)

    def refused(self, api: str, *, kind: str, status: int) -> None:
        self.refusals.labels(api=api, kind=kind, status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["LATENCY_BUCKETS", "GatewayMetrics"]
