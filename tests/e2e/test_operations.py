"""Operating a server, end to end with real processes: Prometheus metrics on both processes,
admission control, deadlines, time limits, graceful drain on SIGTERM, request logs."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from grpc_client import (FR, GENERATION, LONG, NOT_SERVING, STORY, Background, collect, generate,
                         generate_error, greedy, request)
from common.v1 import engine_ipc_pb2 as ipc, generation_pb2 as gen

pytestmark = pytest.mark.heavy(60)  # seconds on the 2-core CI machine: scheduled first

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels without model_name)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def read_metrics_url(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """The `metrics listening on URL` line, from the drained log or the pipe itself."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = list(getattr(proc, "log", ()))
        if not hasattr(proc, "log"):
            lines = [proc.stdout.readline()]
        for line in lines:
            match = re.search(r"metrics listening on (\S+)", line)
            if match:
                return match.group(1)
        time.sleep(0.1)
    raise AssertionError("no `metrics listening on` line")


@pytest.fixture(scope="module")
def metered(procs):
    """An engine and a frontend that both serve /metrics; the engine queues at most 1 request
    and runs 2 at once, so admission control is easy to reach."""
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.pagedserve("engine", "--address", address, "--dtype", "float32", "--num-kv-blocks", "256",
                              "--max-model-len", "1024", "--num-threads", "1", "--metrics-port", "0",
                              "--max-num-seqs", "2", "--max-waiting-requests", "1")
    engine_url = read_metrics_url(engine)
    procs.drain(engine)
    fe = procs.start_frontend(address, "--metrics-port", "0")
    fe.engine_url, fe.frontend_url = engine_url, read_metrics_url(fe.proc)
    fe.wait_serving()
    yield fe
    fe.close()
    procs.stop(engine)


