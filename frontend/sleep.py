"""Sleep, wake and weight updates on every engine of the pool (the engines' side:
engine/sleep_mode.py), for the HTTP admin routes (frontend/http/sleep_admin.py) and the gRPC
Admin service (frontend/admin_servicer.py).

    frontend ── AdminOp{op_id, kind} ──► every answering engine ── AdminResult{op_id, ok, sleep_level} ──► frontend

The engines' answers become one outcome, mapped like every other error:

    every engine ok                              done: the pool's sleep state after it
    an engine refused (bad level, a checkpoint   InvalidRequest (400 / INVALID_ARGUMENT), its message;
      that does not fit, a missing path)           the engines that did it keep it (an update is not undone)
    no engine connected                          Unavailable (503 / UNAVAILABLE)
    an engine silent for `timeout_s`, or lost    Unavailable (default ADMIN_TIMEOUT_S)

While every engine sleeps, new requests get Unavailable (503 with Retry-After, gRPC UNAVAILABLE:
AsyncLLM.require_ready); the requests they were running wait in the engines and finish after
the wake.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.errors import InvalidRequest, Unavailable
from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_pool import EnginePool
from frontend.fan_out import fan_out

log = logging.getLogger("pagedserve.frontend")
# Loading a checkpoint (an update, level 2's wake) reads every weight from disk.
ADMIN_TIMEOUT_S = 600.0
_UNKNOWN = "its sleep state and weights are unknown until it answers (GET /is_sleeping)"


@dataclass(frozen=True)
class SleepState:
    """The pool's: asleep while any engine is; `level` the deepest."""

    is_sleeping: bool
    level: int = 0


async def sleep(pool: EnginePool, level: int, timeout_s: float | None = None) -> SleepState:
    """Put every engine to sleep at `level` (1: KV freed, weights in host memory; 2: both freed)."""
    if level not in (1, 2):
        raise InvalidRequest("level: 1 (free the KV cache, keep the weights in host memory) or 2 (free both)")
    await _run(pool, ipc.AdminOp.KIND_SLEEP, timeout_s, level=level)
    log.info("asleep at level %d", level)
    return sleep_state(pool)


async def wake_up(pool: EnginePool, timeout_s: float | None = None) -> SleepState:
    await _run(pool, ipc.AdminOp.KIND_WAKE_UP, timeout_s)
    log.info("awake")
    return sleep_state(pool)


async def update_weights(pool: EnginePool, model_path: str, timeout_s: float | None = None) -> SleepState:
    """Load the checkpoint at `model_path` (the engines' own path) on every engine."""
    if not isinstance(model_path, str) or not model_path:
        raise InvalidRequest("model_path: must be a non-empty path to a checkpoint on the engine")
    await _run(pool, ipc.AdminOp.KIND_UPDATE_WEIGHTS, timeout_s, model_path=model_path)
    log.info("weights updated from %s", model_path)
    return sleep_state(pool)


def sleep_state(pool: EnginePool) -> SleepState:
    levels = [e.client.sleep_level for e in pool.serving()]
    return SleepState(any(levels), max(levels, default=0))


async def _run(pool: EnginePool, kind: int, timeout_s: float | None, **fields) -> None:
    engines = pool.serving()
    if not engines:
        raise Unavailable("no engine connected; retry shortly")
    results = await fan_out(engines, lambda op: ipc.EngineRequest(admin=ipc.AdminOp(op_id=op, kind=kind, **fields)),
                            ADMIN_TIMEOUT_S if timeout_s is None else timeout_s, _UNKNOWN)
    failed = [(e, r) for e, r in results if not r.ok]
    if failed:
        done = len(results) - len(failed)
        more = f" ({done} of {len(results)} engines did it)" if done else ""
        raise InvalidRequest(failed[0][1].message + more)
