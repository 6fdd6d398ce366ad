"""`bench.engine_startup`: the engine's build time on the bundled model, in fresh processes."""

from __future__ import annotations

import argparse
import json

from bench import engine_startup


def test_both_trees_are_measured_and_land_in_one_file(tmp_path):
    args = argparse.Namespace(runs=1, pythonpath=str(engine_startup.ROOT), num_kv_blocks=64,
                              output_dir=str(tmp_path), measure_only=False)
    assert engine_startup.run(args) == 0
    payload = json.loads(next(tmp_path.glob("engine-startup-*.json")).read_text())
    assert sorted(payload["results"]) == ["baseline", "current"]
    for result in payload["results"].values():
        assert len(result["runs"]) == 1 and result["engine_core_s"] > 0
        assert result["engine_file"].startswith(str(engine_startup.ROOT))
