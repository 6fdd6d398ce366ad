"""The gRPC services: Generation, Tokenization, Info. Errors map to status codes here, once:
ValueError -> INVALID_ARGUMENT, a full house -> RESOURCE_EXHAUSTED, no engine -> UNAVAILABLE."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field

import grpc

from engine.ipc import sampling_params_from_proto, sampling_params_to_proto
from engine.request import sample_request_id
from engine.validation import EngineOverloaded, PromptLimits, check_prompt
from frontend.engine_client import EngineClient, EngineLost
from frontend.metrics import FrontendMetrics, outcome_code
from frontend.prompts import Prompts
from frontend.request_log import RequestLog
from frontend.stream import ABORTED, Stream
from pagedserve.v1 import engine_ipc_pb2 as ipc
from pagedserve.v1 import generation_pb2 as gen
from pagedserve.v1 import generation_pb2_grpc, info_pb2, info_pb2_grpc, tokenization_pb2
from pagedserve.v1 import tokenization_pb2_grpc

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@=+-]{1,128}")
MAX_ABORT_IDS = 1024
MAX_TIME_LIMIT_MS = 24 * 3600 * 1000
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
RETRY_PUSHBACK_MS = 1000  # about one long decode burst on a busy server
VERSION = "0.1.0"


@dataclass
class FrontendState:
    """What the services share: the engine link, the tokenizer, limits."""

    client: EngineClient
    prompts: Prompts | None  # None until the first handshake told us the model
    max_concurrent_streams: int
    metrics: FrontendMetrics
    grpc_address: str = ""
    log_prompts: bool = False  # put prompts in the request log
    draining: bool = False  # shutting down: refuse new streams, let running ones finish
    active: dict[str, str] = field(default_factory=dict)  # caller's request id -> engine-side id

    def limits(self) -> PromptLimits:
        w = self.client.welcome
        return PromptLimits(w.vocab_size, w.max_model_len, w.kv_blocks_total, w.block_size)


async def _require_engine(state: FrontendState, context) -> None:
    if not state.client.connected.is_set() or state.prompts is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine connected; retry shortly")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def Generate(self, request: gen.GenerateRequest, context):  # noqa: N802 - gRPC's name
        record, stream, error = RequestLog(self.state.log_prompts), None, None
        try:
            stream = await self._admit(request, context, record)
            async for response in self._run(stream, request, context):
                yield response
        except BaseException as e:
            error = e
            raise
        finally:
            record.write(outcome_code(context, error), stream, request)

    async def _admit(self, request: gen.GenerateRequest, context, record: RequestLog) -> Stream:
        """Validate and admit, or abort the call with the status code that says why."""
        state = self.state
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")
        await _require_engine(state, context)
        try:
            params, prompt = self._parse(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or uuid.uuid4().hex
        record.fields["request_id"] = request_id
        if request_id in state.active:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id {request_id!r} is already in use by a running request")
        if len(state.active) >= state.max_concurrent_streams:
            await _overloaded(context, f"server busy: {len(state.active)} streams running "
                                       f"(--max-concurrent-streams {state.max_concurrent_streams}); retry later")
        # The engine sees a fresh id per stream, so a late token of an aborted stream can never
        # reach a new stream that reuses the caller's id.
        engine_id = uuid.uuid4().hex
        client = state.client

        def abort(index: int | None) -> None:
            _abort_later(client, [engine_id if index is None or params.n == 1 else sample_request_id(engine_id, index)])

        return Stream(request_id, engine_id, prompt, params, state.prompts.tokenizer,
                      set(client.welcome.eos_token_ids), abort)

    async def _run(self, stream: Stream, request: gen.GenerateRequest, context):
        state, client, engine_id = self.state, self.state.client, stream.engine_id
        state.active[stream.request_id] = engine_id
        state.metrics.active_streams.inc()
        queue = client.open_stream(engine_id)
        time_limit_s = request.time_limit_ms / 1000 if request.HasField("time_limit_ms") else None
        try:
            await client.add(ipc.AddRequest(request_id=engine_id, prompt_token_ids=stream.prompt,
                                            sampling=sampling_params_to_proto(stream.params),
                                            priority=request.priority))
            async for response in stream.responses(queue, time_limit_s):
                yield response
        except EngineLost as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine lost: {e}")
        except EngineOverloaded as e:
            await _overloaded(context, str(e))
        except ValueError as e:  # the engine refused it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            del state.active[stream.request_id]
            state.metrics.active_streams.dec()
            client.close_stream(engine_id)
            if not stream.done:  # cancelled, disconnected, deadline passed or failed: free its blocks
                _abort_later(client, [engine_id])

    def _parse(self, request: gen.GenerateRequest):
        if request.request_id and not _REQUEST_ID.fullmatch(request.request_id):
            raise ValueError("request_id: 1-128 characters of letters, digits and ._:@=+-")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        params = sampling_params_from_proto(request.sampling, skip_special_tokens=skip,
                                            include_stop_str_in_output=request.include_stop_str_in_output)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        prompt = self.state.prompts.from_request(request, add_special)
        check_prompt(prompt, params, self.state.limits())
        if request.HasField("time_limit_ms") and not 0 < request.time_limit_ms <= MAX_TIME_LIMIT_MS:
            raise ValueError(f"time_limit_ms: must be in [1, {MAX_TIME_LIMIT_MS}] (24 hours), "
                             f"got {request.time_limit_ms}")
        return params, prompt

    async def Abort(self, request: gen.AbortRequest, context):  # noqa: N802
        if len(request.request_ids) > MAX_ABORT_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_ids: at most {MAX_ABORT_IDS} per call, got {len(request.request_ids)}")
        client, results, running = self.state.client, [], []
        for request_id in request.request_ids:
            engine_id = self.state.active.get(request_id)
            queue = client.streams.get(engine_id) if engine_id else None
            if queue is None:
                results.append(gen.AbortResult(request_id=request_id, status=gen.AbortResult.STATUS_NOT_FOUND))
                continue
            queue.put_nowait(ABORTED)
            running.append(engine_id)
            results.append(gen.AbortResult(request_id=request_id, status=gen.AbortResult.STATUS_ABORTED))
        try:
            await client.abort(running)
        except EngineLost:
            pass  # the engine is gone, and its requests with it
        return gen.AbortResponse(results=results)


async def _overloaded(context, message: str) -> None:
    # The standard trailer gRPC's retry policy reads: wait this long before retrying.
    context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(RETRY_PUSHBACK_MS)),))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def _abort_later(client: EngineClient, request_ids: list[str]) -> None:
    # Its own task: the caller may itself be a cancelled task, where an await would not run.
    async def send() -> None:
        try:
            await client.abort(request_ids)
        except EngineLost:
            pass
    asyncio.ensure_future(send())


class TokenizationService(tokenization_pb2_grpc.TokenizationServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def Tokenize(self, request, context):  # noqa: N802
        await _require_engine(self.state, context)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            ids = self.state.prompts.from_request(request, add_special)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tokens = self.state.prompts.tokenizer.convert_ids_to_tokens(ids)
        return tokenization_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request, context):  # noqa: N802
        await _require_engine(self.state, context)
        try:
            ids = self.state.prompts.check_ids(list(request.token_ids), "token_ids")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.state.prompts.tokenizer.decode(ids, skip_special_tokens=skip)
        return tokenization_pb2.DetokenizeResponse(text=text)


class InfoService(info_pb2_grpc.InfoServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def GetModelInfo(self, request, context):  # noqa: N802
        await _require_engine(self.state, context)
        w = self.state.client.welcome
        return info_pb2.ModelInfo(model_name=w.model_name, architecture=w.architecture,
                                  max_model_len=w.max_model_len, vocab_size=w.vocab_size,
                                  eos_token_ids=w.eos_token_ids, dtype=w.dtype)

    async def GetServerInfo(self, request, context):  # noqa: N802
        await _require_engine(self.state, context)
        client = self.state.client
        w, s = client.welcome, client.stats
        return info_pb2.ServerInfo(
            block_size=w.block_size, kv_blocks_total=w.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free if s.kv_blocks_total else w.kv_blocks_total,
            num_running=s.num_running, num_waiting=s.num_waiting, frontends=client.peers,
            engines=[info_pb2.Peer(id=w.engine_id, address=client.address)], version=VERSION)
