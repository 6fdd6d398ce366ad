"""gpt-oss (engine/models/gpt_oss.py) against transformers on a tiny random-weight config:
4 layers alternating an 8-token window and full attention, sinks and every bias random,
4 experts (top 2) with the clamped SwiGLU, YaRN rotary. Greedy tokens equal HF's under
batching, chunked prefill across the window's edge, prefix caching and preemption, with
prompts much longer than the window; tensor parallel 2 equals 1."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import yarn_params
from engine.models.loader import weight_format
from pagedserve import LLM
from cpu_kernels import ops
from helpers import (assert_logprobs_close, assert_matches_hf, check_outputs_match, greedy_with_logprobs, hf_greedy,
                     logprob_gaps, tiny_hf_config)
from test_tiny_hf_equivalence import CONFIGS, tiny_prompts

MAX_NEW = 24


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config("gpt_oss"), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():  # HF starts biases and sinks at zero: random ones test their loading
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(str(folder), safe_serialization=True)
    bundled_tokenizer.save_pretrained(str(folder))
    prompts = tiny_prompts()
    return folder, prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(gpt_oss, config):
    folder, prompts, reference = gpt_oss
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert llm.engine.model_runner.model.model.layers[0].self_attn.sliding_window == 8
    assert llm.engine.model_runner.model.model.layers[1].self_attn.sliding_window is None
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted="num_kv_blocks" in CONFIGS[config])


def test_torch_backend_matches_hf(gpt_oss):
    """The reference backend's sinks (a score column in decode, attention written out in prefill)."""
    folder, prompts, reference = gpt_oss
    llm = LLM(str(folder), dtype="float32", attention_backend="torch", max_num_batched_tokens=24)
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted=False)


def test_speculative_decoding_matches_hf(gpt_oss):
    """n-gram drafts (any earlier token proposes: drafts on a random model) verified through
    the sinks, the windows and the experts, several positions a row: HF's greedy tokens."""
    folder, prompts, reference = gpt_oss
    llm = LLM(str(folder), dtype="float32", speculative_method="ngram", num_speculative_tokens=3,
              prompt_lookup_min=1)
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted=False)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_tensor_parallel_two_equals_one(gpt_oss):
    """Each rank: its heads' sinks, its share of every expert's width; o_proj's and the experts'
    down biases added once."""
    folder, prompts, reference = gpt_oss
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, num_threads=2)
    try:
        assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted=False)
    finally:
        llm.engine.model_runner.close()


def test_yarn_equals_transformers():
    """gpt-oss's own YaRN (factor 32 around 4,096, truncate off) and the truncated default."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for truncate in (False, True):
        config = GptOssConfig(num_hidden_layers=2)
        config.rope_parameters["truncate"] = truncate
        expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        ours, our_factor = yarn_params(config.head_dim, config.rope_parameters["rope_theta"], config.rope_parameters)
        assert torch.equal(ours, expected) and our_factor == factor


# -- MXFP4 experts (OpenAI's checkpoints) ----------------------------------------------------

def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from cpu_kernels import mxfp4_format
    from quant_packing import mxfp4_quantize
    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 96)
    blocks, scales = mxfp4_quantize(w)
    ours = mxfp4_format.dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(ours.bfloat16().float(), ours)  # every value exact in bf16
    assert (ours - w).abs().max() <= (w.abs().reshape(3, 40, 3, 32).amax(-1) / 4).repeat_interleave(32, -1).max()


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The tiny model with MXFP4 experts, and HF's greedy run of that checkpoint (transformers
    dequantizes MXFP4 on a CPU)."""
    from transformers import AutoModelForCausalLM

    from quant_packing import export_mxfp4_experts
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model"
    export_mxfp4_experts(gpt_oss[0], folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.model.layers[0].mlp.experts.down_proj.dtype == torch.float32  # dequantized, exactly
    prompts = gpt_oss[1]
    return folder, prompts, hf_greedy(hf, prompts, MAX_NEW)


@pytest.mark.parametrize("config", ["batched", "all_at_once"])
def test_mxfp4_checkpoint_matches_hf(gpt_oss_mxfp4, config):
    folder, prompts, reference = gpt_oss_mxfp4
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert weight_format(folder, None) == "mxfp4"  # what /v1/models and GetModelInfo report
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted="num_kv_blocks" in CONFIGS[config])


