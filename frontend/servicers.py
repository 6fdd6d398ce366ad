"""The gRPC services: Generation, Tokenization, Info (Embedding: frontend/embedding_servicer.py).
They translate, and map errors to status codes here, once: NotFound (an unknown LoRA adapter)
-> NOT_FOUND, InvalidRequest -> INVALID_ARGUMENT, EngineOverloaded -> RESOURCE_EXHAUSTED,
Unavailable (no engine, engine lost, draining) -> UNAVAILABLE, RequestFailed (the engine ended
it part-way, saying why) -> INTERNAL with that message. Anything else is a bug: the call ends
INTERNAL with a generic message, never a stack trace."""

from __future__ import annotations

import asyncio
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from common.errors import EngineOverloaded, InvalidRequest, RequestFailed, Unavailable
from common.ipc import sampling_params_from_proto
from common.multimodal import ImageInput
from common.structured_output.params import StructuredOutputsParams
from common.v1 import generation_pb2 as gen, generation_pb2_grpc, info_pb2, info_pb2_grpc, tokenization_pb2
from common.v1 import tokenization_pb2_grpc
from frontend.async_llm import AsyncLLM, Generation
from frontend.input_processor import InputProcessor, NotFound
from frontend.metrics import FrontendMetrics, outcome_code
from frontend.multimodal import images
from frontend.multimodal.parts import collapse, image_part, only_in_user, text_part
from frontend.output_processor import PositionLogprobs, SampleDelta
from frontend.pooling import served_task
from frontend.request_log import RequestLog

log = logging.getLogger("pagedserve.frontend")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@=+-]{1,128}")
MAX_ABORT_IDS = 1024
MAX_TIME_LIMIT_MS = 24 * 3600 * 1000
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
RETRY_PUSHBACK_MS = 1000  # about one long decode burst on a busy server
VERSION = "0.1.0"
FR = gen.FinishReason
FINISH_REASONS = {"length": FR.FINISH_REASON_LENGTH, "eos": FR.FINISH_REASON_EOS,
                  "stop_string": FR.FINISH_REASON_STOP_STRING, "stop_token": FR.FINISH_REASON_STOP_TOKEN,
                  "abort": FR.FINISH_REASON_ABORTED, "time_limit": FR.FINISH_REASON_TIME_LIMIT}


@dataclass
class GrpcContext:
    """What the gRPC services share."""

    llm: AsyncLLM
    metrics: FrontendMetrics
    log_prompts: bool = False  # put prompts in the request log


@asynccontextmanager
async def status_codes(context):
    """The one mapping of the frontend's typed errors to gRPC status codes."""
    try:
        yield
    except NotFound as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except InvalidRequest as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except EngineOverloaded as e:
        # The standard trailer gRPC's retry policy reads: wait this long before retrying.
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(RETRY_PUSHBACK_MS)),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except Unavailable as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except RequestFailed as e:
        log.warning("request failed: %s", e)
        await context.abort(grpc.StatusCode.INTERNAL, str(e))
    except Exception:
        if context.code() is not None:  # context.abort() already chose the status
            raise
        log.exception("internal error")  # a bug: the trace goes to the log, not to the caller
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")


def check_request_id(request_id: str) -> None:
    """A caller's request id ("": the server assigns one) is logged and aborted by: keep it plain."""
    if request_id and not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest("request_id: 1-128 characters of letters, digits and ._:@=+-")


