"""What `bench serve` reports about one run: throughput, latency percentiles, goodput.

Definitions (vLLM's benchmark_serving):
- TTFT: send to the first token. E2E: send to the end of the stream.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one token have none.
- ITL: the gaps between consecutive tokens, pooled over all requests (tokens that share
  a Chunk count as gaps of 0).
- Goodput: completed requests per second that met every given SLO (ttft, tpot, e2e, in ms).
Only completed requests enter latencies and token counts; failed ones are counted by code.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from bench.load import RequestRecord

STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SLO_METRICS = ("ttft", "tpot", "e2e")


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; raises ValueError."""
    slos = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: expected METRIC:MILLISECONDS, e.g. ttft:500") from None
        if not slos[name] > 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be > 0 ms")
    return slos


def tpot_ms(record: RequestRecord) -> float | None:
    n = record.num_output_tokens
    return (record.e2e_s - record.ttft_s) * 1000 / (n - 1) if n > 1 else None


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request meets an SLO it has no value for (TPOT of a one-token reply)."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s * 1000, "tpot": tpot_ms(record), "e2e": record.e2e_s * 1000}
    return all(values[name] is None or values[name] <= limit for name, limit in slos.items())


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """Aggregates over the completed requests; latencies in ms."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    latencies = {
        "ttft_ms": [r.ttft_s * 1000 for r in done if r.num_output_tokens],
        "tpot_ms": [t for t in map(tpot_ms, done) if t is not None],
        "itl_ms": [(b - a) * 1000 for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:])],
        "e2e_ms": [r.e2e_s * 1000 for r in done],
    }
    summary = {
        "completed": len(done), "failed": len(records) - len(done),
        "errors": dict(collections.Counter(r.code for r in records if not r.ok)),
        "duration_s": duration_s, "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_tok_s": output_tokens / duration_s,
        "total_tok_s": (output_tokens + prompt_tokens) / duration_s,
    }
    for name, values in latencies.items():
        summary.update(latency_stats(name, values))
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        summary.update({"goodput_slos_ms": dict(slos), "good_requests": good,
                        "goodput_req_s": good / duration_s})
    return summary


def latency_stats(name: str, values: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of `values` as {"mean_<name>": ...}; None when empty."""
    if not values:
        return {f"{stat}_{name}": None for stat in STATS}
    v = np.asarray(values, dtype=float)
    return {f"mean_{name}": float(v.mean()), f"median_{name}": float(np.median(v)),
            f"p90_{name}": float(np.percentile(v, 90)), f"p99_{name}": float(np.percentile(v, 99))}


def rate_label(rate: float) -> str:
    """2.0 -> "2", 0.5 -> "0.5", inf -> "inf": for file names, tables and plot labels."""
    return "inf" if math.isinf(rate) else f"{rate:g}"
