"""The frontend's Prometheus metrics, and how an RPC's final status code is told.

    pagedserve:grpc_requests{method, code}   counter: finished RPCs by gRPC status code
    pagedserve:active_streams{api}           gauge: generations in flight, by API (grpc, http)
    pagedserve:engine_connected              gauge: 1 while an engine answers heartbeats
    pagedserve:num_requests_running/_waiting gauges: the engine's, as its latest step reported
    pagedserve:kv_cache_usage_perc           gauge: the engine's KV usage, 0..1, likewise

The engine process exports the scheduler, cache and latency metrics (engine/metrics.py); the
last three are repeated here from the stats that come with every engine step, so one scrape
of the frontend (e.g. the HTTP API's /metrics) shows the whole server.
"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.grpc_requests = Counter("pagedserve:grpc_requests", "Finished RPCs by method and status code",
                                     ("method", "code"), registry=registry)
        self.active_streams = Gauge("pagedserve:active_streams", "Generations in flight, by API",
                                    ("api",), registry=registry)
        self.engine_connected = Gauge("pagedserve:engine_connected",
                                      "1 while an engine answers heartbeats, else 0", registry=registry)

    def watch_engine(self, client, registry: CollectorRegistry = REGISTRY) -> None:
        """Export the engine's live figures from `client.stats` at each scrape."""
        registry.register(_EngineStatsCollector(client))


class _EngineStatsCollector:
    def __init__(self, client) -> None:
        self.client = client

    def collect(self):
        stats, welcome = self.client.stats, self.client.welcome
        model = welcome.model_name if welcome is not None else ""
        total = stats.kv_blocks_total or (welcome.kv_blocks_total if welcome is not None else 0)
        used = 1 - stats.kv_blocks_free / total if stats.kv_blocks_total else 0.0
        for name, doc, value in (("num_requests_running", "Requests running on the engine", stats.num_running),
                                 ("num_requests_waiting", "Requests waiting to run", stats.num_waiting),
                                 ("kv_cache_usage_perc", "KV-cache usage, 0 to 1", used)):
            family = GaugeMetricFamily(f"pagedserve:{name}", doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family


def outcome_code(context, error: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ended with, given the exception that ended it (None: it returned)."""
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        return (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
                else grpc.StatusCode.CANCELLED)
    code = context.code()
    if code is not None:  # set by context.abort() or set_code()
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code)
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
