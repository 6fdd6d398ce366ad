"""`bench.frontend_step`: the frontend's work per engine step, measured against a socket the
benchmark answers as an engine (tiny sizes: seconds)."""

from __future__ import annotations

import argparse
import json

import uvloop

from bench import frontend_step, random_model


def test_every_stream_gets_its_token_each_step_and_the_step_is_timed():
    tokenizer = str(random_model.random_model_dir("tiny", "float32"))
    result = uvloop.run(frontend_step.measure(tokenizer, num_streams=4, steps=10))
    assert result["wall_ms"] > 0 and result["cpu_ms"] > 0


def test_baseline_and_current_runs_land_in_one_file(tmp_path):
    args = argparse.Namespace(num_streams=2, steps=5, repeats=1, baseline="HEAD", output_dir=str(tmp_path),
                              measure_only=False, tokenizer=None)
    assert frontend_step.run(args) == 0
    payload = json.loads(next(tmp_path.glob("frontend-step-*.json")).read_text())
    assert [len(payload["results"][b]["runs"]) for b in ("baseline", "current")] == [1, 1]
    assert len(payload["results"]["baseline"]["commit"]) == 40 and payload["wall_ratio"] > 0