def prompt_from_request(processor: InputProcessor, msg,
                        add_special_tokens: bool = True) -> tuple[list[int], list[ImageInput]]:
    """`msg` has a oneof `input` of text / token_ids / chat (GenerateRequest, TokenizeRequest):
    the prompt's ids and its images (a chat's, InputProcessor.chat_prompt)."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input: give one of text, token_ids or chat")
    if kind == "text":
        return processor.tokenize(msg.text, add_special_tokens), []
    if kind == "chat":
        processor.check_images(sum(p.WhichOneof("part") == "image" for m in msg.chat.messages for p in m.parts),
                               "chat.messages")  # before any is decoded
        return processor.chat_prompt(chat_messages(msg.chat), field="chat.messages")
    return list(msg.token_ids.ids), []


async def prompt_off_loop(processor: InputProcessor, msg, add_special_tokens: bool = True
                          ) -> tuple[list[int], list[ImageInput]]:
    """`prompt_from_request` on the event loop: a chat with images is decoded and preprocessed
    in a worker thread (InputProcessor.chat_prompt_async says why)."""
    if msg.WhichOneof("input") == "chat" and any(p.HasField("image") for m in msg.chat.messages for p in m.parts):
        return await asyncio.to_thread(prompt_from_request, processor, msg, add_special_tokens)
    return prompt_from_request(processor, msg, add_special_tokens)


def chat_messages(chat: gen.Chat, field: str = "chat.messages") -> list[dict]:
    """A Chat's messages as the input processor takes them: each its `content`, or its `parts`
    with their images decoded (frontend/multimodal/parts.py)."""
    return [_chat_message(m, f"{field}[{i}]") for i, m in enumerate(chat.messages)]


def _chat_message(m: gen.ChatMessage, where: str) -> dict:
    if not m.parts:
        return {"role": m.role, "content": m.content}
    if m.content:
        raise InvalidRequest(f"{where}.content: must be empty when parts is set (put the text in a text part)")
    parts = []
    for j, part in enumerate(m.parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise InvalidRequest(f"{where}.parts[{j}]: set text or image")
        parts.append(text_part(part.text) if kind == "text"
                     else image_part(images.from_bytes(part.image.data, f"{where}.parts[{j}].image")))
    only_in_user(parts, m.role, f"{where}.parts")
    return {"role": m.role, "content": collapse(parts)}


def _constraint(request: gen.GenerateRequest) -> StructuredOutputsParams | None:
    """The `constraint` oneof as the engine's structured-output parameters."""
    kind = request.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object" and not request.json_object:
        raise InvalidRequest("json_object: must be true when set")
    # Errors name the engine's fields (structured_outputs.json for json_schema): one message
    # for every API.
    value = {"json_schema": request.json_schema, "json_object": True, "regex": request.regex,
             "choice": tuple(request.choice.choices), "grammar": request.grammar}[kind]
    return StructuredOutputsParams(**{"json" if kind == "json_schema" else kind: value})


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, ctx: GrpcContext) -> None:
        self.ctx = ctx

    async def Generate(self, request: gen.GenerateRequest, context):  # noqa: N802 - gRPC's name
        record, generation, error = RequestLog(self.ctx.log_prompts), None, None
        self.ctx.metrics.active_streams.labels("grpc").inc()
        try:
            async with status_codes(context):
                generation = await self._admit(request)
                time_limit_s = request.time_limit_ms / 1000 if request.HasField("time_limit_ms") else None
                started = False
                async for deltas in self.ctx.llm.generate(generation, time_limit_s):
                    if not started:  # after the engine took it: an engine refusal still comes first
                        started = True
                        yield gen.GenerateResponse(started=_started(generation))
                    for response in self._responses(generation, deltas):
                        yield response
        except BaseException as e:
            error = e
            raise
        finally:
            self.ctx.metrics.active_streams.labels("grpc").dec()
            record.write(outcome_code(context, error).name, generation, _prompt_for_log(request))

    async def _admit(self, request: gen.GenerateRequest) -> Generation:
        llm = self.ctx.llm
        processor = llm.require_ready()
        check_request_id(request.request_id)
        if request.HasField("time_limit_ms") and not 0 < request.time_limit_ms <= MAX_TIME_LIMIT_MS:
            raise InvalidRequest(f"time_limit_ms: must be in [1, {MAX_TIME_LIMIT_MS}] (24 hours), "
                                 f"got {request.time_limit_ms}")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        params = sampling_params_from_proto(request.sampling, defaults=processor.sampling_defaults,
                                            skip_special_tokens=skip,
                                            include_stop_str_in_output=request.include_stop_str_in_output,
                                            structured_outputs=_constraint(request))
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        prompt, images = await prompt_off_loop(processor, request, add_special)
        field = "token_ids" if request.WhichOneof("input") == "token_ids" else "prompt"
        return llm.admit(prompt, params, request.request_id or None, request.priority, field, request.lora_name,
                         images)

    def _responses(self, generation: Generation, deltas: list[SampleDelta]) -> list[gen.GenerateResponse]:
        state = generation.state
        out = []
        for d in deltas:
            if d.token_ids or d.text:
                chunk = gen.Chunk(index=d.index, token_ids=d.token_ids, text=d.text,
                                  logprobs=[_logprobs_to_proto(p) for p in d.logprobs])
                out.append(gen.GenerateResponse(chunk=chunk))
        for d in deltas:
            if d.finish_reason is not None:
                usage = gen.Usage(prompt_tokens=len(state.prompt), completion_tokens=d.num_tokens,
                                  cached_tokens=state.num_cached_tokens)
                finished = gen.Finished(index=d.index, reason=FINISH_REASONS[d.finish_reason], usage=usage)
                if isinstance(d.stop_reason, str):
                    finished.stop_string = d.stop_reason
                elif d.stop_reason is not None:
                    finished.stop_token_id = d.stop_reason
                out.append(gen.GenerateResponse(finished=finished))
        return out

    async def Abort(self, request: gen.AbortRequest, context):  # noqa: N802
        if len(request.request_ids) > MAX_ABORT_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_ids: at most {MAX_ABORT_IDS} per call, got {len(request.request_ids)}")
        found = self.ctx.llm.abort(list(request.request_ids))
        status = gen.AbortResult.Status
        return gen.AbortResponse(results=[
            gen.AbortResult(request_id=i, status=status.STATUS_ABORTED if f else status.STATUS_NOT_FOUND)
            for i, f in zip(request.request_ids, found)])


