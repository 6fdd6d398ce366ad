"""Data parallel, end to end: one frontend over two real engine processes on loopback
(issue 17). Traffic splits; cache_aware routing beats round_robin on the engines' own
prefix-cache counters; kill -9 of an engine loses no request that had not streamed yet; a
restarted engine gets traffic again; an engine's SIGTERM drain reaches the frontends, which leave
it; `pagedserve serve --data-parallel-size 2` serves."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from grpc_client import Background, collect, generate, greedy, request
from common.v1 import generation_pb2 as gen
from pagedserve.health import ping_engine
from test_operations import metric, read_metrics_url, scrape

pytestmark = pytest.mark.heavy(40)  # seconds on the 2-core CI machine: scheduled first

# Two slots per engine: under load most requests wait, so some have not streamed when one dies.
FLAGS = ("--num-kv-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "2")
PREFIX_TOKENS, SUFFIX_TOKENS = 64, 8  # 4 full blocks shared, then a tail of the request's own


@pytest.fixture(scope="module")
def pool(procs):
    """Engines A and B; a cache_aware frontend and a round_robin one over both."""
    addresses = [f"tcp://127.0.0.1:{procs.free_port()}" for _ in range(2)]
    engines = [procs.start_engine(a, *FLAGS) for a in addresses]
    fes = {}
    for policy in ("cache_aware", "round_robin"):
        fe = procs.start_frontend(addresses[0], "--engine-address", addresses[1], "--routing-policy", policy,
                                  "--metrics-port", "0", "--http-port", "off")
        fe.metrics_url = read_metrics_url(fe.proc)
        fes[policy] = fe
    for fe in fes.values():
        fe.wait_serving()
        _wait_ready(fe, addresses)
    yield addresses, engines, fes
    for fe in fes.values():
        fe.close()
    for engine in engines:
        procs.stop(engine)


def _wait_ready(fe, addresses: list[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape(fe.metrics_url)
        if all(metric(samples, "pagedserve:engine_state", engine=a, state="ready") == 1 for a in addresses):
            return
        time.sleep(0.2)
    raise AssertionError(f"engines {addresses} not all ready on {fe.address}")


def _cache_counters(addresses: list[str]) -> dict[str, tuple[int, int]]:
    """Each engine's own prefix-cache (queries, hits) in tokens, from its Pong."""
    out = {}
    for address in addresses:
        stats = ping_engine(address, timeout_s=5).stats
        out[address] = (stats.prefix_cache_queries, stats.prefix_cache_hits)
    return out


def _workload(first_token: int, num_groups: int = 4, per_group: int = 4) -> list[list[int]]:
    """Group-major prompts: each group shares a 4-block prefix; every prompt has its own tail."""
    prompts = []
    for g in range(num_groups):
        prefix = [first_token + g * 500 + i for i in range(PREFIX_TOKENS)]
        for r in range(per_group):
            tail = [first_token + 10_000 + (g * per_group + r) * SUFFIX_TOKENS + i for i in range(SUFFIX_TOKENS)]
            prompts.append(prefix + tail)
    return prompts


def _hit_rate(fe, addresses: list[str], prompts: list[list[int]]) -> tuple[float, dict[str, int]]:
    """Run the prompts one by one; the engines' prefix-cache hit rate over them, and the
    queried tokens per engine."""
    before = _cache_counters(addresses)
    for prompt in prompts:
        generate(fe, token_ids=gen.TokenIds(ids=prompt), sampling=greedy(1))
    after = _cache_counters(addresses)
    queries = {a: after[a][0] - before[a][0] for a in addresses}
    hits = sum(after[a][1] - before[a][1] for a in addresses)
    return hits / sum(queries.values()), queries


def test_cache_aware_splits_traffic_and_beats_round_robin(pool):
    addresses, _, fes = pool
    rr_rate, rr_queries = _hit_rate(fes["round_robin"], addresses, _workload(1000))
    ca_rate, ca_queries = _hit_rate(fes["cache_aware"], addresses, _workload(20_000))
    print(f"prefix-cache hit rate: cache_aware {ca_rate:.3f}, round_robin {rr_rate:.3f}")
    # Each engine did its share: groups spread over both, not piled on one.
    total = sum(ca_queries.values())
    assert all(q >= total / 4 for q in ca_queries.values()), ca_queries
    assert all(q > 0 for q in rr_queries.values()), rr_queries
    # cache_aware: one miss per group (12 of 16 prompts hit 64 of 72 tokens); round_robin: two.
    assert ca_rate == pytest.approx(12 * 64 / (16 * 72))
    assert rr_rate < ca_rate
    samples = scrape(fes["cache_aware"].metrics_url)
    routed = {a: metric(samples, "pagedserve:router_requests_routed_total", engine=a) for a in addresses}
    assert sum(routed.values()) == 16 and min(routed.values()) >= 4, routed
    assert sum(metric(samples, "pagedserve:router_prefix_hits_total", engine=a) for a in addresses) == 12
    assert sum(metric(samples, "pagedserve:router_prefix_hit_tokens_total", engine=a) for a in addresses) == 12 * 64


