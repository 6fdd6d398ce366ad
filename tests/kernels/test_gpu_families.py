"""Issue 18's model families and multi-LoRA on CUDA: greedy output of tiny random-weight
models against HF transformers on the same GPU, fp32.

Head size 64, so `auto` runs the cupy kernels in CUDA graphs where it can: Mixtral and
Qwen3-MoE exercise the MoE block's capture-safe path, Phi-3 its LongRoPE tables on the
device. Gemma 3 and gpt-oss run their windowed layers (and gpt-oss its attention sinks) on
the cupy kernels too.
LoRA turns graphs off and runs its grouped matmuls on CUDA. Like test_gpu_e2e.py, nothing
here needs gguf or a downloaded model."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from test_gpu_e2e import MAX_NEW, assert_greedy_match, build_tokenizer, hf_greedy, make_prompts

COMMON = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, vocab_size=512,
              initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # family: (model_type, config extras, our LLM's extra arguments, the backend auto must pick)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), {}, "cupy"),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    mlp_only_layers=[0], norm_topk_prob=False), {}, "cupy"),
    # short LongRoPE regime: the engine's max_model_len stays at the original 512 positions
    "phi3": ("phi3", dict(original_max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
        "long_factor": [1.5 + 0.25 * i for i in range(32)]}), dict(max_model_len=512), "cupy"),
    "gemma3": ("gemma3_text", dict(sliding_window=16, query_pre_attn_scalar=48, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "full_attention"]), {}, "cupy"),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                layer_types=["sliding_attention", "full_attention"]), {}, "cupy"),
}


def save_model(folder, model_type: str, extra: dict):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    build_tokenizer().save_pretrained(str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to("cuda").eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf_on_cuda(family, tmp_path):
    from pagedserve import LLM, SamplingParams
    model_type, extra, llm_args, backend = FAMILIES[family]
    hf = save_model(tmp_path, model_type, extra)
    prompts = make_prompts()
    reference = [hf_greedy(hf, p) for p in prompts]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              **{"max_model_len": 1024, **llm_args})
    runner = llm.engine.model_runner
    assert runner.backend.name == backend and (runner.graphs is not None) == (backend == "cupy")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for _ in range(2):  # the second run is served partly from the prefix cache
        for i, (out, ref) in enumerate(zip(llm.generate(prompts, params), reference)):
            assert_greedy_match(out.outputs[0].token_ids, ref, i)


def test_lora_matches_hf_peft_on_cuda(tmp_path):
    from peft import PeftModel
    from bench.lora_adapters import save_random_adapter
    from pagedserve import LLM, SamplingParams
    hf = save_model(tmp_path / "base", "llama", {}).cpu()
    adapters = {name: save_random_adapter(hf, tmp_path / name, rank, targets, seed)
                for name, rank, targets, seed in (("a", 8, ["q_proj", "v_proj"], 1),
                                                  ("b", 4, ["o_proj", "gate_proj", "down_proj"], 2))}
    prompts = make_prompts()[:6]
    reference = {None: [hf_greedy(hf.to("cuda"), p) for p in prompts]}
    for name, folder in adapters.items():
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload().to("cuda").eval()
        reference[name] = [hf_greedy(merged, p) for p in prompts]
    llm = LLM(str(tmp_path / "base"), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=512,
              max_num_seqs=16, enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()},
              max_loras=2, max_lora_rank=8)
    names = [None, "a", "b"]
    jobs = [(name, i) for i in range(len(prompts)) for name in names]  # every batch mixes all three
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([prompts[i] for _, i in jobs], params, lora_name=[name for name, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        assert_greedy_match(out.outputs[0].token_ids, reference[name][i], i)