def _started(generation: Generation) -> gen.Started:
    state = generation.state
    started = gen.Started(request_id=generation.request_id, prompt_tokens=len(state.prompt),
                          cached_tokens=state.num_cached_tokens)
    if state.prompt_logprobs is not None:
        started.prompt_logprobs.extend(_logprobs_to_proto(p) for p in state.prompt_logprobs[1:])
    return started


def _logprobs_to_proto(p: PositionLogprobs) -> gen.PositionLogprobs:
    def one(t):
        return gen.TokenLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
    return gen.PositionLogprobs(sampled=one(p.sampled), top=[one(t) for t in p.top])


def _prompt_for_log(request: gen.GenerateRequest) -> object:
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return [{"role": m.role, "content": [p.text if p.WhichOneof("part") == "text"
                                             else f"<image: {len(p.image.data)} bytes>" for p in m.parts]
                 if m.parts else m.content} for m in request.chat.messages]
    return request.text


class TokenizationService(tokenization_pb2_grpc.TokenizationServicer):
    def __init__(self, ctx: GrpcContext) -> None:
        self.ctx = ctx

    async def Tokenize(self, request, context):  # noqa: N802
        async with status_codes(context):
            processor = self.ctx.llm.require_engine()
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids, _ = await prompt_off_loop(processor, request, add_special)
            ids = processor.check_token_ids(ids)
            tokens = processor.tokenizer.convert_ids_to_tokens(ids)
            return tokenization_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request, context):  # noqa: N802
        async with status_codes(context):
            processor = self.ctx.llm.require_engine()
            ids = processor.check_token_ids(list(request.token_ids), "token_ids")
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            return tokenization_pb2.DetokenizeResponse(text=processor.tokenizer.decode(ids, skip_special_tokens=skip))


class InfoService(info_pb2_grpc.InfoServicer):
    def __init__(self, ctx: GrpcContext) -> None:
        self.ctx = ctx

    async def GetModelInfo(self, request, context):  # noqa: N802
        async with status_codes(context):
            self.ctx.llm.require_engine()
            w = self.ctx.llm.welcome
            adapters = [info_pb2.LoraAdapterInfo(name=a.name, path=a.path, rank=a.rank)
                        for _, a in sorted(self.ctx.llm.pool.lora_adapters().items())]
            return info_pb2.ModelInfo(model_name=w.model_name, architecture=w.architecture,
                                      max_model_len=w.max_model_len, vocab_size=w.vocab_size,
                                      eos_token_ids=w.eos_token_ids, dtype=w.dtype, lora_enabled=w.lora_enabled,
                                      max_lora_rank=w.max_lora_rank, lora_adapters=adapters,
                                      task=served_task(w.pooler),
                                      embedding_dimensions=w.pooler.dimensions if w.pooler.task == "embed" else 0,
                                      quantization=w.quantization)

    async def GetServerInfo(self, request, context):  # noqa: N802
        """KV blocks and requests of every answering engine together; every engine of the pool,
        whatever its state; the frontends those engines know."""
        async with status_codes(context):
            llm = self.ctx.llm
            llm.require_engine()
            serving = llm.pool.serving()
            kv_total = kv_free = running = waiting = 0
            frontends: dict[str, info_pb2.Peer] = {}
            for engine in serving:
                w, s = engine.client.welcome, engine.client.stats
                kv_total += w.kv_blocks_total
                kv_free += s.kv_blocks_free if s.kv_blocks_total else w.kv_blocks_total
                running, waiting = running + s.num_running, waiting + s.num_waiting
                frontends.update((peer.id, peer) for peer in engine.client.peers)
            engines = [info_pb2.Peer(id=e.client.welcome.engine_id if e.client.welcome else "", address=e.address)
                       for e in llm.pool.engines.values()]
            return info_pb2.ServerInfo(
                block_size=llm.welcome.block_size, kv_blocks_total=kv_total, kv_blocks_free=kv_free,
                num_running=running, num_waiting=waiting, frontends=list(frontends.values()),
                engines=engines, version=VERSION)
