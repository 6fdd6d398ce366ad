"""EngineCore's iteration stats and their Prometheus export, the waiting-queue limit, and the
max_model_len that must fit the KV pool. On the bundled model, in-process."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from common.errors import EngineOverloaded
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.metrics import EngineMetrics
from engine.models.loader import eos_token_ids, load_tokenizer

PROMPTS = [[1000 * k + i for i in range(n)] for k, n in enumerate((5, 17, 33), start=1)]  # no shared prefix


def make_core(bundled_path, **overrides) -> EngineCore:
    config = EngineConfig(num_kv_blocks=64, num_threads=1, **overrides)
    return EngineCore(config, eos_token_ids(load_tokenizer(bundled_path)), log_stats=True)


def run_to_end(core: EngineCore) -> list:
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    return outputs


@pytest.fixture(scope="module")
def core(bundled_path):
    return make_core(bundled_path)


def test_iteration_stats_count_every_token_and_request(core):
    core.take_iteration_stats()
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.add_request("gone", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    core.abort_requests(["gone"])
    outputs = run_to_end(core)
    stats = core.take_iteration_stats()
    assert stats.num_generation_tokens == len(outputs) == 12
    assert stats.num_prompt_tokens == sum(map(len, PROMPTS))
    assert len(stats.ttfts_s) == 3 and len(stats.itls_s) == 9
    assert sorted(f.finish_reason for f in stats.finished) == ["abort", "length", "length", "length"]
    aborted = next(f for f in stats.finished if f.finish_reason == "abort")
    assert aborted.queue_s is None and aborted.num_generation_tokens == 0
    assert all(f.queue_s is not None and 0 <= f.queue_s <= f.e2e_s for f in stats.finished if f is not aborted)
    assert len(stats.model_s) == len(stats.schedule_s) == len(stats.iteration_tokens) == 4  # 1 prefill + 3 decodes
    assert stats.iteration_tokens == [sum(map(len, PROMPTS)), 3, 3, 3]
    assert min(stats.ttfts_s) > 0 and min(stats.model_s) > 0
    assert core.take_iteration_stats().num_generation_tokens == 0  # taking resets


def test_metrics_export_what_the_stats_say(core):
    registry = CollectorRegistry()
    metrics = EngineMetrics("test-model", registry)
    core.take_iteration_stats()
    core.add_request("m", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()
    metrics.record(core.stats(), core.take_iteration_stats())

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model_name": "test-model", **labels})

    assert value("pagedserve:num_requests_running") == 1
    assert 0 < value("pagedserve:kv_cache_usage_perc") <= 1
    assert value("pagedserve:time_to_first_token_seconds_count") == 1
    run_to_end(core)
    metrics.record(core.stats(), core.take_iteration_stats())
    assert value("pagedserve:num_requests_running") == 0
    assert value("pagedserve:kv_cache_usage_perc") == 0
    assert value("pagedserve:generation_tokens_total") == 3
    assert value("pagedserve:prompt_tokens_total") == len(PROMPTS[1])
    assert value("pagedserve:request_success_total", finished_reason="length") == 1
    assert value("pagedserve:inter_token_latency_seconds_count") == 2
    assert value("pagedserve:engine_step_seconds_count", phase="sample") == 3
    # cumulative engine counters are exported as increments, never counted twice
    queries = value("pagedserve:prefix_cache_queries_total")
    metrics.record(core.stats(), core.take_iteration_stats())
    assert value("pagedserve:prefix_cache_queries_total") == queries > 0


def test_waiting_queue_limit(bundled_path):
    core = make_core(bundled_path, max_waiting_requests=2)
    params = SamplingParams(temperature=0, max_tokens=2)
    core.add_request("a", PROMPTS[0], params)
    core.add_request("b", PROMPTS[0], params)
    with pytest.raises(EngineOverloaded, match="--max-waiting-requests 2"):
        core.add_request("c", PROMPTS[0], params)
    core.step()  # a and b start running: the queue empties
    core.add_request("c", PROMPTS[0], params)
    run_to_end(core)


def test_max_model_len_never_exceeds_the_kv_pool(bundled_path):
    core = make_core(bundled_path)  # 64 blocks of 16 tokens
    assert core.max_model_len == 64 * 16
    with pytest.raises(ValueError, match="KV cache.s capacity of 1024 tokens"):
        core.add_request("x", list(range(100, 1100)), SamplingParams(max_tokens=100))
