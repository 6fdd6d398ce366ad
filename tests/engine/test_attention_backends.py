"""The attention backends agree end to end: greedy tokens of the bundled model on CPU."""

from __future__ import annotations

import pytest

import cpu_kernels
from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak


@pytest.mark.skipif(not cpu_kernels.available("paged_attention"),
                    reason=f"CPU attention kernel unavailable: {cpu_kernels.unavailable_reason('paged_attention')}")
def test_cpu_backend_generates_like_torch(bundled_path):
    # Batched together: a few tokens to hundreds (the kernel tests cover longer contexts).
    # Prompts whose greedy tokens win by a clear margin (> 0.1 in logprob), so that float32
    # rounding differences between the backends cannot flip them.
    story = "Once upon a time, in a village by the sea, there lived an old fisherman and his cat. "
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", story * 4,
               ", ".join(str(i) for i in range(1, 80))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=256, attention_backend=name)
        assert llm.engine.model_runner.backend.name == name
        outs = llm.generate(prompts, params)
        assert_no_leak(llm)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu"] == tokens["torch"]
