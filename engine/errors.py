"""The two ways a request can be refused, shared by the engine and every frontend API.

Each protocol maps them once: `InvalidRequest` -> gRPC INVALID_ARGUMENT / HTTP 400,
`EngineOverloaded` -> RESOURCE_EXHAUSTED / 429. Any other exception is a bug, never the
caller's fault: it must not be reported as a bad request.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request can never run as given; the message names the field and what is allowed.
    A ValueError, so `SamplingParams(...)` in user code raises what Python users expect."""


class EngineOverloaded(Exception):
    """The engine's waiting queue is full; the request may be retried later."""


class Unavailable(Exception):
    """No engine can take the request now: none is connected, it was lost, or the server is
    draining for shutdown (gRPC UNAVAILABLE / HTTP 503). Retry later or on another replica."""
