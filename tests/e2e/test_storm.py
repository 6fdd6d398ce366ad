"""A cancellation storm against a real frontend and engine: 1,000 requests (5,000 with
--long), ~100 in flight, about 30% cancelled at random moments (before the first token,
mid-stream, at the last token), with short deadlines and explicit Aborts among them.
Afterwards every KV block is free, nothing runs or waits, and every request that was left
alone got its full answer."""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass

import grpc
import pytest

from grpc_client import FR
from helpers import LONG
from common.v1 import generation_pb2 as gen, generation_pb2_grpc

pytestmark = pytest.mark.heavy(120)  # seconds on the 2-core CI machine: scheduled first

NUM_REQUESTS = 5000 if LONG else 1000
IN_FLIGHT = 100
FATES = ["complete"] * 70 + ["cancel_early"] * 8 + ["cancel_mid"] * 8 + ["cancel_last"] * 6 + \
        ["deadline"] * 4 + ["abort"] * 4


@dataclass
class Outcome:
    fate: str
    max_tokens: int
    code: grpc.StatusCode = grpc.StatusCode.OK
    tokens: int = 0
    finished: gen.Finished | None = None


@pytest.fixture(scope="module")
def storm_frontend(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.pagedserve("engine", "--address", address, "--dtype", "float32", "--num-kv-blocks", "384",
                              "--max-model-len", "512", "--num-threads", "1", "--max-num-seqs", "64")
    procs.drain(engine)
    fe = procs.start_frontend(address, "--max-concurrent-streams", str(2 * IN_FLIGHT))
    fe.wait_serving()
    yield fe
    fe.close()
    procs.stop(engine)


async def one(stub, index: int, rng: random.Random) -> Outcome:
    fate = rng.choice(FATES)
    max_tokens = rng.randint(2, 12)
    prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))]
    seeded = rng.random() < 0.5
    sampling = gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if seeded else 0,
                                  **({"seed": index} if seeded else {}))
    request = gen.GenerateRequest(request_id=f"storm-{index}", token_ids=gen.TokenIds(ids=prompt), sampling=sampling)
    outcome = Outcome(fate, max_tokens)
    timeout = rng.uniform(0.05, 1.5) if fate == "deadline" else 120
    call = stub.Generate(request, timeout=timeout)
    cut_at = {"cancel_mid": rng.randint(1, max_tokens - 1), "cancel_last": max_tokens - 1}.get(fate)
    try:
        if fate == "cancel_early":
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
        if fate == "abort":
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.5), lambda: asyncio.ensure_future(
                stub.Abort(gen.AbortRequest(request_ids=[request.request_id]), timeout=10)))
        async for response in call:
            if response.HasField("chunk"):
                outcome.tokens += len(response.chunk.token_ids)
                if cut_at is not None and outcome.tokens >= cut_at:
                    call.cancel()
            elif response.HasField("finished"):
                outcome.finished = response.finished
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
        outcome.code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.CANCELLED
    return outcome


async def storm(address: str, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        limit = asyncio.Semaphore(IN_FLIGHT)

        async def limited(i: int) -> Outcome:
            async with limit:
                return await one(stub, i, random.Random(rng.random()))

        return await asyncio.gather(*(limited(i) for i in range(NUM_REQUESTS)))


def test_cancellation_storm_loses_nothing(storm_frontend):
    outcomes = asyncio.run(storm(storm_frontend.address, seed=0))
    fates = collections.Counter(o.fate for o in outcomes)
    assert sum(n for fate, n in fates.items() if fate != "complete") >= 0.25 * NUM_REQUESTS, fates
    for o in outcomes:
        full = o.finished is not None and o.finished.reason == FR.FINISH_REASON_LENGTH and o.tokens == o.max_tokens
        if o.fate == "complete":
            assert o.code == grpc.StatusCode.OK and full, o
        elif o.fate == "deadline":
            assert full or o.code == grpc.StatusCode.DEADLINE_EXCEEDED, o
        elif o.fate == "abort":  # aborted in time, or it had finished already
            assert o.code == grpc.StatusCode.OK, o
            assert full or o.finished.reason == FR.FINISH_REASON_ABORTED, o
        else:  # cancelled: its call ended CANCELLED (or it finished just before the cancel)
            assert o.code == grpc.StatusCode.CANCELLED or full, o
    cut = [o for o in outcomes if o.fate.startswith("cancel") and o.code == grpc.StatusCode.CANCELLED]
    assert len(cut) >= 0.15 * NUM_REQUESTS, "too few cancels landed to call it a storm"
    info = storm_frontend.wait_kv_free(timeout_s=15)
    assert info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0 and info.num_waiting == 0
    assert storm_frontend.health_status() == 1  # SERVING


def test_seeded_request_is_deterministic_under_load(storm_frontend):
    """The same seeded request gives the same tokens alone and in a busy batch."""
    request = gen.GenerateRequest(text="Write a short poem about the sea.", sampling=gen.SamplingParams(
        temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True))

    async def run(load: int) -> list[int]:
        async with grpc.aio.insecure_channel(storm_frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            others = [gen.GenerateRequest(token_ids=gen.TokenIds(ids=[200 + i] * (5 + i)), sampling=gen.SamplingParams(
                temperature=0.9, max_tokens=30, ignore_eos=True)) for i in range(load)]
            responses = await asyncio.gather(*(_tokens(stub, r) for r in [request, *others]))
            return responses[0]

    alone = asyncio.run(run(0))
    assert len(alone) == 24
    for load in (8, 31):
        assert asyncio.run(run(load)) == alone, f"different tokens with {load} other requests running"
    storm_frontend.wait_kv_free()


async def _tokens(stub, request: gen.GenerateRequest) -> list[int]:
    tokens = []
    async for response in stub.Generate(request, timeout=120):
        if response.HasField("chunk"):
            tokens += response.chunk.token_ids
    return tokens
