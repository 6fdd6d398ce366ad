"""Loading and unloading LoRA adapters at run time, on every engine of the pool (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter).

    frontend ── LoadLora{op_id} ──► every answering engine ── LoraResult{op_id, kind} ──► frontend

The engines' answers become one outcome, mapped like every other error:

    every engine OK (or some already had it)   done
    any INVALID (unreadable, rank too large)    InvalidRequest (400); engines that loaded it unload it
    every engine: already loaded                InvalidRequest (400)
    every engine: unknown (unload)              NotFound (404)
    an engine: requests still use it (unload)   InvalidRequest (400): retry when they are done
    LoRA not enabled on the engines             InvalidRequest (400)
    an engine silent for `timeout_s`, or lost   Unavailable (503)
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Collection

from common.errors import InvalidRequest, Unavailable
from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_pool import EnginePool, PooledEngine
from frontend.fan_out import fan_out
from frontend.input_processor import NotFound

log = logging.getLogger("pagedserve.frontend")
LORA_OP_TIMEOUT_S = 120.0  # an engine reads the adapter's weights from disk
_NAME = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")
Kind = ipc.LoraResult.Kind
_UNKNOWN = "the adapter's state there is unknown until its next heartbeat"


async def load_lora(pool: EnginePool, name: str, path: str, base_names: Collection[str],
                    timeout_s: float = LORA_OP_TIMEOUT_S) -> None:
    """Load `name` from `path` (the engines' own path) on every engine, or raise why not."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest("lora_name: 1-128 characters of letters, digits and ._:@/+-")
    if name in base_names:
        raise InvalidRequest(f"lora_name: `{name}` is the base model's name; choose another")
    if not isinstance(path, str) or not path:
        raise InvalidRequest("lora_path: must be a non-empty path to a PEFT adapter folder on the engine")
    engines = _lora_engines(pool)
    results = await fan_out(engines, lambda op: ipc.EngineRequest(
        load_lora=ipc.LoadLora(op_id=op, name=name, path=path)), timeout_s, _UNKNOWN)
    kinds = [r.kind for _, r in results]
    failed = next((r for _, r in results if r.kind in (Kind.KIND_INVALID, Kind.KIND_NOT_FOUND)), None)
    if failed is not None:
        for engine, result in results:  # no engine keeps half of a failed load
            if result.kind == Kind.KIND_OK:
                asyncio.ensure_future(_unload_quietly(engine, name))
        raise _error(failed, f"lora_path: could not load the LoRA adapter `{name}`")
    if all(k == Kind.KIND_CONFLICT for k in kinds):
        raise InvalidRequest(f"lora_name: the LoRA adapter `{name}` has already been loaded")
    pool.runtime_loras[name] = path
    log.info("LoRA adapter %s loaded from %s on %d engines", name, path, len(engines))


async def unload_lora(pool: EnginePool, name: str, timeout_s: float = LORA_OP_TIMEOUT_S) -> None:
    """Unload `name` from every engine that has it, or raise why not."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("lora_name: must be a non-empty string")
    engines = _lora_engines(pool)
    results = await fan_out(engines, lambda op: ipc.EngineRequest(
        unload_lora=ipc.UnloadLora(op_id=op, name=name)), timeout_s, _UNKNOWN)
    pool.runtime_loras.pop(name, None)  # whatever happened, no engine should get it back
    invalid = next((r for _, r in results if r.kind in (Kind.KIND_INVALID, Kind.KIND_CONFLICT)), None)
    if invalid is not None:
        raise _error(invalid, f"lora_name: could not unload the LoRA adapter `{name}`")
    if all(r.kind == Kind.KIND_NOT_FOUND for _, r in results):
        raise NotFound(f"The LoRA adapter `{name}` cannot be found; GET /v1/models lists the adapters loaded here")
    log.info("LoRA adapter %s unloaded from %d engines", name, len(engines))


def _lora_engines(pool: EnginePool) -> list[PooledEngine]:
    """Every answering engine; each must have LoRA enabled (the pool agrees on that)."""
    engines = pool.serving()
    if not engines:
        raise Unavailable("no engine connected; retry shortly")
    if not all(e.client.welcome.lora_enabled for e in engines):
        raise InvalidRequest("LoRA is not enabled on this server: start the engine with --enable-lora "
                             "(and --max-lora-rank at least the adapters' rank)")
    return engines


def _error(result: ipc.LoraResult, default: str) -> InvalidRequest:
    cls = NotFound if result.kind == Kind.KIND_NOT_FOUND else InvalidRequest
    return cls(result.message or default)


async def _unload_quietly(engine: PooledEngine, name: str) -> None:
    try:
        request = ipc.EngineRequest(unload_lora=ipc.UnloadLora(op_id=uuid.uuid4().hex, name=name))
        await asyncio.wait_for(await engine.client.operation(request), LORA_OP_TIMEOUT_S)
    except (Unavailable, asyncio.TimeoutError) as e:
        log.warning("could not undo a partial LoRA load on engine %s: %s", engine.address, e)
