"""One operation sent to every engine of the pool, and all their answers awaited: run-time LoRA
loads (frontend/lora.py) and sleep, wake and weight updates (frontend/sleep.py). Each caller
makes one outcome of the answers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from common.errors import Unavailable
from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_pool import PooledEngine


async def fan_out(engines: list[PooledEngine], make: Callable[[str], ipc.EngineRequest], timeout_s: float,
                  unknown: str) -> list[tuple[PooledEngine, object]]:
    """Send `make(op_id)` to every engine and wait for all their results, in order. An engine
    silent for `timeout_s`: Unavailable, whose message ends with `unknown` (what is then not
    known about it); one lost meanwhile: its EngineLost (an Unavailable)."""
    futures = [await e.client.operation(make(uuid.uuid4().hex)) for e in engines]
    done, pending = await asyncio.wait(futures, timeout=timeout_s)
    for future in pending:
        future.cancel()
    if pending:
        silent = ", ".join(e.address for e, f in zip(engines, futures) if f in pending)
        raise Unavailable(f"no answer from engine {silent} in {timeout_s:.0f}s; {unknown}")
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # EngineLost: Unavailable
    return [(e, f.result()) for e, f in zip(engines, futures)]