def test_kill_9_loses_no_request_that_had_not_streamed(pool, procs):
    addresses, engines, fes = pool
    fe = fes["cache_aware"]
    # Short prompts (no full block) go to the least loaded engine: both get their share.
    streams = [Background(fe, request(text=f"Count from {i} to {i + 30}:", sampling=greedy(24, ignore_eos=True)),
                          timeout=120) for i in range(12)]
    streams[0].wait_first_chunk()
    time.sleep(0.3)
    engines[0].send_signal(signal.SIGKILL)
    engines[0].wait()
    for s in streams:
        s.join(timeout_s=120)
    failed = [s for s in streams if s.error is not None]
    for s in failed:  # only one that had streamed may fail, and then with UNAVAILABLE
        assert s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
        assert s.messages, f"a request that had not streamed failed: {s.error}"
    for s in streams:
        if s.error is None:
            assert len(collect(s.messages).tokens[0]) == 24
    samples = scrape(fe.metrics_url)
    retried = metric(samples, "pagedserve:router_retries_total", engine=addresses[0], reason="lost")
    print(f"kill -9: {len(streams) - len(failed)} completed, {len(failed)} UNAVAILABLE after streaming, "
          f"{retried:.0f} moved to the other engine")
    assert retried > 0, "no request was waiting on the killed engine: the test proved nothing"
    assert metric(samples, "pagedserve:engine_state", engine=addresses[0], state="lost") == 1
    fe.wait_serving()  # B still serves

    # The restarted engine (same address) rejoins by itself and gets traffic again.
    engines[0] = procs.start_engine(addresses[0], *FLAGS)
    _wait_ready(fe, addresses)
    before = metric(scrape(fe.metrics_url), "pagedserve:router_requests_routed_total", engine=addresses[0])
    queries_before = _cache_counters(addresses[:1])[addresses[0]][0]
    for i in range(4):
        generate(fe, text=f"Say {i}", sampling=greedy(2))
    after = metric(scrape(fe.metrics_url), "pagedserve:router_requests_routed_total", engine=addresses[0])
    assert after - before >= 1
    assert _cache_counters(addresses[:1])[addresses[0]][0] > queries_before  # the engine itself saw them


def test_sigterm_engine_drains_and_the_frontends_leave_it(pool):
    """An engine's SIGTERM reaches the frontends in its heartbeat: they send it nothing new and,
    with nothing of theirs left on it, say Bye, so it stops well before its 30 s drain timeout."""
    addresses, engines, fes = pool
    fe = fes["cache_aware"]
    before = metric(scrape(fe.metrics_url), "pagedserve:router_requests_routed_total", engine=addresses[0])
    started = time.monotonic()
    engines[1].send_signal(signal.SIGTERM)
    assert engines[1].wait(20) == 0
    assert time.monotonic() - started < 15
    for i in range(3):
        assert len(generate(fe, text=f"Name {i} colours:", sampling=greedy(2)).tokens[0]) == 2
    after = metric(scrape(fe.metrics_url), "pagedserve:router_requests_routed_total", engine=addresses[0])
    assert after - before == 3
    fe.wait_serving()


def test_serve_data_parallel_size_2(procs):
    port = procs.free_port(span=2)  # the two engines listen on port and port + 1
    proc = procs.pagedserve("serve", "--engine-address", f"tcp://127.0.0.1:{port}", "--data-parallel-size", "2",
                            "--grpc-port", "0", "--http-port", "off", "--dtype", "float32", "--num-kv-blocks", "128",
                            "--max-model-len", "512", "--num-threads", "1")
    fe = procs.Frontend(proc, procs.read_grpc_address(proc))
    try:
        fe.wait_serving()
        info = fe.server_info()
        assert [e.address for e in info.engines] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
        deadline = time.monotonic() + 60
        while not all(e.id for e in fe.server_info().engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fe.server_info().kv_blocks_total == 256  # both engines' pools
        for i in range(2):
            assert len(generate(fe, text=f"Hello {i}", sampling=greedy(3)).tokens[0]) == 3
    finally:
        fe.close()
