"""Run-time LoRA loading over HTTP, at vLLM's paths and with its bodies:

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": PATH}   200 text/plain on success
    POST /v1/unload_lora_adapter  {"lora_name": NAME}

Who may: with --api-key, whoever holds the key (AuthAndLog checks it on every /v1 route, so a
missing or wrong key is a 401 before this code runs). Without a key, nobody (403) unless the
frontend was started with --allow-runtime-lora (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): an
open admin route would let any client make the engines read any path they can see.
Errors are frontend/lora.py's, mapped by frontend/http/errors.py.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import HTTPError
from frontend.http.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from frontend.lora import load_lora, unload_lora


def add_lora_admin_routes(app: FastAPI, ctx: HttpContext) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _check_allowed(ctx)
        body = await parse_body(request, LoadLoraAdapterRequest)
        await load_lora(ctx.llm.pool, body.lora_name, body.lora_path, ctx.model_names())
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _check_allowed(ctx)
        body = await parse_body(request, UnloadLoraAdapterRequest)
        await unload_lora(ctx.llm.pool, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_allowed(ctx: HttpContext) -> None:
    if ctx.api_key is None and not ctx.allow_runtime_lora:
        raise HTTPError(403, "loading LoRA adapters at run time needs --api-key (then send the key), or "
                             "--allow-runtime-lora on a trusted network", "permission_error")
