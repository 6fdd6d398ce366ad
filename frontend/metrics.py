"""The frontend's Prometheus metrics, and how an RPC's final status code is told.

    pagedserve:grpc_requests{method, code}   counter: finished RPCs by gRPC status code
    pagedserve:active_streams{api}           gauge: generations in flight, by API (grpc, http)
    pagedserve:engine_connected              gauge: 1 while an engine answers heartbeats

The engine process exports the scheduler, cache and latency metrics (engine/metrics.py).
"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.grpc_requests = Counter("pagedserve:grpc_requests", "Finished RPCs by method and status code",
                                     ("method", "code"), registry=registry)
        self.active_streams = Gauge("pagedserve:active_streams", "Generations in flight, by API",
                                    ("api",), registry=registry)
        self.engine_connected = Gauge("pagedserve:engine_connected",
                                      "1 while an engine answers heartbeats, else 0", registry=registry)


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
