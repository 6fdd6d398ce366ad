"""Sleep, wake and weight updates on CUDA (engine/sleep_mode.py), eager and under CUDA graphs
with async scheduling: level 1 moves the weights to CPU memory and frees the KV cache, level 2
frees both; the GPU's allocated memory drops by them, and greedy output after each wake, and
after an update, is what it was (or what an LLM loaded from the new checkpoint gives).

A tiny random Llama with head size 64 (the cupy kernels') and a word-level tokenizer, as
test_gpu_e2e.py builds them: no bundled model needed on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from helpers import build_tiny_model
from test_gpu_e2e import build_tokenizer
from weight_checkpoints import perturbed_copy

PROMPTS = [[1, 5, 9, 13, 200], [1, 7, 7, 7, 7, 7, 7, 7, 7, 42]]
CONFIGS = {"eager": dict(cuda_graphs=False), "graphs_async": dict(cuda_graphs=True, async_scheduling=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-sleep")
    a = build_tiny_model("llama", root / "a", build_tokenizer(), vocab_size=512, hidden_size=128,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return a, perturbed_copy(a, root / "b")


def greedy(llm) -> list[list[int]]:
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("config", CONFIGS)
def test_sleep_wake_update_on_cuda(folders, config):
    from pagedserve import LLM
    a, b = folders
    options = dict(dtype="float32", device="cuda", attention_backend="cupy", num_kv_blocks=4096, max_model_len=512,
                   **CONFIGS[config])
    llm = LLM(str(a), **options)
    runner = llm.engine.model_runner
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    before = greedy(llm)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    llm.sleep(1)
    assert awake - torch.cuda.memory_allocated() >= kv_bytes + weight_bytes
    assert all(p.device.type == "cpu" for p in runner.model.parameters())
    llm.wake_up()
    assert runner.model.lm_head.weight.device.type == "cuda"
    assert greedy(llm) == before
    llm.sleep(2)
    assert awake - torch.cuda.memory_allocated() >= kv_bytes + weight_bytes and runner.model is None
    llm.wake_up()
    assert greedy(llm) == before
    llm.update_weights(str(b))
    updated = greedy(llm)
    del llm, runner
    assert updated == greedy(LLM(str(b), **options)) != before
