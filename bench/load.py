"""The load generator of `bench serve`: when each request is sent, and what it saw.

Arrivals are an open loop, as in vLLM's benchmark_serving: request i is sent at its
scheduled time whether or not earlier ones finished (then waits for a slot if
--max-concurrency is set). Gaps between arrivals are gamma-distributed with shape
`burstiness` and mean 1/rate: burstiness 1 is a Poisson process, below 1 burstier,
above 1 more even. Rate inf sends everything at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from bench.datasets import BenchRequest


def arrival_offsets_s(num: int, rate: float, burstiness: float, seed: int | tuple[int, ...]) -> list[float]:
    """Send time of each request, in seconds after the first one (which goes at 0)."""
    if not rate > 0:
        raise ValueError(f"request rate: must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if math.isinf(rate) or num == 0:
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(slots=True)
class RequestRecord:
    """One request's stream, timed on this side of the wire (seconds since its send); every
    API's client fills the same record, so one code path computes the metrics."""

    prompt_tokens: int
    expected_output_tokens: int = 0  # what max_tokens asked for
    sent_at_s: float = float("nan")  # since the run's start: its arrival plus any wait for a slot
    ok: bool = False
    code: str = "OK"  # the gRPC status code's name, or HTTP_<status> (see bench.openai_client)
    error: str = ""
    ttft_s: float = float("nan")  # to the first Chunk with tokens (OpenAI: with text)
    e2e_s: float = float("nan")
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    token_times_s: list[float] = field(default_factory=list)  # one per output token

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)


Send = Callable[[BenchRequest, float], Awaitable[RequestRecord]]  # (request, run start) -> its record


async def run_load(send: Send, requests: list[BenchRequest], offsets_s: list[float], max_concurrency: int | None,
                   desc: str = "requests") -> tuple[list[RequestRecord], float]:
    """Send every request at its offset with `send` (one API's client: `generate` here, or
    bench.openai_client's); returns the records (in request order) and the wall time from the
    first send to the last finish."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=None)
    start = time.perf_counter()

    async def one(request: BenchRequest, offset_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
        if limit is None:
            record = await send(request, start)
        else:
            async with limit:
                record = await send(request, start)
        bar.update(1)
        return record

    records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets_s)))
    duration_s = time.perf_counter() - start
    bar.close()
    return list(records), duration_s


async def generate(stub, request: BenchRequest, run_start: float | None = None) -> RequestRecord:
    """One greedy Generate stream that must produce exactly `request.output_len` tokens."""
    from common.v1 import generation_pb2 as gen
    sampling = gen.SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
    if isinstance(request.prompt, str):
        message = gen.GenerateRequest(text=request.prompt, sampling=sampling)
    else:
        message = gen.GenerateRequest(token_ids=gen.TokenIds(ids=request.prompt), sampling=sampling)
    record = RequestRecord(prompt_tokens=request.prompt_len, expected_output_tokens=request.output_len)
    return await timed_stream(stub, message, record, run_start)


async def timed_stream(stub, message, record: RequestRecord, run_start: float | None = None,
                       on_response: Callable[[object], None] | None = None) -> RequestRecord:
    """Run one Generate call, timing its messages into `record`; `on_response` sees each
    message too (a caller that keeps the text)."""
    import grpc
    start = time.perf_counter()
    record.sent_at_s = start - (run_start or start)
    try:
        async for response in stub.Generate(message):
            _apply(record, response, time.perf_counter() - start)
            if on_response is not None:
                on_response(response)
    except grpc.aio.AioRpcError as e:
        record.code, record.error = e.code().name, e.details() or ""
    record.e2e_s = time.perf_counter() - start
    if not record.ok and not record.error:
        record.code, record.error = "UNKNOWN", "stream ended without Finished"
    return record


def _apply(record: RequestRecord, response, now_s: float) -> None:
    kind = response.WhichOneof("kind")
    if kind == "started":
        record.prompt_tokens = response.started.prompt_tokens or record.prompt_tokens
        record.cached_tokens = response.started.cached_tokens
    elif kind == "chunk" and response.chunk.token_ids:
        if not record.token_times_s:
            record.ttft_s = now_s
        # A Chunk may carry several tokens under load: they share its arrival time.
        record.token_times_s += [now_s] * len(response.chunk.token_ids)
    elif kind == "finished":
        record.ok = True
