"""`bench gpu-busy` on CPU (tiny sizes: seconds): the decode steps it times, the bandwidth bound
it computes, and the report table that reads its JSON. The profiled GPU share needs CUDA."""

from __future__ import annotations

import json

import pytest

from bench import random_model, throughput_report
from pagedserve.cli import main


@pytest.fixture(scope="module")
def result_path(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("gpu-busy")
    models = tmp_path_factory.mktemp("models")  # the compiled kernels stay in the usual cache
    monkeypatch_module.setattr(random_model, "random_models_root", lambda: models)
    assert main(["bench", "gpu-busy", "--device", "cpu", "--random-weights", "tiny", "--num-seqs", "4",
                 "--input-len", "8", "--output-len", "6", "--kv-cache-memory-gb", "0.01",
                 "--output-dir", str(out)]) == 0
    (path,) = out.glob("gpu-busy-*.json")
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_times_the_decode_steps_and_bounds_them(result_path):
    r = json.loads(result_path.read_text())
    res = r["results"]
    timed = res["timed"]
    assert timed["decode_steps"] >= 4  # the steps after every sequence has its first token
    assert 0 < timed["output_ms"] < timed["step_ms"] and 0 < timed["engine_ms"] < timed["step_ms"]
    assert timed["decode_tok_s"] == pytest.approx(4 * 1000 / timed["step_ms"], rel=1e-6)
    # tiny: 1 layer, 2 KV heads of 16, float32: K and V are 2 x 2 x 16 x 4 = 256 bytes a token
    assert res["kv_bytes_per_step"] == 256 * 4 * (8 + 6 / 2)
    assert res["bound_ms"] == pytest.approx(1e3 * (res["weight_bytes"] + res["kv_bytes_per_step"])
                                            / (res["copy_gb_s"] * 1e9))
    assert "gpu_busy" not in res  # no profile without CUDA
    assert r["workload"]["num_seqs"] == 4 and r["machine"]["cpu_flags"] is not None


def test_the_session_report_reads_it(result_path):
    (row,) = throughput_report.gpu_busy_rows(result_path.parent)
    assert row[0] == "random tiny (float32), 4 seqs, sync" and row[-1] == result_path.name


def test_device_time_sums_the_kernels_and_ranks_them():
    from types import SimpleNamespace

    from bench.gpu_busy import _device_time
    events = [SimpleNamespace(key="paged_decode", self_device_time_total=900.0, count=30),
              SimpleNamespace(key="aten::linear", self_device_time_total=0.0, count=90),  # CPU-side op
              SimpleNamespace(key="elementwise", self_device_time_total=300.0, count=300)]
    out = _device_time(events, steps=3)
    assert out["gpu_ms"] == pytest.approx(0.4)
    assert [(k["name"], k["ms_per_step"], k["calls_per_step"]) for k in out["top_kernels"]] == [
        ("paged_decode", pytest.approx(0.3), 10), ("elementwise", pytest.approx(0.1), 100)]
