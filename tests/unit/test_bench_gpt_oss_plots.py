"""bench/gpt_oss.py's and bench/gpt_oss_peers.py's charts, from result files of their shape
(the benchmarks themselves take minutes and a llama-server build: not in `make test`)."""

from __future__ import annotations

import json

from bench import gpt_oss, gpt_oss_peers

MACHINE = {"cpu": "AMD EPYC"}


def test_peers_chart_is_written_beside_its_result_and_named_in_it(tmp_path):
    run = {"one stream": 31.3, "32 streams": 124.6, "prefill": 462.1}
    path = tmp_path / "gpt-oss-peers-x.json"
    path.write_text(json.dumps({
        "machine": MACHINE, "model": {"layers": 4}, "threads": 2, "pagedserve": {"auto": run, "int8": run},
        "llama_server": {"one stream": 23.5, "32 streams": 39.7, "prefill": 120.7},
        "ratios": {"int8": {"tpot": 0.75, "streams_32": 3.14, "prefill": 3.83}}}))
    chart = gpt_oss_peers.plot(path)
    assert chart == path.with_suffix(".png") and chart.read_bytes().startswith(b"\x89PNG")
    assert json.loads(path.read_text())["plot"] == chart.name


def test_variants_chart_is_written_beside_its_result_and_named_in_it(tmp_path):
    variant = {"rss_mib": 2355.2, "tpot_ms": 27.0, "batch_output_tok_s": 83.9}
    path = tmp_path / "gpt-oss-cpu-x.json"
    path.write_text(json.dumps({"machine": MACHINE, "model": {"layers": 4, "file_mib": 2359.1},
                                "results": {gpt_oss.FP4: variant, gpt_oss.INT8: variant, gpt_oss.DENSE: variant}}))
    chart = gpt_oss.plot(path)
    assert chart.read_bytes().startswith(b"\x89PNG") and json.loads(path.read_text())["plot"] == chart.name
