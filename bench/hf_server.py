"""`python -m bench.hf_server`: HF transformers behind pagedserve's gRPC API, the naive way.

The baseline for `bench serve --backend hf`: what serving looks like without an engine.
Requests run one at a time, each a `model.generate` call (batch size 1, no paged KV cache,
no prefix cache, no continuous batching); later requests wait their turn. Tokens stream
out as generate produces them, through a streamer. It speaks enough of pagedserve.v1 for
the benchmark and simple clients:
  - Generation.Generate: text, chat or token_ids prompts; greedy (temperature 0) or
    sampling with temperature / top_p / top_k / seed; max_tokens, min_tokens, ignore_eos.
    Anything else (n > 1, stop strings, logprobs, penalties, ...) is INVALID_ARGUMENT.
  - Info.GetModelInfo, Tokenization.Tokenize / Detokenize, grpc.health.v1.
It prints `grpc listening on HOST:PORT` once the model is loaded, as the frontend does.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers.generation.streamers import BaseStreamer
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from common.ipc import sampling_params_from_proto
from common.sampling_params import SamplingParams
from common.v1 import generation_pb2 as gen, generation_pb2_grpc, info_pb2, info_pb2_grpc, tokenization_pb2
from common.v1 import tokenization_pb2_grpc
from common.validation import PromptLimits
from frontend.detokenizer import IncrementalDetokenizer
from frontend.input_processor import InputProcessor
from frontend.servicers import prompt_from_request

GENERATION_SERVICE = gen.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_MODEL_LEN_CAP = 8192  # as the engine: the model's own limit, at most this
_DONE = object()  # ends a request's token queue


@dataclass
class HFServerConfig:
    model: str | None = None  # HF folder or .gguf file; None = the bundled SmolLM2
    tokenizer: str | None = None
    dtype: str = "auto"  # as the engine's --dtype auto
    device: str = "cpu"
    num_threads: int | None = None
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50052


class HFModel:
    """The transformers model and its tokenizer; `generate` runs on one worker thread."""

    def __init__(self, config: HFServerConfig) -> None:
        from engine.config import resolve_dtype
        from engine.models.loader import load_tokenizer
        from engine.models.source import model_files, served_model_name, tokenizer_path
        path = model_files(config)
        dtype = resolve_dtype(config.dtype, config.device)
        self.model = load_hf_model(path, dtype, config.device)
        self.tokenizer = load_tokenizer(path, tokenizer_path(config))
        hf = self.model.config
        self.name, self.dtype, self.device = served_model_name(config.model, path), dtype, config.device
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or min(hf.max_position_embeddings, MAX_MODEL_LEN_CAP)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos]
        # No KV pool here: one block per token of the model's length never binds.
        self.input = InputProcessor(self.tokenizer, PromptLimits(self.vocab_size, self.max_model_len,
                                                                 self.max_model_len, 1))

    def generate(self, prompt: list[int], params: SamplingParams, on_tokens, cancelled: threading.Event) -> int:
        """Blocking. Calls `on_tokens(ids)` as tokens come; returns how many were generated."""
        max_new = params.max_tokens or self.max_model_len - len(prompt)
        kwargs = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        if params.seed is not None:
            torch.manual_seed(params.seed)  # one request at a time: the global generator is ours
        streamer = _TokenStreamer(on_tokens)
        ids = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                min_new_tokens=max_new if params.ignore_eos else params.min_tokens,
                pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else 0,
                streamer=streamer, stopping_criteria=StoppingCriteriaList([_Cancelled(cancelled)]), **kwargs)
        return streamer.num_tokens


def load_hf_model(path, dtype: str, device: str):
    """As `bench offline --compare-hf`: HF loads a GGUF as float32, then we cast."""
    from bench.hf_reference import load_hf_float32
    from engine.models.loader import DTYPES
    return load_hf_float32(path).to(device=device, dtype=DTYPES[dtype])


class _TokenStreamer(BaseStreamer):
    """generate() calls put() with the prompt first, then with each new token."""

    def __init__(self, on_tokens) -> None:
        self.on_tokens = on_tokens
        self.seen_prompt = False
        self.num_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        self.num_tokens += len(ids)
        self.on_tokens(ids)

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    """Stops generate at the next token once the caller has gone away."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, hf: HFModel) -> None:
        self.hf = hf
        self.turn = asyncio.Lock()  # one request at a time: that is the baseline
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self.running: set[threading.Event] = set()

    async def Generate(self, request: gen.GenerateRequest, context):  # noqa: N802 - gRPC's name
        try:
            prompt, params = self._parse(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async with self.turn:
            yield gen.GenerateResponse(started=gen.Started(
                request_id=request.request_id or uuid.uuid4().hex, prompt_tokens=len(prompt)))
            loop, queue, cancelled = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

            def work() -> int:
                try:
                    return self.hf.generate(prompt, params, lambda ids: loop.call_soon_threadsafe(
                        queue.put_nowait, ids), cancelled)
                finally:
                    loop.call_soon_threadsafe(queue.put_nowait, _DONE)

            self.running.add(cancelled)
            job = loop.run_in_executor(self.worker, work)
            try:
                async for response in self._stream(queue, job, prompt, params):
                    yield response
            finally:
                # Cancelled or disconnected: generate stops at its next token, and the single
                # worker thread keeps the next request from starting before that.
                cancelled.set()
                self.running.discard(cancelled)

    async def _stream(self, queue: asyncio.Queue, job, prompt: list[int], params: SamplingParams):
        detok = IncrementalDetokenizer(self.hf.tokenizer, prompt, params.skip_special_tokens)
        last, done = None, False
        while not done:
            items = [await queue.get()]
            while not queue.empty():  # coalesce what queued up, as the frontend does
                items.append(queue.get_nowait())
            done = items[-1] is _DONE
            ids = [t for item in items if item is not _DONE for t in item]
            text = detok.add(ids) + (detok.flush() if done else "")
            if ids or text:
                last = ids[-1] if ids else last
                yield gen.GenerateResponse(chunk=gen.Chunk(token_ids=ids, text=text))
        num_tokens = await job  # re-raises a failure of generate
        eos = last in self.hf.eos_token_ids and not params.ignore_eos
        reason = gen.FINISH_REASON_EOS if eos else gen.FINISH_REASON_LENGTH
        yield gen.GenerateResponse(finished=gen.Finished(reason=reason, usage=gen.Usage(
            prompt_tokens=len(prompt), completion_tokens=num_tokens)))

    def _parse(self, request: gen.GenerateRequest) -> tuple[list[int], SamplingParams]:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        params = sampling_params_from_proto(request.sampling, skip_special_tokens=skip)
        unsupported = [name for name, on in (
            ("n > 1", params.n != 1), ("min_p", params.min_p), ("stop", params.stop),
            ("stop_token_ids", params.stop_token_ids), ("logprobs", params.logprobs is not None),
            ("penalties", params.uses_penalties), ("logit_bias, bad_words, allowed_token_ids", params.uses_logit_rules),
            ("include_stop_str_in_output", request.include_stop_str_in_output),
            ("time_limit_ms", request.HasField("time_limit_ms"))) if on]
        if unsupported:
            raise ValueError(f"not supported by the HF baseline server: {', '.join(unsupported)}")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        prompt, _ = prompt_from_request(self.hf.input, request, add_special)  # a text model's: no images
        self.hf.input.check(prompt, params)
        return prompt, params

    def cancel_all(self) -> None:
        for event in list(self.running):
            event.set()


class TokenizationService(tokenization_pb2_grpc.TokenizationServicer):
    def __init__(self, hf: HFModel) -> None:
        self.hf = hf

    async def Tokenize(self, request, context):  # noqa: N802
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            ids = self.hf.input.check_token_ids(prompt_from_request(self.hf.input, request, add_special)[0])
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenization_pb2.TokenizeResponse(token_ids=ids, tokens=self.hf.tokenizer.convert_ids_to_tokens(ids))

    async def Detokenize(self, request, context):  # noqa: N802
        try:
            ids = self.hf.input.check_token_ids(list(request.token_ids), "token_ids")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return tokenization_pb2.DetokenizeResponse(text=self.hf.tokenizer.decode(ids, skip_special_tokens=skip))


class InfoService(info_pb2_grpc.InfoServicer):
    def __init__(self, hf: HFModel) -> None:
        self.hf = hf

    async def GetModelInfo(self, request, context):  # noqa: N802
        hf = self.hf
        return info_pb2.ModelInfo(model_name=hf.name, architecture=hf.model.config.model_type,
                                  max_model_len=hf.max_model_len, vocab_size=hf.vocab_size,
                                  eos_token_ids=hf.eos_token_ids, dtype=hf.dtype)


async def serve(config: HFServerConfig) -> None:
    """Load the model, then serve until SIGINT or SIGTERM."""
    from engine.cpu_tuning import tune_cpu
    if config.device == "cpu":
        tune_cpu(config.num_threads)  # the engine's settings, so the comparison is fair
    hf = HFModel(config)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    server = grpc.aio.server()
    generation = GenerationService(hf)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    tokenization_pb2_grpc.add_TokenizationServicer_to_server(TokenizationService(hf), server)
    info_pb2_grpc.add_InfoServicer_to_server(InfoService(hf), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"grpc listening on {config.host}:{port}", flush=True)
    await stop.wait()
    generation.cancel_all()
    await server.stop(grace=1.0)
    generation.worker.shutdown(wait=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.hf_server",
        description="HF transformers generate behind pagedserve's gRPC API, one request at a time: "
                    "the naive-server baseline of `pagedserve bench serve --backend hf`.")
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    p.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"],
                   help="weight dtype; auto as the engine's --dtype auto (default: auto)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"longest prompt + output (default: the model's, at most {MAX_MODEL_LEN_CAP})")
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen host (default: 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=50052, help="gRPC port; 0 picks a free one (default: 50052)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    asyncio.run(serve(HFServerConfig(**vars(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
