"""The frontend process: a grpc.aio server on uvloop, linked over ZeroMQ to one engine or
several (data parallel: frontend/engine_pool.py).

Health (grpc.health.v1): "" is SERVING while the process is up; the Generation and Embedding
services are SERVING only while at least one engine is ready (connected, answering heartbeats,
not draining), whichever task its model serves (a call for another task gets INVALID_ARGUMENT).

An engine put to sleep (Admin service, POST /sleep) stays SERVING: sleep is an admin's choice, not
a fault (a probe must not restart it); new calls get UNAVAILABLE until it wakes.

Shutdown (SIGTERM or SIGINT) drains: both health statuses turn NOT_SERVING, new streams get
UNAVAILABLE, running ones may finish for up to `drain_timeout_s`; then the server stops.
A second signal cuts the drain short.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.process_args import freeze_startup_heap
from common.v1 import embedding_pb2, embedding_pb2_grpc, generation_pb2, generation_pb2_grpc, info_pb2, info_pb2_grpc
from common.v1 import admin_pb2, admin_pb2_grpc, tokenization_pb2, tokenization_pb2_grpc
from frontend.admin_servicer import AdminService
from frontend.async_llm import AsyncLLM
from frontend.embedding_servicer import EmbeddingService
from frontend.engine_pool import FRONTEND_ID, EnginePool
from frontend.http.options import HttpOptions
from frontend.interceptors import DecodeGuard, MetricsInterceptor
from frontend.metrics import FrontendMetrics
from frontend.router import make_policy
from frontend.servicers import GenerationService, GrpcContext, InfoService, TokenizationService

log = logging.getLogger("pagedserve.frontend")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
EMBEDDING_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["Embedding"].full_name
ENGINE_SERVICES = (GENERATION_SERVICE, EMBEDDING_SERVICE)  # their health follows the engines'
MAX_RECEIVE_BYTES = 32 * 2**20  # as the HTTP API's body limit


@dataclass
class FrontendConfig:
    engine_addresses: list[str]  # fixed engines (ZeroMQ endpoints)
    engine_dns: str | None = None  # HOST:PORT: every address HOST resolves to is an engine
    engine_dns_interval_s: float = 5.0
    routing_policy: str = "cache_aware"
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    tokenizer: str | None = None  # a tokenizer folder; default: the one the engine hands over
    max_concurrent_streams: int = 256
    heartbeat_s: float = 0.5
    engine_timeout_s: float = 3.0
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None  # None: no /metrics
    metrics_host: str = "127.0.0.1"
    log_prompts: bool = False
    http_port: int | None = 8000  # None: no HTTP API
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_key: str | None = None  # guards the HTTP API's /v1 and admin routes, and the gRPC Admin service
    allow_runtime_lora: bool = False  # the admin LoRA routes without an API key
    # Several frontend processes share the gRPC and HTTP ports (`serve --api-server-count`):
    # SO_REUSEPORT, so the kernel spreads new connections over them.
    reuse_port: bool = False
    http_options: HttpOptions = field(default_factory=HttpOptions)


async def serve(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set or a signal comes, then drain and stop."""
    stop, force = stop or asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
    metrics = FrontendMetrics()
    if config.metrics_port is not None:
        from common.metrics_http import serve_metrics
        serve_metrics(config.metrics_host, config.metrics_port)
    # The metrics interceptor is outermost, so it counts what the guard refuses.
    # A chat's images come in the request (ImageData: up to 20 MiB each), past gRPC's 4 MiB default.
    options = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    server = grpc.aio.server(interceptors=[MetricsInterceptor(metrics), DecodeGuard()],
                             options=options + ([("grpc.so_reuseport", 1)] if config.reuse_port else []))
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    address = f"{config.host}:{port}"
    health_servicer = health.aio.HealthServicer()
    llm = _async_llm(config, address, health_servicer, metrics)
    metrics.watch_pool(llm.pool)
    _add_services(server, GrpcContext(llm, metrics, config.log_prompts), health_servicer, config.api_key)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for service in ENGINE_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    print(f"grpc listening on {address}", flush=True)
    http = None
    if config.http_port is not None:
        from frontend.http.app import start_http
        from frontend.http.context import HttpContext
        ctx = HttpContext(llm, metrics, config.served_model_names, config.api_key, config.allow_runtime_lora,
                          config.http_options)
        http = await start_http(ctx, config.host, config.http_port, config.reuse_port)
        llm.http_address = http[2]
        print(f"http listening on {http[2]}", flush=True)
    await llm.pool.start(config.engine_addresses, config.engine_dns, config.engine_dns_interval_s)
    try:
        await stop.wait()
        await _drain(llm, health_servicer, config.drain_timeout_s, force)
    finally:
        log.info("frontend stopping")
        if http is not None:
            http[0].should_exit = True
            await http[1]
        await server.stop(grace=1.0)
        await llm.pool.close()


async def _drain(llm: AsyncLLM, health_servicer, timeout_s: float, force: asyncio.Event) -> None:
    llm.draining = True
    for service in ("", *ENGINE_SERVICES):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: %d requests running, waiting up to %.0fs", llm.num_running, timeout_s)
    deadline = time.monotonic() + timeout_s
    # Admitted HTTP requests whose response has not started their generation yet count too.
    while llm.num_running and time.monotonic() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    if llm.num_running:
        log.warning("drain ended with %d requests still running; they are cancelled", llm.num_running)


def _async_llm(config: FrontendConfig, address: str, health_servicer, metrics: FrontendMetrics) -> AsyncLLM:
    llm = AsyncLLM(None, config.max_concurrent_streams, config.tokenizer, config.http_options.harmony,
                   config.http_options.max_images)
    announced, serving = False, None

    def on_welcome(welcome) -> None:
        try:
            llm.on_welcome(welcome)
        except Exception:  # noqa: BLE001 - stay NOT_SERVING, say why, keep the process up
            log.exception("could not load the tokenizer; not serving")

    def on_change() -> None:
        nonlocal announced, serving
        ready = llm.pool.num_ready > 0 and llm.input is not None
        if ready and not announced:
            announced = True
            freeze_startup_heap()  # imports, servers, tokenizer: out of the collector's way from now on
            http = f", http http://{llm.http_address}/v1" if llm.http_address else ""
            print(f"pagedserve ready: model {llm.welcome.model_name}, grpc {address}{http}", flush=True)
        metrics.engine_connected.set(llm.pool.num_ready)
        if llm.draining or ready == serving:
            return  # draining stays NOT_SERVING
        serving = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ENGINE_SERVICES:
            asyncio.ensure_future(health_servicer.set(service, status))

    llm.pool = EnginePool(make_policy(config.routing_policy), FRONTEND_ID, address, config.heartbeat_s,
                          config.engine_timeout_s, on_change, on_welcome)
    return llm


def _add_services(server, ctx: GrpcContext, health_servicer, api_key: str | None) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(ctx), server)
    tokenization_pb2_grpc.add_TokenizationServicer_to_server(TokenizationService(ctx), server)
    info_pb2_grpc.add_InfoServicer_to_server(InfoService(ctx), server)
    embedding_pb2_grpc.add_EmbeddingServicer_to_server(EmbeddingService(ctx), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(ctx.llm, api_key), server)
    names = [
        GENERATION_SERVICE,
        tokenization_pb2.DESCRIPTOR.services_by_name["Tokenization"].full_name,
        info_pb2.DESCRIPTOR.services_by_name["Info"].full_name,
        EMBEDDING_SERVICE,
        admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)


def run(config: FrontendConfig) -> int:
    import uvloop
    uvloop.run(serve(config))
    return 0
