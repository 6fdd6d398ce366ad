"""Sleep, wake and weight updates over HTTP and gRPC, end to end: an engine process on a tiny
Llama (the bundled tokenizer's vocabulary) and a frontend with --api-key. The admin routes need
the key; while asleep, the openai SDK gets a 503 with Retry-After and gRPC Generate UNAVAILABLE,
the engine's RSS drops by its KV cache, a stream running at the sleep finishes after the wake
with the tokens it would have had, and greedy output is the same after the wake. An update
serves what the offline `LLM` serves on the new checkpoint; one of another shape, or a missing
path, is a 400 and the old weights keep serving. Nothing leaks (wait_kv_free)."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest

from common.v1 import admin_pb2, admin_pb2_grpc
from grpc_client import generate_error, greedy, request

KEY = "sleep-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEY_METADATA = [("authorization", f"Bearer {KEY}")]
PROMPT = "Once upon a time, in a small village,"
# ~64 MiB of KV (8 KiB a block for this model in float32): a drop the RSS shows plainly
ENGINE = ["--model", "", "--num-kv-blocks", "8192", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def checkpoints(weight_checkpoints):
    return weight_checkpoints


@pytest.fixture(scope="module")
def server(procs, checkpoints):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    flags = list(ENGINE)
    flags[1] = str(checkpoints["a"])
    engine = procs.start_engine(address, *flags)
    fe = procs.start_frontend(address, "--api-key", KEY)
    try:
        fe.wait_serving()
        fe.engine_pid, fe.admin = engine.pid, admin_pb2_grpc.AdminStub(fe.channel)
        fe.client = openai.OpenAI(base_url=f"{fe.http_url}/v1", api_key=KEY, max_retries=0)
        yield fe
    finally:
        fe.close()
        procs.stop(engine)


def complete(fe, max_tokens: int = 8) -> str:
    return fe.client.completions.create(model=fe.client.models.list().data[0].id, prompt=PROMPT,
                                        max_tokens=max_tokens, temperature=0).choices[0].text


def admin(fe, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{fe.http_url}{path}", headers=AUTH, timeout=120, **kwargs)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_admin_routes_need_the_key(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/update_weights")):
        response = httpx.request(method, f"{server.http_url}{path}", timeout=10)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(grpc.RpcError) as info:
        server.admin.Sleep(admin_pb2.SleepRequest(level=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert admin(server, "GET", "/is_sleeping").json() == {"is_sleeping": False, "level": 0}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_new_requests_and_wakes_the_same(server, level):
    """Level 1 over HTTP, level 2 over gRPC."""
    before, rss_awake = complete(server), rss_mib(server.engine_pid)
    for _ in range(2):  # twice: still asleep
        if level == 1:
            assert admin(server, "POST", "/sleep?level=1").json() == {"is_sleeping": True, "level": 1}
        else:
            state = server.admin.Sleep(admin_pb2.SleepRequest(level=2), metadata=KEY_METADATA, timeout=120)
            assert state.is_sleeping and state.level == 2
    assert rss_awake - rss_mib(server.engine_pid) > 40  # the 64 MiB KV cache went back to the system
    with pytest.raises(openai.APIStatusError) as info:
        complete(server)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert "asleep" in info.value.response.json()["error"]["message"]
    error = generate_error(server, request(text=PROMPT, sampling=greedy(4)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert httpx.get(f"{server.http_url}/health", timeout=10).status_code == 200  # alive, only asleep
    state = server.admin.IsSleeping(admin_pb2.IsSleepingRequest(), metadata=KEY_METADATA)
    assert state.is_sleeping and state.level == level
    if level == 1:
        assert admin(server, "POST", "/wake_up").json() == {"is_sleeping": False, "level": 0}
        assert admin(server, "POST", "/wake_up").status_code == 200  # twice: still awake
    else:
        for _ in range(2):
            assert not server.admin.WakeUp(admin_pb2.WakeUpRequest(), metadata=KEY_METADATA, timeout=120).is_sleeping
    assert complete(server) == before
    server.wait_kv_free()


def test_a_stream_running_at_the_sleep_finishes_after_the_wake(server):
    want = complete(server, max_tokens=300)
    model = server.client.models.list().data[0].id
    text, first = [], threading.Event()

    def stream() -> None:
        for chunk in server.client.completions.create(model=model, prompt=PROMPT, max_tokens=300, temperature=0,
                                                      stream=True):
            text.append(chunk.choices[0].text)
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    assert admin(server, "POST", "/sleep?level=1").status_code == 200
    deadline = time.monotonic() + 10
    while (info := server.server_info()).num_running and time.monotonic() < deadline:  # the stats of a Pong
        time.sleep(0.1)
    assert info.num_waiting == 1 and not info.num_running  # preempted, waiting for the wake
    assert reader.is_alive()
    assert admin(server, "POST", "/wake_up").status_code == 200
    reader.join(60)
    assert "".join(text) == want
    server.wait_kv_free()


def test_update_weights(server, checkpoints):
    from common.sampling_params import SamplingParams
    from pagedserve import LLM
    offline = LLM(str(checkpoints["b"]), dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    before = complete(server)
    assert before != want
    for path, words in ((checkpoints["wide"], "does not fit the live model"), ("/no/such/model", "does not exist")):
        response = admin(server, "POST", "/update_weights", json={"model_path": str(path)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert words in error["message"] and error["param"] == "model_path"
        assert complete(server) == before  # the old weights keep serving
    with pytest.raises(grpc.RpcError) as info:
        server.admin.UpdateWeights(admin_pb2.UpdateWeightsRequest(model_path="/no/such/model"),
                                   metadata=KEY_METADATA)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    response = admin(server, "POST", "/update_weights", json={"model_path": str(checkpoints["b"])})
    assert response.status_code == 200, response.text
    assert complete(server) == want
    server.wait_kv_free()
