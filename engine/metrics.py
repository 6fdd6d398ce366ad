"""The engine's Prometheus metrics, named as vLLM names its `vllm:*` metrics.

    pagedserve:num_requests_running / _waiting     gauges, now
    pagedserve:kv_cache_usage_perc                 gauge, 0..1 (1 = every block in use)
    pagedserve:prefix_cache_queries / _hits        counters, prompt tokens looked up / served
    pagedserve:num_preemptions                     counter
    pagedserve:kv_offload_hits                     counter, prompt tokens restored from the second tier
    pagedserve:kv_offload_saved_bytes / _restored_bytes / _restore_seconds   counters (--kv-offload-gb)
    pagedserve:prompt_tokens / generation_tokens   counters
    pagedserve:request_success{finished_reason}    counter: stop, length, abort or error
    pagedserve:time_to_first_token_seconds, inter_token_latency_seconds,
    e2e_request_latency_seconds, request_queue_time_seconds      histograms, per request
    pagedserve:iteration_tokens                    histogram, tokens computed per step
    pagedserve:engine_step_seconds{phase}          histogram: schedule, model, sample, and grammar
                                                   (structured output's bitmask, within sample)

With speculative decoding on (vLLM's spec_decode counters):

    pagedserve:spec_decode_num_drafts              counter: verification steps with drafts, per request
    pagedserve:spec_decode_num_draft_tokens        counter: tokens proposed and verified
    pagedserve:spec_decode_num_accepted_tokens     counter: of those, accepted
    pagedserve:spec_decode_num_accepted_tokens_per_pos{position}   counter: accepted at draft slot i

(acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts).

Counters get the `_total` suffix on the wire (`pagedserve:num_preemptions_total`).
Every series carries `model_name`, as vLLM's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from engine.stats import SpecDecodingStats

if TYPE_CHECKING:
    from engine.core import EngineStats
    from engine.stats import IterationStats

# Buckets from vLLM's, trimmed to what a CPU or one GPU produces.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
# The prefix cache's second tier: (EngineStats field, metric, help).
OFFLOAD_COUNTERS = (
    ("num_kv_offload_hits", "kv_offload_hits", "Prompt tokens restored from the prefix cache's second tier"),
    ("kv_offload_saved_bytes", "kv_offload_saved_bytes", "Bytes of KV blocks saved to the second tier"),
    ("kv_offload_restored_bytes", "kv_offload_restored_bytes", "Bytes of KV blocks restored from the second tier"),
    ("kv_offload_restore_s", "kv_offload_restore_seconds", "Time spent restoring KV blocks from the second tier"))


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        def make(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
            return kind(f"pagedserve:{name}", doc, ("model_name", *labels), registry=registry, **kw)

        self._running = make(Gauge, "num_requests_running", "Requests running on the engine").labels(model_name)
        self._waiting = make(Gauge, "num_requests_waiting", "Requests waiting to run").labels(model_name)
        self._kv_usage = make(Gauge, "kv_cache_usage_perc",
                              "KV-cache usage, 0 to 1 (1 = every block in use)").labels(model_name)
        self._cache_queries = make(Counter, "prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache").labels(model_name)
        self._cache_hits = make(Counter, "prefix_cache_hits",
                                "Prompt tokens served by the prefix cache").labels(model_name)
        self._preemptions = make(Counter, "num_preemptions", "Preemptions (by recompute)").labels(model_name)
        self._offload = {field: make(Counter, name, doc).labels(model_name) for field, name, doc in OFFLOAD_COUNTERS}
        self._prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that started "
                                   "generating").labels(model_name)
        self._generation_tokens = make(Counter, "generation_tokens", "Tokens generated").labels(model_name)
        success = make(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",))
        self._success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._ttft = make(Histogram, "time_to_first_token_seconds", "Arrival to first token",
                          buckets=TTFT_BUCKETS).labels(model_name)
        self._itl = make(Histogram, "inter_token_latency_seconds", "Time between two tokens of a request",
                         buckets=ITL_BUCKETS).labels(model_name)
        self._e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to finish",
                         buckets=REQUEST_BUCKETS).labels(model_name)
        self._queue = make(Histogram, "request_queue_time_seconds", "Arrival to first scheduled",
                           buckets=REQUEST_BUCKETS).labels(model_name)
        self._iteration_tokens = make(Histogram, "iteration_tokens", "Tokens computed per engine step",
                                      buckets=TOKEN_BUCKETS).labels(model_name)
        step = make(Histogram, "engine_step_seconds", "Engine step time by phase", ("phase",),
                    buckets=STEP_BUCKETS)
        self._phases = {p: step.labels(model_name, p) for p in ("schedule", "model", "sample", "grammar")}
        self._spec = {name: make(Counter, f"spec_decode_{name}", doc).labels(model_name) for name, doc in (
            ("num_drafts", "Speculative decoding: verification steps with drafts, per request"),
            ("num_draft_tokens", "Speculative decoding: draft tokens verified"),
            ("num_accepted_tokens", "Speculative decoding: draft tokens accepted"))}
        self._spec_per_pos = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative decoding: draft tokens accepted at each draft position",
                                  ("position",))
        self._model_name = model_name
        self._last: EngineStats | None = None  # the cumulative counts already exported

    def record(self, snapshot: EngineStats, stats: IterationStats | None) -> None:
        """Gauges from `snapshot`; counters and histograms from what happened since last time."""
        self._running.set(snapshot.num_running)
        self._waiting.set(snapshot.num_waiting)
        used = snapshot.num_kv_blocks - snapshot.num_free_kv_blocks
        self._kv_usage.set(used / snapshot.num_kv_blocks if snapshot.num_kv_blocks else 0.0)
        last = self._last
        self._cache_queries.inc(snapshot.num_prefix_cache_queries - (last.num_prefix_cache_queries if last else 0))
        self._cache_hits.inc(snapshot.num_prefix_cache_hits - (last.num_prefix_cache_hits if last else 0))
        self._preemptions.inc(snapshot.num_preemptions - (last.num_preemptions if last else 0))
        for field, counter in self._offload.items():
            counter.inc(getattr(snapshot, field) - (getattr(last, field) if last else 0))
        if snapshot.spec_decoding is not None:
            self._record_spec(snapshot.spec_decoding, last.spec_decoding if last else None)
        self._last = snapshot
        if stats is not None:
            self._record_iteration(stats)

    def _record_spec(self, now: SpecDecodingStats, before: SpecDecodingStats | None) -> None:
        before = before or SpecDecodingStats()
        self._spec["num_drafts"].inc(now.num_drafts - before.num_drafts)
        self._spec["num_draft_tokens"].inc(now.num_draft_tokens - before.num_draft_tokens)
        self._spec["num_accepted_tokens"].inc(now.num_accepted_tokens - before.num_accepted_tokens)
        done = before.accepted_per_position
        for position, count in enumerate(now.accepted_per_position):
            self._spec_per_pos.labels(self._model_name, str(position)).inc(
                count - (done[position] if position < len(done) else 0))

    def _record_iteration(self, stats: IterationStats) -> None:
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        for phase, values in (("schedule", stats.schedule_s), ("model", stats.model_s),
                              ("sample", stats.sample_s), ("grammar", stats.grammar_s)):
            for v in values:
                self._phases[phase].observe(v)
        for n in stats.iteration_tokens:
            self._iteration_tokens.observe(n)
        for v in stats.ttfts_s:
            self._ttft.observe(v)
        for v in stats.itls_s:
            self._itl.observe(v)
        for f in stats.finished:
            self._success[f.finish_reason].inc()
            self._e2e.observe(f.e2e_s)
            if f.queue_s is not None:
                self._queue.observe(f.queue_s)

