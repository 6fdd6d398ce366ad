"""Multi-LoRA in the scheduler and on the command line: a step never mixes more than
max_loras adapters (requests for others wait, base-model requests always fit), forks keep
their adapter, and the LoRA flags reach the engine's config, through `pagedserve serve` too."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from engine.arg_utils import engine_config_from_args
from engine.block_manager import BlockManager
from engine.config import EngineConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.scheduler import Scheduler
from pagedserve.cli import build_parser
from pagedserve.serve import engine_command


def _request(rid: str, lora: str | None, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=2, n=n)
    r = Request(rid, list(range(10, 18)), params, (2,)) if n == 1 else \
        Request(f"{rid}/0", list(range(10, 18)), params, (2,), parent_id=rid)
    r.lora_name, r.block_extra_keys = lora, () if lora is None else ("lora", lora, "/x")
    return r


def _finish_step(sched: Scheduler) -> set:
    """One step with every scheduled request sampling token 5; the step's adapters."""
    out = sched.schedule()
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.num_samples:
            result.request_ids.append(s.request.request_id)
            result.token_ids.append([5] * s.num_samples)
            result.logprobs.append([None] * s.num_samples)
    sched.update_from_output(out, result)
    return {s.request.lora_name for s in out.scheduled}


def test_a_step_mixes_at_most_max_loras_adapters():
    sched = Scheduler(SchedulerConfig(256, 16, 256, max_loras=2), BlockManager(64, 4))
    for rid, lora in [("1", "a"), ("2", "b"), ("3", "c"), ("4", None), ("5", "a"), ("6", "c")]:
        sched.add_request(_request(rid, lora))
    assert _finish_step(sched) == {"a", "b", None}  # "c" waits; "5" (a) and "4" (base) pass it
    assert sorted(r.request_id for r in sched.running) == ["1", "2", "4", "5"]
    assert [e[1].request_id for e in sorted(sched.waiting)] == ["3", "6"]  # queue order kept
    assert _finish_step(sched) == {"a", "b", None}  # decodes; they finish (max_tokens 2)
    assert _finish_step(sched) == {"c"}
    while sched.num_unfinished:
        _finish_step(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_forks_and_prefix_keys_keep_the_adapter():
    sched = Scheduler(SchedulerConfig(256, 16, 256, max_loras=1), BlockManager(64, 4))
    sched.add_request(_request("p", "a", n=3))
    _finish_step(sched)
    assert sorted((r.request_id, r.lora_name) for r in sched.running) == [("p/0", "a"), ("p/1", "a"), ("p/2", "a")]
    assert all(r.block_extra_keys == ("lora", "a", "/x") for r in sched.running)
    while sched.num_unfinished:
        _finish_step(sched)
    # Its blocks are cached under the adapter's keys: the base model's lookup misses them.
    bm = sched.block_manager
    assert bm.get_computed_blocks(list(range(10, 18)), ("lora", "a", "/x"))[1] == 4
    assert bm.get_computed_blocks(list(range(10, 18)))[1] == 0


def test_lora_flags_reach_the_engine_config():
    args = build_parser().parse_args(["engine", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3",
                                      "--max-lora-rank", "32"])
    config = engine_config_from_args(args)
    assert config.enable_lora and config.lora_modules == {"a": "/x", "b": "/y"}
    assert (config.max_loras, config.max_lora_rank) == (3, 32)
    assert not engine_config_from_args(build_parser().parse_args(["engine"])).enable_lora


def test_serve_passes_the_lora_flags_to_the_engine():
    argv = ["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3", "--grpc-port", "0"]
    command = engine_command(build_parser().parse_args(argv), argv[1:])
    tail = command[command.index("--enable-lora"):]
    assert tail == ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_modules=["a"]), "expected name=path"),
    (dict(lora_modules=["a=/x", "a=/y"]), "given twice"),
    (dict(enable_lora=True, max_loras=0), "max_loras: must be a positive integer"),
    (dict(enable_lora=True, tensor_parallel_size=2), "not with tensor_parallel_size 2"),
    (dict(enable_lora=True, speculative_model="/m"), "not with speculative_method 'draft'"),
])
def test_bad_lora_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
