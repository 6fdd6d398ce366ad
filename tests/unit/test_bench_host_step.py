"""`bench host-step`: the per-step host-time measurement, and --baseline's worktree run
(tiny sizes: seconds)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import host_step, random_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return random_model.build_random_model("tiny", tmp_path_factory.mktemp("models") / "tiny", "float32")


def test_measure_times_the_decode_steps_and_splits_out_the_model(tiny_dir):
    result = host_step.measure(str(tiny_dir), num_seqs=4, input_len=8, output_len=6, repeats=1)
    assert result["steps"] >= 4  # the steps after every sequence has its first token
    assert 0 < result["forward_ms"] < result["step_ms"]
    assert result["host_ms"] == pytest.approx(result["step_ms"] - result["forward_ms"])
    assert result["output_ms"] > 0
    assert result["engine_file"].startswith(str(host_step.Path(host_step.__file__).parent.parent))


def test_seeded_sampling_is_measured_as_well(tiny_dir):
    result = host_step.measure(str(tiny_dir), num_seqs=4, input_len=8, output_len=6, repeats=1, sampling="seeded")
    assert result["steps"] >= 4 and result["host_ms"] > 0


def test_prefill_phase_times_the_steps_that_complete_prompts(tiny_dir):
    # 40 prompts of 100 tokens under the 2,048-token budget: 20 chunks a step, two steps.
    result = host_step.measure(str(tiny_dir), num_seqs=40, input_len=100, output_len=1, repeats=1, phase="prefill")
    assert result["steps"] == 2
    assert 0 < result["forward_ms"] < result["step_ms"] and result["host_ms"] > 0
    assert result["gc_ms"] >= 0 and result["step_max_ms"] >= result["step_p99_ms"] > 0
    assert result["gc_pause_max_ms"] >= 0 and result["gc_pause_max_ms_any_run"] == result["gc_pause_max_ms"]


def test_phase_defaults_fill_only_what_was_not_given():
    args = host_step.resolve_phase_defaults(argparse.Namespace(phase="prefill", num_seqs=None, input_len=32,
                                                              output_len=None))
    assert (args.num_seqs, args.input_len, args.output_len) == (1024, 32, 1)
    args = host_step.resolve_phase_defaults(argparse.Namespace(phase="decode", num_seqs=None, input_len=None,
                                                              output_len=None))
    assert (args.num_seqs, args.input_len, args.output_len) == (256, 128, 64)


def test_baseline_measures_another_commit_from_its_own_checkout(tiny_dir):
    args = argparse.Namespace(num_seqs=2, input_len=8, output_len=4, repeats=1, sampling="greedy", phase="decode")
    result = host_step.measure_ref("HEAD", args, tiny_dir)
    assert len(result["commit"]) == 40 and result["host_ms"] > 0
    assert "pagedserve-baseline-" in result["engine_file"]  # the worktree's engine, not ours
    json.dumps(result)  # what the result file holds


def test_baseline_and_current_runs_alternate_and_land_in_one_file(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(random_model, "random_model_dir", lambda *a, **k: tiny_dir)
    args = argparse.Namespace(num_seqs=2, input_len=8, output_len=4, repeats=2, sampling="greedy", phase="decode",
                              baseline="HEAD", profile=False, output_dir=str(tmp_path), measure_only=False)
    assert host_step.run(args) == 0
    payload = json.loads(next(tmp_path.glob("host-step-*.json")).read_text())
    assert [len(payload["results"][b]["runs"]) for b in ("baseline", "current")] == [2, 2]
    assert payload["host_ratio"] > 0 and "pagedserve-baseline-" in payload["results"]["baseline"]["engine_file"]
