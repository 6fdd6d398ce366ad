"""`bench serve`'s parts without a server: arrivals, datasets, metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.datasets import (MIN_TOKEN_ID, SHAREGPT_SAMPLE, length_range, load_sharegpt,
                            prefix_repetition_requests, random_requests, sharegpt_requests)
from bench.load import RequestRecord, arrival_offsets_s
from bench.serve_metrics import latency_stats, meets_slos, parse_goodput, summarize

VOCAB = 1000


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


# --- arrivals ---------------------------------------------------------------------------

def test_arrivals_are_seeded_and_start_at_zero():
    a = arrival_offsets_s(100, 2.0, 1.0, seed=7)
    assert a == arrival_offsets_s(100, 2.0, 1.0, seed=7)
    assert a != arrival_offsets_s(100, 2.0, 1.0, seed=8)
    assert a[0] == 0.0 and len(a) == 100
    assert all(x <= y for x, y in zip(a, a[1:]))


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_mean_gap_is_one_over_rate(rate, burstiness):
    gaps = _gaps(arrival_offsets_s(20_001, rate, burstiness, seed=0))
    # 20,000 gamma samples: the mean's relative standard error is 1/sqrt(20000 * k) < 1.5%.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)


def test_poisson_gaps_are_exponential():
    gaps = _gaps(arrival_offsets_s(20_001, 2.0, 1.0, seed=1))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # CV of an exponential is 1


def test_burstiness_changes_variance_not_mean():
    gaps = {b: _gaps(arrival_offsets_s(20_001, 1.0, b, seed=2)) for b in (0.25, 1.0, 4.0)}
    assert all(g.mean() == pytest.approx(1.0, rel=0.05) for g in gaps.values())
    cv = {b: g.std() / g.mean() for b, g in gaps.items()}
    # Gamma with shape k: CV = 1/sqrt(k).
    for b, value in cv.items():
        assert value == pytest.approx(1 / math.sqrt(b), rel=0.08)
    assert cv[0.25] > cv[1.0] > cv[4.0]


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets_s(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_offsets_s(0, 1.0, 1.0, seed=0) == []


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_rate_or_burstiness_is_refused(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets_s(3, rate, burstiness, seed=0)


# --- datasets ---------------------------------------------------------------------------

def test_length_range_follows_vllm():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(3, 0.9) == (1, 6)  # never below one token
    with pytest.raises(ValueError):
        length_range(100, 1.0)


def test_random_requests_lengths_and_ids():
    reqs = random_requests(500, 40, 20, 0.5, VOCAB, seed=3)
    assert all(20 <= r.prompt_len <= 60 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(MIN_TOKEN_ID <= t < VOCAB for r in reqs for t in r.prompt)
    # The whole range is used, not just its middle.
    assert {min(r.prompt_len for r in reqs), max(r.prompt_len for r in reqs)} == {20, 60}
    assert reqs == random_requests(500, 40, 20, 0.5, VOCAB, seed=3)
    assert reqs != random_requests(500, 40, 20, 0.5, VOCAB, seed=4)


def test_random_requests_without_range_have_exact_lengths():
    reqs = random_requests(10, 16, 8, 0.0, VOCAB, seed=0)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(16, 8)}


def test_prefix_repetition_prompts_share_their_prefixes():
    reqs = prefix_repetition_requests(20, 32, 8, 4, 5, VOCAB, seed=0)
    assert len(reqs) == 20
    assert all(len(r.prompt) == r.prompt_len == 40 and r.output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 4
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [5, 5, 5, 5]
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 20  # every suffix its own
    assert prefixes[:5] != [prefixes[0]] * 5  # shuffled: one prefix does not arrive in a run


def _word_count(text: str, add_special_tokens: bool) -> int:
    return len(text.split()) + (1 if add_special_tokens else 0)


def test_sharegpt_filters_caps_and_oversamples(tmp_path):
    pairs = [("too short", "a reply"),  # 3 "tokens" with the special one: skipped
             ("one two three four five", "six seven eight"),
             ("a b c d e f g h i j", " ".join(["w"] * 50)),  # 11 + 50 > 40: too long, or capped
             ("p q r s t", "u v w x y z")]
    reqs, usable = sharegpt_requests(pairs, 2, _word_count, max_model_len=40, output_len_cap=None, seed=0)
    assert usable == 2 and len(reqs) == 2
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(6, 3), (6, 6)]
    capped, usable = sharegpt_requests(pairs, 6, _word_count, max_model_len=40, output_len_cap=4, seed=0)
    assert usable == 3 and len(capped) == 6  # three drawn again
    assert all(r.output_len <= 4 for r in capped)
    assert {r.prompt for r in capped} == {p for p, _ in pairs[1:]}


def test_sharegpt_loader_skips_conversations_without_reply_and_rejects_bad_files(tmp_path):
    good = tmp_path / "d.json"
    good.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi there, how are you"},
                           {"from": "gpt", "value": "fine"}]},
        {"conversations": [{"from": "human", "value": "no answer"}]},
        {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}]))
    assert load_sharegpt(good) == [("hi there, how are you", "fine")]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="list"):
        load_sharegpt(bad)
    with pytest.raises(ValueError, match="no usable"):
        sharegpt_requests([("a", "b")], 1, _word_count, 100, None, seed=0)


def test_bundled_sharegpt_sample_is_usable(bundled_tokenizer):
    pairs = load_sharegpt(SHAREGPT_SAMPLE)

    def count(text: str, add_special_tokens: bool) -> int:
        return len(bundled_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    reqs, usable = sharegpt_requests(pairs, len(pairs), count, max_model_len=2048, output_len_cap=None, seed=0)
    assert usable >= 30
    lengths = [r.prompt_len for r in reqs]
    assert max(lengths) > 3 * min(lengths)  # short and long prompts
    assert all(1 <= r.output_len <= 210 for r in reqs)


# --- metrics ----------------------------------------------------------------------------

def _record(ttft_s: float, gaps_s: list[float], ok: bool = True, code: str = "OK") -> RequestRecord:
    times = [ttft_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    return RequestRecord(prompt_tokens=10, expected_output_tokens=len(times), ok=ok, code=code,
                         ttft_s=ttft_s, e2e_s=times[-1], token_times_s=times)


def test_latency_stats_on_known_values():
    stats = latency_stats("x_ms", list(range(1, 101)))
    assert stats == pytest.approx({"mean_x_ms": 50.5, "median_x_ms": 50.5, "p90_x_ms": 90.1, "p99_x_ms": 99.01})
    assert latency_stats("x_ms", []) == {"mean_x_ms": None, "median_x_ms": None, "p90_x_ms": None,
                                         "p99_x_ms": None}


def test_summarize_hand_made_records():
    records = [_record(0.1, [0.02, 0.02, 0.02]),  # 4 tokens, TPOT 20 ms, E2E 160 ms
               _record(0.3, [0.05, 0.05, 0.05]),  # 4 tokens, TPOT 50 ms, E2E 450 ms
               _record(0.2, []),  # one token: no TPOT, no ITL
               RequestRecord(prompt_tokens=10, expected_output_tokens=4, code="RESOURCE_EXHAUSTED", error="busy")]
    s = summarize(records, duration_s=2.0, slos={"ttft": 250, "tpot": 30})
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, {"RESOURCE_EXHAUSTED": 1})
    assert (s["output_tokens"], s["prompt_tokens"], s["expected_output_tokens"]) == (9, 30, 13)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_tok_s"] == pytest.approx(4.5)
    assert s["total_tok_s"] == pytest.approx(19.5)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(35) and s["p99_tpot_ms"] == pytest.approx(49.7)
    assert s["median_itl_ms"] == pytest.approx(35)  # three gaps of 20 and three of 50
    assert s["median_e2e_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] >= s["p90_ttft_ms"] >= s["median_ttft_ms"]
    # Good: the first (ttft 100, tpot 20) and the one-token reply (ttft 200, no TPOT to miss).
    assert s["good_requests"] == 2 and s["goodput_req_s"] == pytest.approx(1.0)


def test_goodput_needs_every_slo_and_a_completed_request():
    fast, slow_tpot = _record(0.1, [0.01] * 3), _record(0.1, [0.2] * 3)
    assert meets_slos(fast, {"ttft": 150, "tpot": 50, "e2e": 200})
    assert not meets_slos(slow_tpot, {"ttft": 150, "tpot": 50})
    assert meets_slos(slow_tpot, {"ttft": 150})
    assert not meets_slos(fast, {"e2e": 100})
    failed = _record(0.1, [0.01], ok=False, code="UNAVAILABLE")
    assert not meets_slos(failed, {"ttft": 1000})
    assert "goodput_req_s" not in summarize([fast], 1.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2e:2000"]) == {"ttft": 500, "tpot": 50.5, "e2e": 2000}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)



def test_cpu_ms_per_token_per_server_process():
    from bench.servers import cpu_ms_per_token, server_cpu_s
    import os
    now = server_cpu_s(os.getpid())
    assert set(now) == {"frontend", "engine"} and now["frontend"] > 0
    assert server_cpu_s(None) is None
    assert cpu_ms_per_token({"frontend": 1.0, "engine": 2.0}, {"frontend": 1.5, "engine": 4.0}, 1000) == {
        "frontend_cpu_ms_per_token": 0.5, "engine_cpu_ms_per_token": 2.0}
    assert cpu_ms_per_token(None, now, 10) == {} and cpu_ms_per_token(now, now, 0) == {}
