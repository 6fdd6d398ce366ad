"""The frontend's Prometheus metrics, and how an RPC's final status code is told.

    pagedserve:grpc_requests{method, code}   counter: finished RPCs by gRPC status code
    pagedserve:active_streams{api}           gauge: generations in flight, by API (grpc, http)
    pagedserve:engine_connected              gauge: engines ready (connected, answering, not draining)
    pagedserve:num_requests_running/_waiting gauges: all engines' together, as their latest step reported
    pagedserve:kv_cache_usage_perc           gauge: KV usage of all engines' blocks together, 0..1

Per engine (label `engine`: its address), for data parallel:

    pagedserve:engine_state{engine, state}           gauge: 1 for its state (connecting, ready, draining,
                                                     lost, refused), 0 for the others
    pagedserve:engine_num_requests_running/_waiting  gauges, as it last reported
    pagedserve:engine_kv_cache_usage_perc            gauge, 0..1
    pagedserve:engine_prefix_cache_queries/_hits     counters: its prefix cache, in tokens, as it reports them
    pagedserve:router_requests_routed                counter: requests this frontend sent it
    pagedserve:router_prefix_hits                    counter: of those, sent for a cached prefix (cache_aware)
    pagedserve:router_prefix_hit_tokens              counter: the tokens those prefixes cover
    pagedserve:router_retries{engine, reason}        counter: requests moved off it before their first
                                                     output, because it was lost or overloaded, or
                                                     lacked its LoRA adapter (not_found)

The engine process exports the scheduler, cache and latency metrics (engine/metrics.py); the
engine figures here come from the stats that come with every engine step and heartbeat, so
one scrape of the frontend (e.g. the HTTP API's /metrics) shows the whole server.
"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.grpc_requests = Counter("pagedserve:grpc_requests", "Finished RPCs by method and status code",
                                     ("method", "code"), registry=registry)
        self.active_streams = Gauge("pagedserve:active_streams", "Generations in flight, by API",
                                    ("api",), registry=registry)
        self.engine_connected = Gauge("pagedserve:engine_connected",
                                      "Engines ready (connected, answering heartbeats, not draining)",
                                      registry=registry)

    def watch_pool(self, pool, registry: CollectorRegistry = REGISTRY) -> None:
        """Export the engines' live figures and the routing counters at each scrape."""
        registry.register(_EnginePoolCollector(pool))


class _EnginePoolCollector:
    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        pool = self.pool
        model = pool.welcome.model_name if pool.welcome is not None else ""
        serving = [e.client.stats for e in pool.serving()]
        total = sum(s.kv_blocks_total for s in serving)
        used = 1 - sum(s.kv_blocks_free for s in serving) / total if total else 0.0
        for name, doc, value in (
                ("num_requests_running", "Requests running on the engines", sum(s.num_running for s in serving)),
                ("num_requests_waiting", "Requests waiting to run", sum(s.num_waiting for s in serving)),
                ("kv_cache_usage_perc", "KV-cache usage, 0 to 1", used)):
            family = GaugeMetricFamily(f"pagedserve:{name}", doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        yield from self._per_engine(list(pool.engines.values()))

    @staticmethod
    def _per_engine(engines: list):
        from frontend.engine_pool import EngineState
        state = GaugeMetricFamily("pagedserve:engine_state", "1 for the engine's state, 0 for the others",
                                  labels=["engine", "state"])
        gauges = {name: GaugeMetricFamily(f"pagedserve:engine_{name}", doc, labels=["engine"]) for name, doc in (
            ("num_requests_running", "Requests running on this engine"),
            ("num_requests_waiting", "Requests waiting on this engine"),
            ("kv_cache_usage_perc", "This engine's KV-cache usage, 0 to 1"),
            ("sleep_level", "0 while this engine is awake; asleep, its level (1 or 2: frontend/sleep.py)"))}
        counters = {name: CounterMetricFamily(f"pagedserve:{name}", doc, labels=["engine"]) for name, doc in (
            ("engine_prefix_cache_queries", "Prompt tokens this engine looked up in its prefix cache"),
            ("engine_prefix_cache_hits", "Of those, tokens its prefix cache served"),
            ("router_requests_routed", "Requests this frontend sent to this engine"),
            ("router_prefix_hits", "Requests sent to this engine for a cached prefix"),
            ("router_prefix_hit_tokens", "Tokens of the cached prefixes requests were sent here for"),
            ("kv_offload_hits", "Prompt tokens this engine restored from its prefix cache's second tier"),
            ("kv_offload_saved_bytes", "Bytes of KV blocks this engine saved to the second tier"),
            ("kv_offload_restored_bytes", "Bytes of KV blocks this engine restored from the second tier"),
            ("kv_offload_restore_seconds", "Time this engine spent restoring KV blocks from the second tier"))}
        retries = CounterMetricFamily("pagedserve:router_retries", "Requests moved off this engine before "
                                      "their first output", labels=["engine", "reason"])
        for e in engines:
            address, stats, view = e.address, e.client.stats, e.view()
            for s in EngineState:
                state.add_metric([address, s.value], 1 if e.state is s else 0)
            for name, value in (("num_requests_running", stats.num_running),
                                ("num_requests_waiting", stats.num_waiting), ("kv_cache_usage_perc", view.kv_usage),
                                ("sleep_level", e.client.sleep_level)):
                gauges[name].add_metric([address], value)
            for name, value in (("engine_prefix_cache_queries", stats.prefix_cache_queries),
                                ("engine_prefix_cache_hits", stats.prefix_cache_hits),
                                ("router_requests_routed", e.num_routed), ("router_prefix_hits", e.num_prefix_hits),
                                ("router_prefix_hit_tokens", e.num_prefix_hit_tokens),
                                ("kv_offload_hits", stats.kv_offload_hits),
                                ("kv_offload_saved_bytes", stats.kv_offload_saved_bytes),
                                ("kv_offload_restored_bytes", stats.kv_offload_restored_bytes),
                                ("kv_offload_restore_seconds", stats.kv_offload_restore_seconds)):
                counters[name].add_metric([address], value)
            for reason in ("lost", "overloaded", "not_found"):
                retries.add_metric([address, reason], e.num_retries.get(reason, 0))
        yield state
        yield from gauges.values()
        yield from counters.values()
        yield retries


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
