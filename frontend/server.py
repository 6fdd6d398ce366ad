"""The frontend process: a grpc.aio server on uvloop, linked to one engine over ZeroMQ.

Health (grpc.health.v1): "" is SERVING while the process is up; the Generation service
is SERVING only while an engine is connected and answering heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend.engine_client import EngineClient
from frontend.prompts import Prompts
from frontend.servicers import FrontendState, GenerationService, InfoService, TokenizationService
from pagedserve.v1 import generation_pb2, generation_pb2_grpc, info_pb2, info_pb2_grpc
from pagedserve.v1 import tokenization_pb2, tokenization_pb2_grpc

log = logging.getLogger("pagedserve.frontend")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class FrontendConfig:
    engine_address: str
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    tokenizer: str | None = None  # default: the engine's model, found through the handshake
    max_concurrent_streams: int = 256
    heartbeat_s: float = 0.5
    engine_timeout_s: float = 3.0


async def serve(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or SIGINT/SIGTERM)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    address = f"{config.host}:{port}"
    health_servicer = health.aio.HealthServicer()
    state = _state(config, address, health_servicer)
    _add_services(server, state, health_servicer)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    print(f"grpc listening on {address}", flush=True)
    await state.client.start()
    try:
        await stop.wait()
    finally:
        log.info("frontend stopping")
        await server.stop(grace=1.0)
        await state.client.close()


def _state(config: FrontendConfig, address: str, health_servicer) -> FrontendState:
    state = FrontendState(client=None, prompts=None, max_concurrent_streams=config.max_concurrent_streams,
                          grpc_address=address)

    def on_engine_state(connected: bool) -> None:
        if connected and state.prompts is None:
            state.prompts = _load_prompts(config, state.client.welcome)
        status = health_pb2.HealthCheckResponse.SERVING if connected else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.ensure_future(health_servicer.set(GENERATION_SERVICE, status))

    state.client = EngineClient(config.engine_address, uuid.uuid4().hex, address, config.heartbeat_s,
                                config.engine_timeout_s, on_engine_state)
    return state


def _load_prompts(config: FrontendConfig, welcome) -> Prompts:
    from pathlib import Path

    from engine.models.loader import load_tokenizer
    tokenizer = load_tokenizer(Path(welcome.model_path), config.tokenizer)
    return Prompts(tokenizer, welcome.vocab_size)


def _add_services(server, state: FrontendState, health_servicer) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(state), server)
    tokenization_pb2_grpc.add_TokenizationServicer_to_server(TokenizationService(state), server)
    info_pb2_grpc.add_InfoServicer_to_server(InfoService(state), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        GENERATION_SERVICE,
        tokenization_pb2.DESCRIPTOR.services_by_name["Tokenization"].full_name,
        info_pb2.DESCRIPTOR.services_by_name["Info"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)


def run(config: FrontendConfig) -> int:
    import uvloop
    uvloop.run(serve(config))
    return 0
