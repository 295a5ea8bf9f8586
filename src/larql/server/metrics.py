"""Prometheus metrics of one server (a registry per app, so tests can run several servers).

The latency families follow vLLM's: time to first token (request arrival → first token) and time
per output token (the gap between consecutive tokens of one stream), plus end-to-end latency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from larql.inference.prefix_cache import PrefixCache

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineMemory(Collector):
    """Bytes held right now by the live sessions' engines, by engine name (read at scrape)."""

    def __init__(self, source: Callable[[], Mapping[str, int]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "larql_engine_memory_bytes",
            "Bytes held by the engines of live sessions (state + growth reserve), by engine",
            labels=["engine"],
        )
        for engine, held in sorted(self._source().items()):
            family.add_metric([engine], held)
        yield family


class _PrefixCacheStats(Collector):
    """The prefix cache's counts, read at scrape."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        stats = self._cache.stats()
        counters = (
            ("hits", "Prompts that started from a cached state", stats.hits),
            ("misses", "Prompts that found no cached state to start from", stats.misses),
            (
                "tokens_saved",
                "Prompt tokens not computed: they came from the cache",
                stats.tokens_saved,
            ),
            (
                "evictions",
                "Cached states dropped to stay within the cache's bytes",
                stats.evictions,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"larql_prefix_cache_{name}", doc, value=value)
        gauges = (
            ("bytes", "Bytes of engine state in the prefix cache", stats.bytes),
            (
                "capacity_bytes",
                "The prefix cache's size (--prefix-cache-bytes)",
                self._cache.max_bytes,
            ),
            ("entries", "Engine states in the prefix cache", stats.entries),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"larql_prefix_cache_{name}", doc, value=value)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "larql_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("larql_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.completion_tokens = Counter("larql_completion_tokens", "Tokens generated", registry=r)
        self.sessions = Counter(
            "larql_sessions",
            "Sessions that ended, by outcome (finished, cancelled, timeout, error, shutdown)",
            ["outcome"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "larql_time_to_first_token_seconds",
            "Request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "larql_time_per_output_token_seconds",
            "Gap between consecutive tokens of one stream",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "larql_e2e_request_latency_seconds",
            "Request arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_sessions = Gauge("larql_active_sessions", "Sessions decoding now", registry=r)
        self.queued_sessions = Gauge(
            "larql_queued_sessions", "Sessions waiting for a decode slot", registry=r
        )

    def watch_engine_memory(self, source: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_EngineMemory(source))

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        self.registry.register(_PrefixCacheStats(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)