def test_metrics_move_with_traffic(metered):
    engine0, frontend0 = scrape(metered.engine_url), scrape(metered.frontend_url)
    assert metric(frontend0, "pagedserve:engine_connected") == 1
    long_stream = Background(metered, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
    long_stream.wait_first_chunk()
    during_e, during_f = scrape(metered.engine_url), scrape(metered.frontend_url)
    assert metric(during_e, "pagedserve:num_requests_running") == 1
    assert 0 < metric(during_e, "pagedserve:kv_cache_usage_perc") < 1
    assert metric(during_f, "pagedserve:active_streams", api="grpc") == 1
    # The frontend repeats the engine's live figures, so one scrape shows the whole server.
    assert metric(during_f, "pagedserve:num_requests_running") == 1
    assert 0 < metric(during_f, "pagedserve:kv_cache_usage_perc") < 1
    results = [generate(metered, text=f"Count to {i}:", sampling=greedy(5)) for i in range(3)]
    # A stop string (matched by the frontend) counts as a stop in the engine, not an abort.
    stopped = generate(metered, text="Count: 1, 2, 3,", sampling=gen.SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop=[","]))
    assert stopped.finished[0].reason == gen.FINISH_REASON_STOP_STRING
    generate_error(metered, request(text="Hi", sampling=gen.SamplingParams(temperature=-1)))
    long_stream.call.cancel()
    long_stream.join()
    metered.wait_kv_free(timeout_s=10)
    time.sleep(0.7)  # the idle engine loop records metrics every 0.5 s
    after_e, after_f = scrape(metered.engine_url), scrape(metered.frontend_url)

    def grew(name: str, **labels: str) -> float:
        return metric(after_e, name, **labels) - metric(engine0, name, **labels)

    long_tokens = sum(len(t) for t in collect_partial(long_stream).values())
    assert grew("pagedserve:request_success_total", finished_reason="length") == 3
    assert grew("pagedserve:request_success_total", finished_reason="stop") == 1
    assert grew("pagedserve:request_success_total", finished_reason="abort") == 1
    assert grew("pagedserve:generation_tokens_total") >= 15 + long_tokens
    assert grew("pagedserve:prompt_tokens_total") == sum(r.started.prompt_tokens for r in [*results, stopped]) + 10
    assert grew("pagedserve:time_to_first_token_seconds_count") == 5
    assert grew("pagedserve:e2e_request_latency_seconds_count") == 5
    assert grew("pagedserve:request_queue_time_seconds_count") == 5
    assert grew("pagedserve:inter_token_latency_seconds_count") >= 3 * 4
    assert grew("pagedserve:prefix_cache_queries_total") > 0
    assert grew("pagedserve:iteration_tokens_count") == grew("pagedserve:engine_step_seconds_count", phase="model")
    assert grew("pagedserve:engine_step_seconds_sum", phase="model") > 0
    assert metric(after_e, "pagedserve:num_requests_running") == 0
    assert metric(after_e, "pagedserve:kv_cache_usage_perc") == 0

    def grew_f(name: str, **labels: str) -> float:
        return metric(after_f, name, **labels) - metric(frontend0, name, **labels)

    assert grew_f("pagedserve:grpc_requests_total", method="Generate", code="OK") == 4
    assert grew_f("pagedserve:grpc_requests_total", method="Generate", code="CANCELLED") == 1
    assert grew_f("pagedserve:grpc_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert metric(after_f, "pagedserve:active_streams", api="grpc") == 0


def collect_partial(stream: Background) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for m in stream.messages:
        if m.HasField("chunk"):
            tokens.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
    return tokens


def fill_both_seats(fe) -> list[Background]:
    # One at a time: sent together, the second would find the first still in the one-place queue.
    running = []
    for i in range(2):
        running.append(Background(fe, request(text=f"{STORY} {i}", sampling=gen.SamplingParams(**LONG)),
                                  timeout=120))
        running[-1].wait_first_chunk()
    return running


def test_full_queue_is_resource_exhausted_with_a_retry_hint(metered):
    # --max-num-seqs 2 and --max-waiting-requests 1: two run, one waits, the fourth is refused.
    running = fill_both_seats(metered)
    waiting = Background(metered, request(text=STORY, sampling=greedy(4)), timeout=120)
    deadline = time.monotonic() + 10
    while metered.server_info().num_waiting != 1:
        assert time.monotonic() < deadline, "the third request never queued"
        time.sleep(0.05)
    call = metered.generation.Generate(request(text="Hello", sampling=greedy(2)), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-waiting-requests 1" in info.value.details()
    assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
    for stream in running:
        stream.call.cancel()
        stream.join()
    waiting.join()
    assert collect(waiting.messages).finished[0].reason == FR.FINISH_REASON_LENGTH  # it ran once seats freed
    metered.wait_kv_free(timeout_s=10)


def test_deadline_while_queued_frees_the_queue(metered):
    running = fill_both_seats(metered)
    error = generate_error(metered, request(text=STORY, sampling=greedy(4)), timeout=1.0)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while metered.server_info().num_waiting:
        assert time.monotonic() < deadline, "the expired request still waits in the engine"
        time.sleep(0.05)
    for stream in running:
        stream.call.cancel()
        stream.join()
    metered.wait_kv_free(timeout_s=10)


def test_time_limit_ends_with_time_limit_and_frees_blocks(metered):
    started = time.monotonic()
    r = generate(metered, text=STORY, sampling=gen.SamplingParams(**LONG), time_limit_ms=800)
    elapsed = time.monotonic() - started
    assert r.finished[0].reason == FR.FINISH_REASON_TIME_LIMIT
    assert 0 < r.finished[0].usage.completion_tokens < LONG["max_tokens"]
    assert 0.8 <= elapsed < 5, elapsed
    metered.wait_kv_free(timeout_s=5)


def test_time_limit_is_validated(metered):
    error = generate_error(metered, request(text="Hi", sampling=greedy(2), time_limit_ms=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "time_limit_ms" in error.details()


def test_request_log_line(metered):
    generate(metered, request_id="log-me", text="A secret prompt", sampling=greedy(3))
    deadline = time.monotonic() + 5
    while not any("request_id=log-me" in line for line in metered.proc.log):
        assert time.monotonic() < deadline, "no request log line"
        time.sleep(0.05)
    [line] = [line for line in metered.proc.log if "request_id=log-me" in line]
    assert "pagedserve.requests" in line
    for field in ("code=OK", "finish_reason=length", "completion_tokens=3", "ttft_ms=", "e2e_ms=",
                  "prompt_tokens="):
        assert field in line, line
    assert "secret" not in line  # prompts are logged only with --log-prompts


# -- graceful drain --------------------------------------------------------------------------

def test_sigterm_drains_frontend_then_engine(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = procs.start_frontend(address, "--drain-timeout-s", "60")
    try:
        fe.wait_serving()
        streams = [Background(fe, request(text=f"{STORY} {i}", sampling=gen.SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True)), timeout=120) for i in range(2)]
        for stream in streams:
            stream.wait_first_chunk()
        fe.proc.send_signal(signal.SIGTERM)
        engine.send_signal(signal.SIGTERM)  # as compose does: both at once
        time.sleep(0.3)
        assert fe.health_status("") == NOT_SERVING and fe.health_status(GENERATION) == NOT_SERVING
        refused = generate_error(fe, request(text="Hello", sampling=greedy(2)))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
        for stream in streams:  # the in-flight ones finish in full
            stream.join(timeout_s=60)
            assert stream.error is None, stream.error
            r = collect(stream.messages)
            assert r.finished[0].reason == FR.FINISH_REASON_LENGTH and len(r.tokens[0]) == 40
        assert fe.proc.wait(30) == 0, procs.log_tail(fe.proc)
        assert engine.wait(30) == 0, procs.log_tail(engine)
    finally:
        fe.close()
        procs.stop(engine)


def test_drain_timeout_cuts_long_streams(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = procs.start_frontend(address, "--drain-timeout-s", "1")
    try:
        fe.wait_serving()
        stream = Background(fe, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
        stream.wait_first_chunk()
        fe.proc.send_signal(signal.SIGTERM)
        assert fe.proc.wait(15) == 0, procs.log_tail(fe.proc)
        stream.join()
        assert stream.error is not None  # cut off: no Finished
        # The frontend said Bye, so the engine freed the request at once: a new frontend sees it idle.
        fe2 = procs.start_frontend(address)
        try:
            fe2.wait_serving()
            fe2.wait_kv_free(timeout_s=5)
        finally:
            fe2.close()
    finally:
        fe.close()
        procs.stop(engine)


class _StrayFrontend(threading.Thread):
    """A frontend left over from an earlier run (issue 44), on a real socket with the real
    protocol: every 0.5 s a Ping, and with `reconnects` a Hello too (it never takes in the
    Welcome). It never says Bye, whatever its Pongs say."""

    def __init__(self, address: str, engine_id: str, reconnects: bool) -> None:
        super().__init__(daemon=True)
        self.address, self.engine_id, self.reconnects = address, engine_id, reconnects
        self.welcomed, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"stray")
        sock.connect(self.address)
        hello = ipc.EngineRequest(hello=ipc.Hello(frontend_id="stray")).SerializeToString()
        seq = 0
        while not self.done.is_set():
            if self.reconnects or not self.welcomed.is_set():
                sock.send(hello)
            seq += 1
            sock.send(ipc.EngineRequest(ping=ipc.Ping(seq=seq)).SerializeToString())
            next_beat = time.monotonic() + 0.5
            while (left_s := next_beat - time.monotonic()) > 0:
                if sock.poll(int(left_s * 1000) + 1):
                    reply = ipc.EngineResponse.FromString(sock.recv())
                    if reply.WhichOneof("kind") == "welcome" and reply.welcome.engine_id == self.engine_id:
                        self.welcomed.set()  # from our engine, not another run's on a reused port
        sock.close()
        ctx.term()


def _engine_id(engine: subprocess.Popen, timeout_s: float = 120) -> str:
    """The id in the engine's `engine ID listening on ADDRESS` line, once it is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(engine.log):
            match = re.search(r"engine (\w+) listening on", line)
            if match:
                return match.group(1)
        assert engine.poll() is None, "".join(engine.log)
        time.sleep(0.1)
    raise AssertionError("the engine never listened")


@pytest.mark.parametrize("reconnects", [True, False], ids=["reconnects", "heartbeats"])
def test_engine_drain_ends_within_its_timeout_whatever_connects(procs, reconnects):
    """The drain timeout is the promise an orchestrator's grace period is sized for: the process
    is gone by then (and a slack), however a stray frontend keeps talking to it."""
    drain_timeout_s, slack_s = 2, 3
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address, "--drain-timeout-s", str(drain_timeout_s))
    stray = _StrayFrontend(address, _engine_id(engine), reconnects)
    stray.start()
    try:
        assert stray.welcomed.wait(120), procs.log_tail(engine)
        time.sleep(1)  # a few heartbeats: it is one of the engine's frontends
        started = time.monotonic()
        engine.send_signal(signal.SIGTERM)
        try:
            code = engine.wait(drain_timeout_s + slack_s)
        except subprocess.TimeoutExpired:
            code = None
        took_s = time.monotonic() - started
        assert code == 0, f"engine still running {took_s:.1f}s after SIGTERM\n" + procs.log_tail(engine)
    finally:
        stray.done.set()
        stray.join(timeout=5)
        procs.stop(engine)


def test_serve_exits_when_its_engine_cannot_start(procs, tmp_path):
    # A folder that passes the check before start-up (a supported config.json, a weights file)
    # and fails to load in the engine: its safetensors file is no safetensors.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    proc = procs.pagedserve("serve", "--grpc-port", "0", "--http-port", "0", "--engine-address",
                            f"tcp://127.0.0.1:{procs.free_port()}", "--model", str(tmp_path))
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("serve kept running without its engine") from None
    output = proc.stdout.read()
    assert code != 0, output
    assert "engine exited with code" in output, output


def test_help_documents_operations_flags():
    for command, flags in (("serve", ["--drain-timeout-s", "--metrics-port", "--engine-metrics-port",
                                      "--max-waiting-requests", "--max-concurrent-streams", "--log-level",
                                      "--log-prompts"]),
                           ("engine", ["--drain-timeout-s", "--metrics-port", "--max-waiting-requests"]),
                           ("frontend", ["--drain-timeout-s", "--metrics-port", "--log-prompts"])):
        out = subprocess.run([sys.executable, "-m", "pagedserve", command, "--help"], capture_output=True,
                             text=True, timeout=60).stdout
        assert all(f in out for f in flags), (command, [f for f in flags if f not in out])
