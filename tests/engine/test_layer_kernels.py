"""The fused layer ops in the whole model: the bundled SmolLM2 with norms, rotary and
SiLU-and-mul through cpu_kernels (the default on CPU) against the same model in eager
torch, under batching, chunked prefill, prefix caching and preemption at once. float32 is
also checked against HF by test_bundled_hf_equivalence, which runs the kernels."""

from __future__ import annotations

import pytest

import cpu_kernels
from cpu_kernels import ops
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from pagedserve import LLM
from helpers import assert_no_leak, check_outputs_match
from test_quantized_model import STRESS, assert_logprobs_close, greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.available("layer_ops"),
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason('layer_ops')}")


def set_layer_kernels(llm: LLM, on: bool) -> int:
    fused = [m for m in llm.engine.model_runner.model.modules()
             if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul))]
    for module in fused:
        module.kernels = ops if on else None
    return len(fused)


# float32: sums in another order only. bfloat16: logits 1/16 apart tie often (see
# test_quantized_model), so a near-tie divergence per prompt is allowed.
@pytest.mark.parametrize("dtype,max_diverged,tol", [("float32", 1, 1e-3), ("bfloat16", 3, 0.25)])
def test_fused_layers_match_eager(bundled_path, bundled_tokenizer, dtype, max_diverged, tol):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at "
             "the edge of a great forest, there lived an old clockmaker who"]
    prompts = [bundled_tokenizer.encode(t) for t in texts] + [bundled_tokenizer.encode(texts[2])[:20]]
    llm = LLM(str(bundled_path), dtype=dtype, **STRESS)
    assert all(m.kernels is ops for m in llm.engine.model_runner.model.modules() if isinstance(m, RMSNorm))
    fused = greedy(llm, prompts)
    assert_no_leak(llm)
    assert set_layer_kernels(llm, False) == 2 * 30 + 1 + 1 + 30  # norms, rotary, activations
    eager = greedy(llm, prompts)
    assert check_outputs_match(fused, eager) <= max_diverged
    assert_logprobs_close(fused, eager, tol)
    assert_no_leak(llm)
