"""Server interceptors: what every RPC goes through before and after its servicer.

    MetricsInterceptor    counts each finished RPC by method and final status code
    DecodeGuard           a request that does not parse gets INVALID_ARGUMENT, not INTERNAL

Both wrap the unary-request handlers (all of ours but reflection's bidi stream).
"""

from __future__ import annotations

import inspect

import grpc

from frontend.metrics import FrontendMetrics, outcome_code


def _wrap(handler, unary, stream):
    """The handler with its behavior passed through `unary` or `stream` (async ones only)."""
    if handler is None or handler.request_streaming:
        return handler
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        return handler._replace(unary_stream=stream(handler.unary_stream))
    return handler


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        method = details.method.rsplit("/", 1)[-1]
        count = self.metrics.grpc_requests

        def unary(behavior):
            async def observed(request, context):
                error = None
                try:
                    return await behavior(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    count.labels(method, outcome_code(context, error).name).inc()
            return observed

        def stream(behavior):
            async def observed(request, context):
                error = None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as e:
                    error = e
                    raise
                finally:
                    count.labels(method, outcome_code(context, error).name).inc()
            return observed

        return _wrap(await continuation(details), unary, stream)


class _Undecodable:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class DecodeGuard(grpc.aio.ServerInterceptor):
    """gRPC answers a request it cannot parse (invalid UTF-8 in a string field, a truncated
    message) with INTERNAL, which reads as our bug; it is the caller's, so INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes):
            try:
                return deserialize(data)
            except Exception as e:  # noqa: BLE001 - DecodeError, or UnicodeDecodeError on some builds
                return _Undecodable(f"{type(e).__name__}: {e}")

        def unary(behavior):
            async def guarded(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(context, request)
                return await behavior(request, context)
            return guarded

        def stream(behavior):
            async def guarded(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(context, request)
                async for response in behavior(request, context):
                    yield response
            return guarded

        return _wrap(handler._replace(request_deserializer=safe_deserialize), unary, stream)


async def _refuse(context, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid protobuf message (string fields must be UTF-8): "
                        f"{request.reason}")
