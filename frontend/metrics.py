"""The frontend's Prometheus metrics, and how an RPC's final status code is told.

    pagedserve:grpc_requests{method, code}   counter: finished RPCs by gRPC status code
    pagedserve:grpc_active_streams           gauge: Generate streams in flight
    pagedserve:engine_connected              gauge: 1 while an engine answers heartbeats

The engine process exports the scheduler, cache and latency metrics (engine/metrics.py).
"""

from __future__ import annotations

import asyncio
import inspect

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.grpc_requests = Counter("pagedserve:grpc_requests", "Finished RPCs by method and status code",
                                     ("method", "code"), registry=registry)
        self.active_streams = Gauge("pagedserve:grpc_active_streams", "Generate streams in flight",
                                    registry=registry)
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


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every unary-response and server-streaming RPC by method and final code."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return handler._replace(unary_stream=self._stream(method, handler.unary_stream))
        return handler  # reflection's bidi stream: not counted

    def _count(self, method: str, context, error: BaseException | None) -> None:
        self.metrics.grpc_requests.labels(method, outcome_code(context, error).name).inc()

    def _unary(self, method: str, behavior):
        async def observed(request, context):
            error = None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._count(method, context, error)
        return observed

    def _stream(self, method: str, behavior):
        async def observed(request, context):
            error = None
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as e:
                error = e
                raise
            finally:
                self._count(method, context, error)
        return observed
