"""The prefix cache's second tier through a real server: a prefix evicted from a small KV pool
is restored from the second tier, and the HTTP server's /metrics shows the hit."""

from __future__ import annotations

import re
import time

import httpx

from http_client import post

FLAGS = ("--kv-offload-gb", "0.05", "--num-kv-blocks", "12")  # 192 tokens of KV; the tier holds ~70 blocks
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a book "
        "of tide tables and a thermos of tea. ") * 3


def offload_hits(fe) -> float:
    text = httpx.get(f"{fe.http_url}/metrics", timeout=10).text
    found = re.search(r'^pagedserve:kv_offload_hits_total\{engine="[^"]+"\} (\S+)$', text, re.M)
    assert found, "no pagedserve:kv_offload_hits_total on /metrics"
    return float(found.group(1))


def complete(fe, prompt, max_tokens: int = 3) -> list[str]:
    r = post(fe, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_evicted_prefix_is_a_second_tier_hit_on_metrics(servers):
    fe = servers.frontend(engine=FLAGS)
    before = offload_hits(fe)
    first = complete(fe, TEXT)
    complete(fe, list(range(1000, 1000 + 190)), max_tokens=1)  # fills the pool: the prefix is evicted
    assert complete(fe, TEXT) == first
    deadline = time.monotonic() + 10
    while offload_hits(fe) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert offload_hits(fe) - before >= 3 * 16  # whole blocks of the prefix, restored
    fe.wait_kv_free()
