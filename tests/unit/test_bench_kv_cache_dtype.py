"""bench/kv_cache_dtype.py's parts without a model: the flags' check, the table and the chart
(the benchmark itself takes minutes: docs/engine.md gives its command)."""

from __future__ import annotations

import argparse
import json

from bench import kv_cache_dtype as bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_auto_must_come_first_as_the_baseline(capsys):
    assert parse().kv_cache_dtypes == ["auto", "int8", "fp8"]
    assert bench.run(parse("--kv-cache-dtypes", "int8,auto")) == 2
    assert bench.run(parse("--kv-cache-dtypes", "auto,int4")) == 2
    assert "auto first" in capsys.readouterr().out


def test_report_and_chart(tmp_path, capsys):
    results = {name: {"kv_bytes_per_token": b, "perplexity": p, "perplexity_ratio": p / 20.0,
                      "greedy_vs_auto": {"exact": 1.0, "leading": 1.0}, "num_kv_blocks": blocks,
                      "max_concurrency": peak, "peak_running": peak + 3, "capacity_ratio": peak / 4,
                      "output_tok_s": tok_s,
                      "throughput_ratio": tok_s / 10.0, "num_preemptions": 0}
               for name, b, p, blocks, peak, tok_s in (("auto", 23040, 20.0, 100, 4, 10.0),
                                                       ("int8", 11880, 20.1, 194, 8, 14.0))}
    bench.print_report(results)
    table = capsys.readouterr().out
    assert "int8" in table and "2.00" in table and "1.0050" in table
    path = tmp_path / "kv-cache-dtype-x.json"
    path.write_text(json.dumps({"results": results}))
    chart = bench.plot(results, path)
    assert chart.exists() and json.loads(path.read_text())["plot"] == chart.name
