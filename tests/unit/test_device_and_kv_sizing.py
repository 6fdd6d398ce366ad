"""`--device auto` (the default) and the KV pool's size: `--num-kv-blocks`, else on CUDA
`--gpu-memory-utilization` (a share of the GPU, less the weights and a profiled step's
activations, engine/kv_sizing.py), else `--kv-cache-memory-gb`. On a machine without a GPU:
the arithmetic, the flags and their errors; tests/kernels/test_gpu_e2e.py runs the measuring
on a GPU."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from engine import kv_sizing
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig, resolve_device
from engine.kv_sizing import GpuMemory, blocks_for_gpu_share, num_kv_blocks, profile_rows

GiB = 2**30
MiB = 2**20


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


# -- --device auto ---------------------------------------------------------------------------

def test_auto_is_the_default_and_resolves_to_cpu_without_a_gpu(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        assert EngineConfig().device == "cpu"
    assert [r.getMessage() for r in caplog.records if "device auto" in r.getMessage()] == \
        ["device auto: cpu (no CUDA device)"]
    assert parse().device == "auto"
    assert engine_config_from_args(parse()).device == "cpu"
    assert EngineConfig.from_kwargs(model=None).device == "cpu"  # what LLM() builds


def test_explicit_devices_stay_as_given(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        assert EngineConfig(device="cpu").device == "cpu"
        assert EngineConfig(device="cuda").device == "cuda"  # checked when the model loads, as before
        assert EngineConfig(device="cuda:1").device == "cuda:1"
        assert engine_config_from_args(parse("--device", "cuda:0")).device == "cuda:0"
    assert not any("device auto" in r.getMessage() for r in caplog.records)
    assert resolve_device("cuda:3") == "cuda:3" and resolve_device("auto") == "cpu"


def test_a_resolved_config_keeps_its_device_when_replaced():
    import dataclasses
    config = dataclasses.replace(EngineConfig(), max_model_len=64)  # as the draft model's and TP ranks' are
    assert config.device == "cpu"


@pytest.mark.parametrize("device", ["tpu", "gpu", "", "Auto"])
def test_an_unknown_device_names_auto_among_the_choices(device):
    with pytest.raises(ValueError, match=r"device: must be 'auto', 'cpu' or 'cuda\[:N\]'"):
        EngineConfig(device=device)


def test_help_names_auto_as_the_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--device DEVICE auto (cuda where torch sees a GPU, else cpu" in text, text
    assert "--gpu-memory-utilization F cuda only: the share F" in text, text


# -- --gpu-memory-utilization: the flag and its checks -----------------------------------------

@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_gpu_share_on_cpu_is_refused_naming_the_cpu_flag(device):
    with pytest.raises(ValueError, match="gpu_memory_utilization: is for cuda.*use --kv-cache-memory-gb"):
        EngineConfig(device=device, gpu_memory_utilization=0.5)


@pytest.mark.parametrize("share", [0, 0.0, -0.1, 1.01, 2, True])
def test_gpu_share_out_of_range_is_refused(share):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be a number in \(0, 1\]"):
        EngineConfig(device="cuda", gpu_memory_utilization=share)


def test_gpu_share_is_a_float_flag_unset_by_default():
    assert parse().gpu_memory_utilization is None
    config = engine_config_from_args(parse("--device", "cuda", "--gpu-memory-utilization", "0.9"))
    assert config.gpu_memory_utilization == 0.9 and config.device == "cuda"
    assert EngineConfig(device="cuda", gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_the_engine_command_exits_2_with_one_line_on_cpu():
    done = subprocess.run([sys.executable, "-m", "pagedserve", "engine", "--gpu-memory-utilization", "0.5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pagedserve engine: error: gpu_memory_utilization: is for cuda" in done.stderr
    assert "--kv-cache-memory-gb" in done.stderr and "Traceback" not in done.stderr, done.stderr


# -- the arithmetic -------------------------------------------------------------------------

H100 = dict(total_bytes=80 * GiB, free_bytes=70 * GiB, weights_bytes=16 * GiB, activation_bytes=2 * GiB)


def test_the_kv_pool_gets_the_share_less_weights_and_activations(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        blocks = blocks_for_gpu_share(GpuMemory(**H100), 0.5, bytes_per_block=2 * MiB)
    assert blocks == (40 - 16 - 2) * GiB // (2 * MiB) == 11264
    line = next(r.getMessage() for r in caplog.records if "gpu_memory_utilization" in r.getMessage())
    assert line == ("gpu_memory_utilization 0.5 of 80.00 GiB = 40.00 GiB: weights 16.00 GiB, activations "
                    "2.00 GiB, KV cache 22.00 GiB -> 11264 blocks of 2.00 MiB"), line


def test_a_partial_block_is_left_over():
    memory = GpuMemory(total_bytes=1000, free_bytes=1000, weights_bytes=100, activation_bytes=50)
    assert blocks_for_gpu_share(memory, 1.0, bytes_per_block=100) == 8  # 850 bytes: 8 blocks
    assert blocks_for_gpu_share(memory, 0.25, bytes_per_block=100) == 1  # 250 - 150: one block exactly


@pytest.mark.parametrize("share, weights_gib", [(0.225, 16), (0.2, 16), (0.1, 16)])
def test_nothing_left_for_the_kv_cache_names_the_numbers_and_the_remedies(share, weights_gib):
    memory = GpuMemory(**{**H100, "weights_bytes": weights_gib * GiB})  # 0.225 * 80 = 18 = 16 + 2: zero left
    with pytest.raises(ValueError) as error:
        blocks_for_gpu_share(memory, share, bytes_per_block=2 * MiB)
    message = str(error.value)
    assert message.startswith(f"gpu_memory_utilization {share}: {share * 80:.2f} GiB of the GPU's 80.00 GiB "
                              "leaves no room for the KV cache after the weights (16.00 GiB) and a step's "
                              "activations (2.00 GiB)"), message
    for remedy in ("raise --gpu-memory-utilization", "--max-num-batched-tokens", "--quantization"):
        assert remedy in message, message


def test_less_than_one_block_left_is_nothing_left():
    memory = GpuMemory(total_bytes=1000, free_bytes=1000, weights_bytes=100, activation_bytes=50)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        blocks_for_gpu_share(memory, 0.249, bytes_per_block=100)  # 249 - 150 = 99 bytes


def test_a_share_beyond_what_is_free_names_the_largest_that_fits():
    memory = GpuMemory(**{**H100, "free_bytes": 10 * GiB})  # another process holds the rest
    with pytest.raises(ValueError) as error:
        blocks_for_gpu_share(memory, 0.9, bytes_per_block=2 * MiB)
    message = str(error.value)
    assert "the KV cache would take 54.00 GiB but only 10.00 GiB of the GPU is free" in message, message
    assert "--gpu-memory-utilization 0.35 or less" in message, message  # (16 + 2 + 10) / 80
    assert blocks_for_gpu_share(memory, 0.35, bytes_per_block=2 * MiB) == 5 * 2**10  # 10 GiB: fits


# -- precedence ------------------------------------------------------------------------------

def never_measured() -> GpuMemory:
    raise AssertionError("the GPU was measured though a flag of higher precedence sized the pool")


def test_num_kv_blocks_wins_over_everything():
    config = EngineConfig(device="cuda", num_kv_blocks=77, gpu_memory_utilization=0.5, kv_cache_memory_gb=3)
    assert num_kv_blocks(config, 2 * MiB, never_measured) == 77


def test_the_gpu_share_wins_over_the_memory_budget():
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.5, kv_cache_memory_gb=3)
    assert num_kv_blocks(config, 2 * MiB, lambda: GpuMemory(**H100)) == 11264


def test_without_either_the_memory_budget_sizes_the_pool():
    assert num_kv_blocks(EngineConfig(kv_cache_memory_gb=3), 2 * MiB, never_measured) == 1536
    assert num_kv_blocks(EngineConfig(device="cuda"), 2 * MiB, never_measured) == 512  # 1 GiB by default
    assert num_kv_blocks(EngineConfig(kv_cache_memory_gb=0.001), 2 * MiB, never_measured) == 1  # at least one


# -- the profiled step ---------------------------------------------------------------------

def test_the_profiled_step_is_the_largest_step_in_rows_the_model_takes():
    rows = profile_rows(2048, max_model_len=8192, block_size=16)
    assert [len(r.token_ids) for r in rows] == [2048] and rows[0].block_ids == list(range(128))
    rows = profile_rows(1000, max_model_len=384, block_size=16)
    assert [len(r.token_ids) for r in rows] == [384, 384, 232]
    assert [r.block_ids for r in rows] == [list(range(24)), list(range(24, 48)), list(range(48, 63))]
    assert all(r.start == 0 and r.num_logits == 1 for r in rows)
    assert kv_sizing.num_profile_blocks(rows) == 63
