"""The prefix cache's second tier (--kv-offload-gb) on the bundled model, in-process: a shared
prefix evicted from a small KV pool comes back from the second tier instead of being
recomputed, with the same greedy output; a store that fails later, a directory that cannot hold
the tier, or a disk too small for it, turns it off and serving goes on; a tier too small for
the prefix restores what it holds."""

from __future__ import annotations

import logging
from dataclasses import fields

import pytest
from prometheus_client import CollectorRegistry

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.metrics import EngineMetrics
from engine.models.loader import eos_token_ids, load_tokenizer, read_arch_config
from helpers import assert_engine_idle

BLOCK = 16
NUM_KV_BLOCKS = 12  # 192 tokens: one long prompt evicts everything cached
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a book "
        "of tide tables and a thermos of tea. From the gallery he could see the fishing boats return, "
        "one after another, their wakes drawing silver lines across the darkening bay.")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
HAS_KV_DTYPE = "kv_cache_dtype" in {f.name for f in fields(EngineConfig)}


def make_core(bundled_path, **overrides) -> EngineCore:
    config = EngineConfig(num_kv_blocks=NUM_KV_BLOCKS, num_threads=1, max_num_batched_tokens=256, **overrides)
    return EngineCore(config, eos_token_ids(load_tokenizer(bundled_path)), log_stats=True)


def run(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    core.add_request(request_id, prompt, params)
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    return tokens


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer):
    """A shared prefix of 4 blocks with two endings, and a prompt that fills the whole pool."""
    ids = bundled_tokenizer.encode(TEXT + " " + TEXT)
    prefix = ids[:4 * BLOCK]
    return prefix + ids[4 * BLOCK:4 * BLOCK + 5], prefix + ids[:3], list(range(1000, 1000 + NUM_KV_BLOCKS * BLOCK - 1))


def evict_and_rerun(core: EngineCore, prompts) -> tuple[list[int], list[int], list[int]]:
    """(first output, output after eviction, tokens each step computed for it)."""
    first, other, filler = prompts
    reference = run(core, "first", first)
    run(core, "filler", filler, SamplingParams(temperature=0, max_tokens=1))  # every block reused
    assert core.block_manager.get_computed_blocks(first)[0] == []  # gone from the first tier
    core.take_iteration_stats()
    again = run(core, "again", first)
    return reference, again, core.take_iteration_stats().iteration_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_an_evicted_prefix_is_restored_not_recomputed(bundled_path, prompts, kv_cache_dtype):
    if kv_cache_dtype != "auto" and not HAS_KV_DTYPE:
        pytest.skip("--kv-cache-dtype is not in this tree yet")
    dtype = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    core = make_core(bundled_path, kv_offload_gb=0.05, **dtype)
    reference, again, steps = evict_and_rerun(core, prompts)
    assert again == reference
    first = prompts[0]
    assert steps[0] == len(first) - 4 * BLOCK  # the prefill computed only the part past the prefix
    stats = core.stats()
    assert stats.num_kv_offload_hits == 4 * BLOCK
    slot_bytes = core.model_runner.kv_offload.slot_bytes
    assert stats.kv_offload_restored_bytes == 4 * slot_bytes and stats.kv_offload_restore_s > 0
    assert stats.kv_offload_saved_bytes >= 4 * slot_bytes
    registry = CollectorRegistry()
    EngineMetrics("m", registry).record(stats, None)
    assert registry.get_sample_value("pagedserve:kv_offload_hits_total", {"model_name": "m"}) == 4 * BLOCK
    assert registry.get_sample_value("pagedserve:kv_offload_restored_bytes_total", {"model_name": "m"}) == \
        4 * slot_bytes
    # Another ending of the same prefix hits the first tier now (the restored blocks are cached).
    hits = stats.num_prefix_cache_hits
    run(core, "sibling", prompts[1])
    assert core.stats().num_prefix_cache_hits == hits + 4 * BLOCK
    assert_engine_idle(core)


def test_a_tier_smaller_than_the_prefix_restores_what_it_holds(bundled_path, prompts):
    config = EngineConfig(num_threads=1)  # the dtype this machine resolves to
    arch = read_arch_config(bundled_path)
    itemsize = 4 if config.dtype == "float32" else 2
    slot_bytes = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * BLOCK * itemsize
    core = make_core(bundled_path, kv_offload_gb=2.5 * slot_bytes / 2**30)  # 2 slots: the tier is full
    assert core.model_runner.kv_offload.num_slots == 2
    reference, again, steps = evict_and_rerun(core, prompts)
    assert again == reference
    # The prefix's blocks were saved last block first, so the first two are the ones kept.
    assert core.stats().num_kv_offload_hits == 2 * BLOCK
    assert steps[0] == len(prompts[0]) - 2 * BLOCK
    assert_engine_idle(core)


def test_a_store_that_fails_later_turns_the_tier_off(bundled_path, prompts, caplog):
    core = make_core(bundled_path, kv_offload_gb=0.05)
    first, _, filler = prompts
    reference = run(core, "first", first)
    core.model_runner.kv_offload.close()  # its memory gone: the filler's saves fail
    with caplog.at_level(logging.ERROR, logger="pagedserve.engine"):
        run(core, "filler", filler, SamplingParams(temperature=0, max_tokens=1))
    assert [r.message for r in caplog.records if "the second tier is off from here on" in r.message]
    assert run(core, "again", first) == reference  # recomputed: nothing restored from the failed store
    assert core.block_manager.offload is None and core.stats().num_kv_offload_hits == 0
    assert_engine_idle(core)


@pytest.mark.parametrize("where", ["a file", "a full disk"])
def test_a_tier_that_cannot_be_had_turns_off_and_serving_goes_on(bundled_path, prompts, tmp_path, caplog, where):
    if where == "a file":  # a file where the directory should be
        (tmp_path / "not-a-dir").write_text("")
        flags = dict(kv_offload_dir=str(tmp_path / "not-a-dir"))
    else:  # far more than any disk: posix_fallocate refuses it at start
        flags = dict(kv_offload_dir=str(tmp_path), kv_offload_gb=2.0**20)
    with caplog.at_level(logging.ERROR, logger="pagedserve.engine"):
        core = make_core(bundled_path, **flags)
    assert [r.message for r in caplog.records if "kv offload: off" in r.message]
    assert core.model_runner.kv_offload is None and core.block_manager.offload is None
    assert len(run(core, "r", prompts[1])) == 4
    assert list(tmp_path.iterdir()) == ([tmp_path / "not-a-dir"] if where == "a file" else [])
    assert_engine_idle(core)


def test_kv_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        EngineConfig(kv_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gb: must be > 0"):
        EngineConfig(kv_offload_gb=0)
    assert EngineConfig(kv_offload_dir="/tmp").kv_offload_gb == 4.0
