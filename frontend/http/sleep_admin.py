"""Sleep, wake and weight updates over HTTP (frontend/sleep.py does them on every engine), at
vLLM's paths for the first three and with SGLang's body for the update:

    POST /sleep?level=1|2        free the KV cache (2: and the weights)     200 {"is_sleeping": true, "level": n}
    POST /wake_up                                                           200 {"is_sleeping": false, "level": 0}
    GET  /is_sleeping                                                       200 {"is_sleeping": bool, "level": n}
    POST /update_weights         {"model_path": PATH}                       200 {"is_sleeping": false, "level": 0}

Who may: whoever holds --api-key. AuthAndLog checks the key on these paths as on /v1/* (a
missing or wrong one is a 401 before this code runs); a frontend started without a key refuses
them (403): an open admin route would let any client stop the server or make the engines read
any path they can see. Errors are frontend/sleep.py's, mapped by frontend/http/errors.py.
"""

from __future__ import annotations

from dataclasses import asdict

from fastapi import FastAPI, Request
from pydantic import BaseModel, StrictStr

from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import HTTPError, bad_request
from frontend.sleep import sleep, sleep_state, update_weights, wake_up

ADMIN_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/update_weights"})  # the key guards them


class UpdateWeightsRequest(BaseModel):
    """POST /update_weights (SGLang's /update_weights_from_disk body)."""

    model_path: StrictStr


def add_sleep_admin_routes(app: FastAPI, ctx: HttpContext) -> None:
    @app.post("/sleep")
    async def sleep_route(request: Request):
        _check_allowed(ctx)
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request(f"level: {level!r}; 1 (free the KV cache, keep the weights in host memory) or 2 "
                              "(free both)", "level")
        return asdict(await sleep(ctx.llm.pool, int(level)))

    @app.post("/wake_up")
    async def wake_up_route():
        _check_allowed(ctx)
        return asdict(await wake_up(ctx.llm.pool))

    @app.get("/is_sleeping")
    async def is_sleeping_route():
        _check_allowed(ctx)
        return asdict(sleep_state(ctx.llm.pool))

    @app.post("/update_weights")
    async def update_weights_route(request: Request):
        _check_allowed(ctx)
        body = await parse_body(request, UpdateWeightsRequest)
        return asdict(await update_weights(ctx.llm.pool, body.model_path))


def _check_allowed(ctx: HttpContext) -> None:
    if ctx.api_key is None:
        raise HTTPError(403, "the admin routes (sleep, wake_up, is_sleeping, update_weights) need the server "
                             "started with --api-key, then that key sent", "permission_error")
