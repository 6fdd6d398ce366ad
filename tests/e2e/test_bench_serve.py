"""`pagedserve bench serve` end to end: real servers, real gRPC, JSON and PNG on disk.

Workloads are tiny and every server runs one torch thread: the machine's few cores are shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy(137)  # seconds on the 2-core CI machine: scheduled first

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4"]
ENGINE = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64"]

FLAGS = ["--backend", "--target", "--dataset-name", "--dataset-path", "--num-prompts", "--random-input-len",
         "--random-output-len", "--random-range-ratio", "--prefix-len", "--suffix-len", "--num-prefixes",
         "--prefix-output-len", "--sharegpt-output-len", "--request-rate", "--burstiness", "--max-concurrency",
         "--sweep-rates", "--goodput", "--seed", "--compare-offline", "--output-dir", "--dtype", "--model",
         "--num-kv-blocks", "--num-threads", "--structured-ratio", "--structured-output-len", "--metrics-url",
         "--embed-batch-size", "--embed-min-len", "--embed-max-len"]
HF_SERVER_FLAGS = ["--model", "--tokenizer", "--dtype", "--device", "--num-threads", "--max-model-len", "--host",
                   "--grpc-port"]


def bench_serve(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def run_json(path: Path) -> tuple[dict, dict]:
    payload = json.loads(path.read_text())
    return payload, payload["results"]["grpc"]


def check_sane(grpc: dict, num_prompts: int, output_tokens: int) -> None:
    assert (grpc["completed"], grpc["failed"]) == (num_prompts, 0), grpc["errors"]
    assert grpc["output_tokens"] == grpc["expected_output_tokens"] == output_tokens
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 <= grpc[f"median_{metric}"] <= grpc[f"p90_{metric}"] <= grpc[f"p99_{metric}"], metric
    assert grpc["p99_e2e_ms"] >= grpc["p99_ttft_ms"] > 0
    assert grpc["output_tok_s"] > 0 and grpc["total_tok_s"] > grpc["output_tok_s"]


@pytest.fixture(scope="module")
def target_server():
    """One `pagedserve serve` for the --target tests, started by the benchmark's own class,
    with its engine's /metrics (the structured dataset reads the step phases there)."""
    from bench.servers import server_for
    from engine.config import EngineConfig
    server = server_for("pagedserve", EngineConfig(dtype="float32", num_threads=1, num_kv_blocks=64), 256,
                        engine_metrics=True)
    server.address = server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target(target_server):
    return target_server.address


