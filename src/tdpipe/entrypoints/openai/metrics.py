"""Prometheus metrics of one server (GET /metrics), vLLM's names under the `tdpipe:` prefix.

Gauges and counters are read from `engine.stats()` when scraped (the engine keeps them; no copy drifts);
latencies are measured here, in the frontend, as tokens arrive: what a client sees (lecture §4.1: TTFT,
TPOT, end-to-end latency). Each app has its own CollectorRegistry, so tests can build many apps.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tdpipe.core.engine_client import EngineClient

log = logging.getLogger("tdpipe.serve")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class _EngineCollector:
    """Reads engine.stats() at scrape time; nothing while the engine is starting or dead (engine_ready says
    which)."""

    def __init__(self, engine: Callable[[], EngineClient | None]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        eng = self.engine()
        ready = GaugeMetricFamily("tdpipe:engine_ready", "1 when the engine answers requests, 0 while it "
                                  "starts or after its core died")
        ok = eng is not None and eng.ready and eng.dead_reason is None
        ready.add_metric([], 1.0 if ok else 0.0)
        yield ready
        if not ok:
            return
        try:
            s = eng.stats()
        except Exception as e:  # noqa: BLE001 - a dying engine must not break the scrape
            log.warning("engine.stats() failed during a /metrics scrape: %s", e)
            return
        gauges = (("tdpipe:num_requests_running", "requests in the running batch", "num_running"),
                  ("tdpipe:num_requests_waiting", "requests waiting to be scheduled", "num_waiting"),
                  ("tdpipe:kv_cache_usage_perc", "fraction of KV cache blocks in use (0..1)", "kv_usage"),
                  ("tdpipe:prefix_cache_hit_rate", "prefix-cache hits / queries since start, in tokens (0..1)",
                   "prefix_cache_hit_rate"))
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(s.get(key, 0)))
            yield g
        counters = (("tdpipe:prompt_tokens", "prompt tokens prefilled", "prompt_tokens"),
                    ("tdpipe:generation_tokens", "tokens generated", "generation_tokens"),
                    ("tdpipe:num_preemptions", "requests preempted (recompute)", "num_preemptions"),
                    ("tdpipe:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                     "prefix_cache_queries"),
                    ("tdpipe:prefix_cache_hits", "prompt tokens found in the prefix cache (not prefilled again)",
                     "prefix_cache_hits"))
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(s.get(key, 0)))
            yield c
        busy = GaugeMetricFamily("tdpipe:stage_busy_ratio", "busy fraction of each pipeline stage over the "
                                 "last few seconds (1 - bubble ratio)", labels=["stage"])
        for k, v in enumerate(s.get("stage_busy") or []):
            busy.add_metric([str(k)], float(v))
        yield busy


class ServerMetrics:
    """The registry of one app: the engine's gauges and counters plus the frontend's latency histograms."""

    def __init__(self, engine: Callable[[], EngineClient | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram("tdpipe:time_to_first_token_seconds", "time from accepting a request to its "
                              "first output token", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("tdpipe:time_per_output_token_seconds", "per request: (last token time - first "
                              "token time) / (output tokens - 1)", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("tdpipe:e2e_request_latency_seconds", "time from accepting a request to its "
                             "last token", buckets=_E2E_BUCKETS, registry=r)
        self.success = Counter("tdpipe:request_success", "requests finished, by finish reason",
                               ["finished_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """One request's latencies, observed when it finishes normally (aborted requests are not counted)."""

    __slots__ = ("metrics", "arrival", "first", "last", "tokens")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last = self.arrival
        self.tokens = 0

    def tokens_seen(self, total: int) -> None:
        """Call with the cumulative output token count each time the request advances."""
        if total > self.tokens:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.arrival)
            self.last = now
            self.tokens = total

    def finished(self, reason: str | None) -> None:
        m = self.metrics
        m.e2e.observe(self.last - self.arrival)
        if self.first is not None and self.tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        m.success.labels(reason or "unknown").inc()
