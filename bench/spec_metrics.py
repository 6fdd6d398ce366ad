"""What `bench spec` measures of one run: latency and throughput from the client's side
(bench.serve_metrics), acceptance from the engine's own counters, replies against `off`'s.

The engine's /metrics carries vLLM's speculative-decoding counters (`_total` on the wire):

    pagedserve:spec_decode_num_drafts                 verification steps that had drafts, summed over requests
    pagedserve:spec_decode_num_draft_tokens           tokens proposed
    pagedserve:spec_decode_num_accepted_tokens        proposed tokens the model agreed with
    pagedserve:spec_decode_num_accepted_tokens_per_pos{position}   the same, by draft position

read before and after the timed run. Acceptance rate = accepted / draft tokens; mean acceptance
length = 1 + accepted / drafts (tokens per verification step, the bonus token included); the
rate at position i = accepted at i / drafts.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from bench.serve_metrics import summarize
from bench.spec_workloads import SpecRecord

PREFIX = "pagedserve:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    """One scrape of the counters; `found` is False when the engine exports none (method off,
    or an engine without speculative decoding)."""

    found: bool = False
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    per_pos: dict[int, float] = field(default_factory=dict)


def scrape_spec_counters(url: str) -> SpecCounters:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_spec_counters(response.read().decode())


def parse_spec_counters(text: str) -> SpecCounters:
    """The counters of a Prometheus text page, summed over their series (one per model_name)."""
    from prometheus_client.parser import text_string_to_metric_families
    counters = SpecCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name == sample.name or not name.endswith("_total"):
                continue
            name = name.removesuffix("_total")
            if name in COUNTERS:
                counters.totals[name] += sample.value
                counters.found = True
            elif name == PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                counters.per_pos[pos] = counters.per_pos.get(pos, 0.0) + sample.value
    return counters


def acceptance(before: SpecCounters, after: SpecCounters) -> dict | None:
    """The acceptance figures between two scrapes; None without counters, rates None without drafts."""
    if not after.found:
        return None
    delta = {k: round(after.totals[k] - before.totals[k]) for k in COUNTERS}
    drafts, proposed, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    per_pos = {p: round(v - before.per_pos.get(p, 0.0)) for p, v in sorted(after.per_pos.items())}
    return {
        **delta, "num_accepted_tokens_per_pos": list(per_pos.values()),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_pos": [v / drafts for v in per_pos.values()] if drafts else None,
    }


def run_summary(records: list[SpecRecord], duration_s: float) -> dict:
    """bench.serve_metrics' summary, plus the replies' mean length and finish reasons."""
    done = [r for r in records if r.ok]
    reasons: dict[str, int] = {}
    for r in done:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {**summarize(records, duration_s),
            "mean_output_len": sum(r.num_output_tokens for r in done) / len(done) if done else None,
            "finish_reasons": reasons}


def same_as(records: list[SpecRecord], reference: list[SpecRecord]) -> int:
    """How many replies have exactly the reference run's token ids (request by request)."""
    return sum(r.ok and ref.ok and r.token_ids == ref.token_ids for r, ref in zip(records, reference))


def speedup(run: dict, off: dict | None) -> dict:
    """`off`'s TPOT p50 over this run's (above 1: faster), and output tok/s over `off`'s."""
    if off is None:
        return {"tpot_speedup": None, "output_tok_s_ratio": None}
    mine, base = run["median_tpot_ms"], off["median_tpot_ms"]
    return {"tpot_speedup": base / mine if mine and base else None,
            "output_tok_s_ratio": run["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None}
