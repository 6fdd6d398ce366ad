"""The HTTP API: OpenAI- and Anthropic-compatible routes, health, tokenization and metrics,
served by uvicorn on the frontend's own event loop beside grpc.aio.

    POST /v1/completions  /v1/chat/completions  /v1/messages (Anthropic)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, POST .../cancel  (frontend/http/responses/)
    /v1/files, /v1/batches: batch jobs                   (frontend/http/files_api.py, batches_api.py)
    GET  /v1/models  /health  /version  /metrics      POST /tokenize  /detokenize
    POST /v1/load_lora_adapter  /v1/unload_lora_adapter   (frontend/http/lora_admin.py)
    POST /sleep  /wake_up  /update_weights, GET /is_sleeping   (frontend/http/sleep_admin.py)
    POST /v1/embeddings  /score  /v1/rerank: pooling models   (frontend/http/pooling_api.py)

`--api-key` guards /v1/* and the sleep admin routes (Bearer, or Anthropic's x-api-key), as vLLM does. A body's `model`
is a served name of the base model or a LoRA adapter's name; /v1/models lists both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import EngineOverloaded, InvalidRequest, Unavailable

from frontend.http.anthropic_api import create_message
from frontend.http.batches_api import add_batch_routes
from frontend.http.context import HttpContext, parse_body
from frontend.http.errors import HTTPError, from_exception, not_found
from frontend.http.lora_admin import add_lora_admin_routes
from frontend.http.openai_api import chat_content, create_chat_completion, create_completion
from frontend.http.pooling_api import add_pooling_routes
from frontend.http.protocol import ChatMessage, DetokenizeRequest, TokenizeRequest
from frontend.http.responses.routes import add_responses_routes
from frontend.http.sleep_admin import ADMIN_PATHS, add_sleep_admin_routes
from frontend.multimodal.parts import load_images

log = logging.getLogger("pagedserve.http")
VERSION = "0.1.0"


def build_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION, docs_url=None, redoc_url=None)

    def anthropic(request: Request) -> bool:
        return request.url.path == "/v1/messages"

    async def on_error(request: Request, e: Exception):
        return from_exception(e).response(anthropic(request))

    # Known errors by class; anything else is a bug: 500 with a generic body (from_exception),
    # and Starlette re-raises it so the trace reaches the server log, never the client.
    for cls in (HTTPError, InvalidRequest, EngineOverloaded, Unavailable, ValidationError, ClientDisconnect,
                Exception):
        app.add_exception_handler(cls, on_error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return not_found(f"no route {request.method} {request.url.path}").response(anthropic(request))
        error = HTTPError(e.status_code, str(e.detail), "invalid_request_error")
        return error.response(anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return HTTPError(400, str(e), "invalid_request_error").response(anthropic(request))

    app.add_middleware(AuthAndLog, api_key=ctx.api_key)
    _add_openai_routes(app, ctx)
    add_lora_admin_routes(app, ctx)
    add_sleep_admin_routes(app, ctx)
    add_batch_routes(app, ctx)
    add_responses_routes(app, ctx)
    add_pooling_routes(app, ctx)
    _add_server_routes(app, ctx)
    return app


class AuthAndLog:
    """The API key check on /v1/* and one log line per request, as plain ASGI. Starlette's
    BaseHTTPMiddleware (`@app.middleware`) would run each route in a task of its own, and turn
    a client that leaves during a non-streaming call into "No response returned" 500s."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, path, status, gone = time.monotonic(), scope["path"], 500, False

        async def receive_watched() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            guarded = path.startswith("/v1/") or path in ADMIN_PATHS
            if self.api_key is not None and guarded and not _authorized(Headers(scope=scope), self.api_key):
                error = HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                  "authentication_error", code="invalid_api_key")
                await error.response(path == "/v1/messages")(scope, receive, send_watched)
            else:
                await self.app(scope, receive_watched, send_watched)
        except asyncio.CancelledError:
            # The route gave up on a client that left (unless_disconnected): no one to answer.
            if not gone or asyncio.current_task().cancelling():
                raise
            status = 499  # nginx's "client closed request"
        finally:
            log.info("method=%s path=%s status=%d ms=%.1f", scope["method"], path, status,
                     (time.monotonic() - start) * 1000)


def _authorized(headers: Headers, key: str) -> bool:
    given = headers.get("authorization", "")
    given = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def _add_openai_routes(app: FastAPI, ctx: HttpContext) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(ctx, request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await create_message(ctx, request)

    @app.get("/v1/models")
    async def models():
        ctx.llm.require_engine()
        welcome = ctx.llm.welcome
        base = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "root": welcome.model_name,
                 "parent": None, "max_model_len": welcome.max_model_len,
                 "quantization": welcome.quantization or None} for name in ctx.model_names()]
        # vLLM's shape for an adapter: its root is its path, its parent the base model.
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "root": a.path,
                     "parent": ctx.served_name, "max_model_len": welcome.max_model_len}
                    for name, a in sorted(ctx.llm.pool.lora_adapters().items())]
        return {"object": "list", "data": base + adapters}


def _add_server_routes(app: FastAPI, ctx: HttpContext) -> None:
    @app.get("/health")
    async def health():
        if ctx.llm.ready:
            return Response(status_code=200)
        why = "draining for shutdown" if ctx.llm.draining else "no engine connected"
        return HTTPError(503, why, "service_unavailable_error").response()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        ctx.resolve_model(body.model)  # an adapter's name is fine: it shares the base model's tokenizer
        processor = ctx.llm.require_engine()
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give one of prompt or messages", "invalid_request_error", "prompt")
        if body.prompt is not None:
            ids = processor.tokenize(body.prompt, body.add_special_tokens, field="prompt")
        else:
            messages = await load_images([_message(m, i) for i, m in enumerate(body.messages)], ctx.media.load,
                                         processor.check_images)
            ids, _ = await processor.chat_prompt_async(messages, add_generation_prompt=body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": processor.limits.max_model_len, "tokens": ids,
                "token_strs": processor.tokenizer.convert_ids_to_tokens(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        ctx.resolve_model(body.model)
        processor = ctx.llm.require_engine()
        ids = processor.check_token_ids(body.tokens, "tokens")
        return {"prompt": processor.tokenizer.decode(ids)}


def _message(m: ChatMessage, i: int) -> dict:
    return {"role": m.role, "content": chat_content(m, i)}


class _Server(uvicorn.Server):
    """uvicorn on the frontend's loop; the frontend owns SIGTERM (its drain), so no handlers here."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def start_http(ctx: HttpContext, host: str, port: int, reuse_port: bool = False
                     ) -> tuple[_Server, asyncio.Task, str]:
    """Serve in the background; returns the server, its task and the bound HOST:PORT.
    `reuse_port`: other frontend processes bind the same port (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    config = uvicorn.Config(build_app(ctx), lifespan="off", access_log=False, log_config=None,
                            timeout_graceful_shutdown=1)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises why it could not start
    bound = sock.getsockname()
    return server, task, f"{host}:{bound[1]}"
