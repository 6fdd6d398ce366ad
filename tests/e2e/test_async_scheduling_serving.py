"""Async scheduling served end to end, on CPU: an engine with `--async-scheduling` behind a
frontend, many gRPC streams at once. Replies equal the offline synchronous engine's token for
token, a stop string the frontend sees and a cancel in flight free their blocks, and nothing is
left running or in flight afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from grpc_client import LONG, STORY, cancel, generate, greedy, request
from common.v1 import generation_pb2 as gen

PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time", "def add(a, b):",
           "The best way to learn", "Water boils at", "My favourite animal is", "In 1969,"]
MAX_TOKENS = [7, 16, 23, 30, 12, 40, 9, 33]  # staggered ends: steps go ahead past some of them


@pytest.fixture(scope="module")
def async_frontend(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address, "--async-scheduling")
    fe = procs.start_frontend(address)
    fe.wait_serving()
    yield fe
    fe.close()
    procs.stop(engine)


@pytest.fixture(scope="module")
def expected(bundled_path):
    """The offline engine, synchronous, as the server runs it (float32, greedy)."""
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=128, async_scheduling=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_concurrent_streams_equal_the_synchronous_engine(async_frontend, expected):
    def one(i: int) -> list[int]:
        return generate(async_frontend, text=PROMPTS[i], sampling=greedy(MAX_TOKENS[i], ignore_eos=True)).tokens[0]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, range(len(PROMPTS))))
    assert got == expected
    async_frontend.wait_kv_free(timeout_s=10)


def test_a_stop_string_and_a_cancel_in_flight_free_their_blocks(async_frontend, expected):
    call = async_frontend.generation.Generate(request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    assert next(call).HasField("started") and next(call).HasField("chunk")
    first = generate(async_frontend, text=PROMPTS[5], sampling=greedy(40, ignore_eos=True))
    stop = first.texts[0][8:14]  # seen by the frontend, which aborts the request in the engine
    stopped = generate(async_frontend, text=PROMPTS[5], sampling=greedy(40, ignore_eos=True, stop=[stop]))
    assert stopped.finished[0].WhichOneof("matched_stop") == "stop_string"
    assert stopped.texts[0] == first.texts[0][:first.texts[0].index(stop)]
    cancel(call)
    async_frontend.wait_kv_free(timeout_s=10)