def test_help_lists_every_flag():
    result = bench_serve("--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    missing = [f for f in FLAGS if f not in result.stdout]
    assert not missing, f"--help lacks {missing}:\n{result.stdout}"
    hf = subprocess.run([sys.executable, "-m", "bench.hf_server", "--help"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert hf.returncode == 0, hf.stderr
    assert not [f for f in HF_SERVER_FLAGS if f not in hf.stdout], hf.stdout


@pytest.mark.parametrize("flags,message", [
    (["--backend", "pagedserve,hf", "--target", "127.0.0.1:1"], "--target benchmarks whatever runs there"),
    (["--backend", "vllm"], "--backend"),
    (["--compare-offline", "--sweep-rates", "1,2"], "--compare-offline works on"),
    (["--compare-offline", "--dataset-name", "sharegpt"], "--compare-offline works on"),
    (["--request-rate", "1", "--sweep-rates", "1,2"], "not both"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "--dataset-path is for sharegpt"),
    (["--goodput", "ttft:fast"], "METRIC:MILLISECONDS"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--dataset-name", "structured", "--backend", "hf"], "--backend pagedserve only"),
    (["--dataset-name", "structured", "--structured-ratio", "0,1.5"], "shares from 0 to 1"),
    (["--dataset-name", "structured", "--structured-ratio", "0,1", "--sweep-rates", "1,2"], "not both"),
    (["--metrics-url", "http://127.0.0.1:1/metrics"], "--metrics-url is for --dataset-name structured"),
    (["--dataset-name", "embeddings", "--backend", "hf"], "--dataset-name embeddings posts to /v1/embeddings"),
])
def test_bad_flags_are_refused_before_anything_starts(flags, message, capsys):
    """In process: the flags as the command parses them, then check_args, the first thing
    `bench serve` runs (a subprocess per case cost a second and a half of imports each)."""
    from bench.serve_args import check_args
    from pagedserve.cli import build_parser
    with pytest.raises(SystemExit) as refused:
        check_args(build_parser().parse_args(["bench", "serve", *flags]))
    assert refused.value.code != 0
    assert message in f"{refused.value.code}{capsys.readouterr().err}"


def test_a_bad_flag_exits_the_command_before_anything_starts():
    result = bench_serve("--backend", "vllm", timeout_s=60)
    assert result.returncode != 0 and "--backend" in result.stderr, result.stderr
    assert "starting" not in result.stdout


def test_smoke_run_writes_json(tmp_path):
    result = bench_serve(*SMALL, "--max-concurrency", "2", *ENGINE, "--compare-offline",
                         "--goodput", "ttft:60000", "tpot:60000", "--output-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    [path] = tmp_path.glob("serve-*-pagedserve-rateinf.json")
    payload, grpc = run_json(path)
    check_sane(grpc, 4, 16)
    assert grpc["good_requests"] == 4 and grpc["goodput_req_s"] == pytest.approx(grpc["request_throughput"])
    assert all(r["num_output_tokens"] == 4 and r["ttft_s"] > 0 for r in payload["requests"])
    assert payload["machine"]["num_cpus"] >= 1 and payload["backend"] == "pagedserve"
    assert payload["dataset"]["name"] == "random" and payload["max_concurrency"] == 2
    assert payload["ratios"]["grpc_vs_offline_output_tok_s"] > 0
    assert payload["results"]["offline"]["output_tokens"] == 16
    assert "grpc / offline output throughput = " in result.stdout
    assert "TTFT (ms)" in result.stdout and "p99" in result.stdout


def test_sweep_of_both_backends_writes_runs_summary_and_plot(tmp_path):
    result = bench_serve("--backend", "pagedserve,hf", "--sweep-rates", "20,inf", "--num-prompts", "3",
                         "--random-input-len", "8", "--random-output-len", "3", *ENGINE,
                         "--output-dir", str(tmp_path), timeout_s=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    [summary_path] = tmp_path.glob("serve-sweep-*.json")
    assert summary_path.with_suffix(".png").stat().st_size > 10_000
    summary = json.loads(summary_path.read_text())
    assert summary["plot"] == summary_path.with_suffix(".png").name
    assert [(r["backend"], r["request_rate"]) for r in summary["runs"]] == [
        ("pagedserve", "20"), ("pagedserve", "inf"), ("hf", "20"), ("hf", "inf")]
    for run in summary["runs"]:
        payload, grpc = run_json(tmp_path / run["file"])
        assert (payload["backend"], payload["request_rate"]) == (run["backend"], run["request_rate"])
        assert run["output_tok_s"] == grpc["output_tok_s"]
        check_sane(grpc, 3, 9)
        assert payload["server_command"] and payload["model"]["dtype"] == "float32"
    assert len(list(tmp_path.glob("serve-*-rate*.json"))) == 4
    assert "TTFT p99" in result.stdout  # the sweep table


def test_sharegpt_text_prompts_against_a_target(tmp_path, target):
    result = bench_serve("--target", target, "--dataset-name", "sharegpt", "--num-prompts", "4",
                         "--sharegpt-output-len", "3", "--request-rate", "50", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = tmp_path.glob("serve-*.json")
    payload, grpc = run_json(path)
    check_sane(grpc, 4, sum(r["expected_output_tokens"] for r in payload["requests"]))
    assert payload["dataset"]["usable_conversations"] == 4 and payload["server_command"] is None
    assert all(1 <= r["expected_output_tokens"] <= 3 and r["prompt_tokens"] >= 4 for r in payload["requests"])


def test_prefix_repetition_hits_the_prefix_cache(tmp_path, target):
    result = bench_serve("--target", target, "--dataset-name", "prefix-repetition", "--num-prompts", "6",
                         "--prefix-len", "32", "--suffix-len", "4", "--num-prefixes", "2", "--prefix-output-len", "2",
                         "--max-concurrency", "1", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = tmp_path.glob("serve-*.json")
    _, grpc = run_json(path)
    check_sane(grpc, 6, 12)
    # One at a time: each prefix is prefilled once, and its two full blocks serve the other four.
    assert grpc["cached_tokens"] >= 4 * 32


def test_failed_requests_are_counted_by_code_and_exit_1(tmp_path, target):
    # 64 blocks of 16 tokens cannot hold a 2000-token prompt: the server refuses each one.
    result = bench_serve("--target", target, "--num-prompts", "2", "--random-input-len", "2000",
                         "--random-output-len", "2", "--output-dir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    [path] = tmp_path.glob("serve-*.json")
    _, grpc = run_json(path)
    assert (grpc["completed"], grpc["failed"], grpc["errors"]) == (0, 2, {"INVALID_ARGUMENT": 2})
    assert "failed requests by code" in result.stdout


def test_structured_dataset_splits_constrained_from_unconstrained(tmp_path, target_server):
    import jsonschema

    from bench.datasets import load_structured_tasks
    schemas = {task: schema for task, schema, _ in load_structured_tasks()}
    # Seed 4 constrains a product listing and a contact: JSON short enough to complete in 64 tokens.
    # Against the module's server (its engine's /metrics: each run reads its own steps' phases).
    result = bench_serve("--target", target_server.address, "--metrics-url", target_server.metrics_url,
                         "--dataset-name", "structured", "--num-prompts", "4", "--structured-ratio", "0,0.5",
                         "--structured-output-len", "64", "--seed", "4", "--output-dir", str(tmp_path),
                         timeout_s=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    [summary_path] = tmp_path.glob("serve-structured-*.json")
    baseline, mixed = json.loads(summary_path.read_text())["runs"]
    assert (baseline["structured_ratio"], list(baseline["groups"])) == (0, ["unconstrained"])
    assert (mixed["structured_ratio"], list(mixed["groups"])) == (0.5, ["constrained", "unconstrained"])
    assert baseline["step_phases"]["grammar"]["steps"] == 0 and baseline["step_phases"]["model"]["steps"] > 0
    grammar = mixed["step_phases"]["grammar"]
    assert grammar["steps"] > 0 and grammar["mean_ms"] > 0
    assert grammar["total_s"] < mixed["step_phases"]["sample"]["total_s"]  # the mask is part of sampling
    payload, grpc = run_json(tmp_path / mixed["file"])
    assert payload["structured"]["groups"] == mixed["groups"] and grpc["completed"] == 4
    records = payload["requests"]
    for name, group in mixed["groups"].items():
        members = [r for r in records if r["constrained"] == (name == "constrained")]
        assert group["completed"] == group["num_requests"] == len(members) == 2
        assert group["num_valid"] == sum(r["valid"] for r in members) <= group["num_parsed"]
        assert group["output_tokens"] == sum(r["num_output_tokens"] for r in members)
    for r in records:  # each verdict holds up
        valid = r["parsed"] and jsonschema.Draft202012Validator(schemas[r["task"]]).is_valid(json.loads(r["text"]))
        assert r["valid"] == valid, r
    # A constrained reply ends when its grammar completes, before the cap, and is then valid.
    completed = [r for r in records if r["constrained"] and r["finish_reason"] != "FINISH_REASON_LENGTH"]
    assert completed and all(r["valid"] and r["num_output_tokens"] < 64 for r in completed), records
    assert "JSON / valid" in result.stdout and "grammar ms/step" in result.stdout


def test_embeddings_dataset_posts_texts_to_an_embedding_model(tmp_path):
    result = bench_serve("--dataset-name", "embeddings", "--num-prompts", "6", "--embed-batch-size", "3",
                         "--embed-max-len", "64", "--max-concurrency", "2", "--goodput", "e2e:60000",
                         "--dtype", "float32", "--num-threads", "1", "--output-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    [path] = tmp_path.glob("serve-*-pagedserve-rateinf.json")
    payload = json.loads(path.read_text())
    summary = payload["results"]["openai"]
    assert payload["api"] == "openai" and payload["engine_config"]["model"] == "all-MiniLM-L6-v2"
    assert payload["model"]["model_name"] == "all-MiniLM-L6-v2" and payload["model"]["architecture"] == "bert"
    dataset = payload["dataset"]
    assert (dataset["name"], dataset["num_texts"], dataset["texts_per_request"]) == ("embeddings", 18, 3)
    assert 8 <= dataset["mean_text_len"] <= 64
    assert (summary["completed"], summary["failed"], summary["texts"], summary["good_requests"]) == (6, 0, 18, 6)
    # the server's usage counts what the dataset sized with the same tokenizer
    assert summary["prompt_tokens"] == round(dataset["mean_prompt_len"] * 6)
    assert summary["prompt_tok_s"] == pytest.approx(summary["prompt_tokens"] / summary["duration_s"])
    assert summary["texts_per_s"] == pytest.approx(3 * summary["request_throughput"])
    assert 0 < summary["median_e2e_ms"] <= summary["p90_e2e_ms"] <= summary["p99_e2e_ms"]
    assert summary["output_tokens"] == 0 and summary["median_ttft_ms"] is None
    assert all(r["ok"] and r["num_output_tokens"] == 0 for r in payload["requests"])
    assert "texts embedded (texts/s)" in result.stdout and "E2E (ms)" in result.stdout
    assert "TTFT (ms)" not in result.stdout
