"""bench scaling's arithmetic: efficiency, CPU per token by role, token split; /proc reading."""

from __future__ import annotations

import os
import time

import pytest

from bench.scaling import cpu_seconds, plan
from bench.scaling_report import derive


def _run(engines: int, tok_s: float, cpu_s: dict, tokens: list[float], duration_s: float = 10.0) -> dict:
    output_tokens = int(tok_s * duration_s)
    counters = [{"generation_tokens": t, "prefix_cache_queries": 100.0, "prefix_cache_hits": 50.0 * i}
                for i, t in enumerate(tokens)]
    return {"engines": engines, "summary": {"output_tok_s": tok_s, "output_tokens": output_tokens,
                                            "duration_s": duration_s},
            "cpu_s": cpu_s, "engine_counters": counters}


def test_derive_efficiency_cpu_and_split():
    one = _run(1, 100.0, {"engine0": 9.0, "frontend": 1.0, "client": 0.5}, [1000.0])
    two = _run(2, 170.0, {"engine0": 9.5, "engine1": 8.5, "frontend": 2.0, "client": 1.0}, [900.0, 800.0])
    a, b = derive([one, two])
    assert a["efficiency"] == pytest.approx(1.0)
    assert b["efficiency"] == pytest.approx(0.85)  # 170 / (2 x 100)
    # 1,700 tokens: the engines' 18 CPU seconds are 10.6 ms a token; the frontend's 2 s, 1.18 ms.
    assert b["cpu_ms_per_token"]["engines"] == pytest.approx(18_000 / 1700)
    assert b["cpu_ms_per_token"]["frontend"] == pytest.approx(2000 / 1700)
    assert b["cpu_ms_per_token_per_engine"] == pytest.approx({"engine0": 9500 / 1700, "engine1": 8500 / 1700})
    assert sum(b["cores_busy"].values()) == pytest.approx(2.1)  # 21 CPU seconds in 10 s
    assert b["engine_token_share"] == pytest.approx([900 / 1700, 800 / 1700])
    assert (a["prefix_cache_hit_rate"], b["prefix_cache_hit_rate"]) == (0.0, pytest.approx(50 / 200))


def test_plan_runs_one_engine_once():
    assert plan([1, 2], ["cache_aware", "round_robin"]) == [
        (1, "cache_aware"), (2, "cache_aware"), (2, "round_robin")]


def test_cpu_seconds_counts_this_process_work():
    before = cpu_seconds({"me": os.getpid()})["me"]
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 s of CPU
        pass
    spent = cpu_seconds({"me": os.getpid()})["me"] - before
    assert 0.2 <= spent <= 1.0  # clock ticks are 10 ms