def test_mxfp4_bad_checkpoints_are_refused(gpt_oss_mxfp4, tmp_path):
    """A missing *_scales, or blocks of the wrong shape: one clear error, before serving."""
    import shutil

    from safetensors.torch import load_file, save_file
    folder = gpt_oss_mxfp4[0]
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    cases = {"missing": {k: v for k, v in tensors.items() if k != f"{name}_scales"},
             "shape": {**tensors, f"{name}_blocks": tensors[f"{name}_blocks"][..., :8].contiguous()}}
    for case, stored in cases.items():
        bad = tmp_path / case
        shutil.copytree(folder, bad, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(stored, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match="down_proj"):
            LLM(str(bad), dtype="float32")


@pytest.mark.skipif(not ops.bf16_dot_supported(), reason="the bf16 kernels need AVX512-BF16")
def test_mxfp4_experts_run_as_stored_in_bfloat16(gpt_oss_mxfp4, monkeypatch):
    """A bfloat16 model keeps MXFP4 experts as fp4 blocks (5 bits a weight, the dense copy
    never written) and generates what the same model with its experts dequantized does (bf16
    logits tie often: a prompt may diverge at a near tie; logprobs within bf16's noise)."""
    from engine.models.gpt_oss import GptOssForCausalLM
    folder, prompts, _ = gpt_oss_mxfp4
    llm = LLM(str(folder), dtype="bfloat16")
    blocks = [layer.mlp for layer in llm.engine.model_runner.model.model.layers]
    assert all(set(b.experts.packed) == {"gate_up_proj", "down_proj"} and b.experts.gate_up_proj is None
               for b in blocks)
    weights = len(blocks) * 4 * (64 * 64 + 64 * 32)  # 4 layers x 4 experts x (gate_up + down)
    assert sum(p.nbytes() for b in blocks for p in b.experts.packed.values()) == weights * 5 // 8
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    monkeypatch.setattr(GptOssForCausalLM, "_keep_fp4", lambda *args: False)
    dense = greedy_with_logprobs(LLM(str(folder), dtype="bfloat16"), prompts, MAX_NEW)
    # At most half diverge, each at a near tie: the three prompts sharing a 40-token prefix
    # diverge together when it does.
    assert check_outputs_match(ours, dense) <= len(prompts) // 2
    assert_logprobs_close(ours, dense, 0.25)


@pytest.mark.skipif(not ops.bf16_dot_supported(), reason="the bf16 kernels need AVX512-BF16")
def test_mxfp4_experts_under_tensor_parallelism(gpt_oss_mxfp4):
    """Each rank packs its rows of gate and up as fp4; down's rank width (16 of 32 columns)
    would cut a block, so down stays dense there. TP 2 generates what TP 1 does, as far as
    bf16 lets it: the all-reduce adds in another order, and this tiny random model (biases of
    std 1) turns that into drift that flips near ties within a few tokens (dense experts
    drift between TP 1 and 2 alike), so: most prompts agree for 8 tokens, and the chosen
    tokens' logprobs stay within 0.5 up to any divergence."""
    folder, prompts, _ = gpt_oss_mxfp4
    one = greedy_with_logprobs(LLM(str(folder), dtype="bfloat16", num_threads=2), prompts, MAX_NEW)
    llm = LLM(str(folder), dtype="bfloat16", num_threads=2, tensor_parallel_size=2)
    try:
        block = llm.engine.model_runner.model.model.layers[0].mlp
        assert set(block.experts.packed) == {"gate_up_proj"} and block.experts.down_proj is not None
        two = greedy_with_logprobs(llm, prompts, MAX_NEW)
    finally:
        llm.engine.model_runner.close()
    agreed = []
    for (tokens, lps), (ref_tokens, ref_lps) in zip(two, one):
        n = 0
        for token, ref_token, lp, ref_lp in zip(tokens, ref_tokens, lps, ref_lps):
            if token != ref_token:
                break
            assert abs(lp[token] - ref_lp[token]) < 0.5
            n += 1
        agreed.append(n)
    assert sum(n >= 8 for n in agreed) >= len(prompts) // 2, agreed


@pytest.mark.skipif(not ops.int8_dot_supported(), reason="the integer MXFP4 kernel needs AVX512-VNNI")
def test_mxfp4_experts_in_int8_arithmetic(gpt_oss_mxfp4):
    """--cpu-arithmetic int8: the experts packed as MXFP4 for the integer kernel (4.25 bits a
    weight), activations rounded to 8 bits per block of 32. The numbers move, as llama.cpp's
    do: on this model about as far from the exact bf16 arithmetic as bf16 is from float32
    (mean gap of the chosen tokens' logprobs 0.021 against 0.022 up to each divergence on the
    Zen 4 VM). (The kernel gives a row the same bits alone as in any batch:
    tests/kernels/test_mxfp4_int8.py.)"""
    folder, prompts, _ = gpt_oss_mxfp4
    llm = LLM(str(folder), dtype="bfloat16", cpu_arithmetic="int8")
    blocks = [layer.mlp for layer in llm.engine.model_runner.model.model.layers]
    assert all({p.format for p in b.experts.packed.values()} == {"mxfp4_int8"} for b in blocks)
    weights = len(blocks) * 4 * (64 * 64 + 64 * 32)
    assert sum(p.nbytes() for b in blocks for p in b.experts.packed.values()) == weights * 17 // 32
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    exact = greedy_with_logprobs(LLM(str(folder), dtype="bfloat16"), prompts, MAX_NEW)
    float32 = greedy_with_logprobs(LLM(str(folder), dtype="float32"), prompts, MAX_NEW)
    int8_gaps, bf16_gaps = logprob_gaps(ours, exact), logprob_gaps(exact, float32)
    assert max(int8_gaps) < 0.25
    assert sum(int8_gaps) / len(int8_gaps) < 1.5 * sum(bf16_gaps) / len(bf16_gaps)

