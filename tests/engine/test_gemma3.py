"""Gemma 3 against HF transformers, greedy, in float32: the bundled 270M Q4_K_M GGUF (the
same file on both sides, one prompt past the 512-token window), and a tiny random-weight
Gemma 3 with a 16-token window under batching, chunking, prefix caching, preemption and
tensor parallelism. Also: Q5_0/Q4_K re-blocking is exact, the large-vocabulary top-k/top-p
prefilter keeps the full sort's tokens, unknown GGUF architectures and types are named."""

from __future__ import annotations

import pytest
import torch

from bench.hf_reference import load_hf_float32
from pagedserve import LLM, SamplingParams
from helpers import assert_matches_hf, assert_no_leak, check_outputs_match, hf_greedy
from test_tiny_hf_equivalence import CONFIGS, tiny_prompts

pytestmark = pytest.mark.heavy(84)  # seconds on the 2-core CI machine: scheduled first

GGUF_MAX_NEW = 10
TINY_MAX_NEW = 24
TINY_WINDOW = 16  # most prompts and generations run past it


def tiny_gemma3_config(**overrides):
    """3 layers (local, local, global), query_pre_attn_scalar != head_dim, linear rope
    scaling on the global layer only, tied embeddings: every Gemma quirk at tiny size."""
    from transformers import AutoConfig
    return AutoConfig.for_model(
        "gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, vocab_size=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        **overrides)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_gemma3_config(), dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norm weights at 0; make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(str(folder), safe_serialization=True)
    bundled_tokenizer.save_pretrained(str(folder))
    prompts = tiny_prompts()
    return folder, prompts, hf_greedy(hf, prompts, TINY_MAX_NEW)


def test_tiny_config_reads_every_quirk(tiny):
    from engine.models.loader import read_arch_config
    cfg = read_arch_config(tiny[0])
    assert cfg.model_type == "gemma3_text" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [TINY_WINDOW, TINY_WINDOW, None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert cfg.rope_scaling["rope_type"] == "linear"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tiny_matches_hf(tiny, config):
    folder, prompts, reference = tiny
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert_matches_hf(llm, prompts, reference, TINY_MAX_NEW, preempted="num_kv_blocks" in CONFIGS[config])


def test_softcapping_is_refused(tmp_path):
    from engine.models.config import ModelArchConfig
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelArchConfig.from_hf(tiny_gemma3_config(final_logit_softcapping=30.0))


@pytest.fixture(scope="module")
def gemma_gguf():
    from engine.models.source import gemma3_model_path
    return gemma3_model_path()


def test_gguf_config(gemma_gguf):
    from engine.models.gguf_loader import gguf_block_formats
    from engine.models.loader import linear_formats, read_arch_config
    cfg = read_arch_config(gemma_gguf)
    assert (cfg.model_type, cfg.vocab_size, cfg.num_layers, cfg.head_dim) == ("gemma3_text", 262144, 18, 256)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    formats = linear_formats(gemma_gguf, cfg, None)
    # Q5_0/Q8_0 run through the int8 kernels (the tied head: Q8_0), Q4_K the int4 ones; Q6_K dense.
    assert formats["lm_head"] == "int8" and formats["model.layers.0.mlp.gate_up_proj"] == "int8"
    assert formats["model.layers.0.self_attn.o_proj"] == "int4"
    stored = gguf_block_formats(gemma_gguf)
    down = [formats.get(f"model.layers.{i}.mlp.down_proj") for i in range(18)]
    assert down.count("int4") == 9 and down.count(None) == 9  # Q4_K / Q6_K
    assert len(stored) == 10 + 81 + 27


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K"])
def test_reblocking_is_exact(gemma_gguf, kind):
    from gguf.quants import dequantize

    from engine.models.gguf_loader import _blocks, _gguf
    tensor = next(t for t in _gguf(gemma_gguf).tensors if t.tensor_type.name == kind)
    ours = _blocks(tensor.data, kind)
    assert ours.format == ("int8" if kind == "Q5_0" else "int4")
    assert torch.equal(ours.dequantize(), torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()))


def test_gguf_matches_hf(gemma_gguf):
    """The real model, both sides reading the same Q4_K_M file, GGUF_MAX_NEW greedy tokens of a
    plain prompt, a chat turn and one prompt past the local layers' window. (HF's generate of
    this 262k-vocabulary model in fp32 costs a few seconds a prompt on one thread: the three
    kinds, not more of each.)"""
    llm = LLM(str(gemma_gguf), dtype="float32", enable_prefix_caching=True)
    tok = llm.tokenizer
    prompts = [tok.encode("The capital of France is")]
    prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                      tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    # Past the 512-token window: the local layers must stop seeing the start.
    long_text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(90))
    prompts.append(tok.encode(long_text + " The colour of item 7 is"))
    assert len(prompts[-1]) > 600
    params = SamplingParams(temperature=0, max_tokens=GGUF_MAX_NEW, min_tokens=GGUF_MAX_NEW, logprobs=5,
                            ignore_eos=True)
    outs = llm.generate(prompts, params)
    ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert_no_leak(llm)
    del llm
    assert check_outputs_match(ours, hf_greedy(load_hf_float32(gemma_gguf), prompts, GGUF_MAX_NEW)) == 0


@pytest.mark.parametrize("top_k, top_p", [([50, 5, 2000], [1.0, 0.9, 0.5]), ([262144, 40, 262144], [0.9, 0.95, 0.3])])
def test_large_vocab_top_k_top_p_over_the_window_equals_the_full_sort(top_k, top_p):
    """Gemma's 262k vocabulary: the partial sort keeps exactly the tokens the full sort does."""
    from engine import sampler
    torch.manual_seed(0)
    logits = torch.randn(3, 262144) * 3
    logits[0, :10] = 20.0  # ties at the top, holding most of the mass (as an LM's logits do)
    logits[2] = logits[2] * 4  # peaked: top-p mass sits in a few tokens
    assert sampler._window(logits.clone(), top_k, top_p) is not None  # the fast path is taken
    assert sampler._window(torch.randn(1, 262144), [262144], [0.9]) is None  # flat: a full sort
    fast = sampler._apply_top_k_top_p(logits.clone(), top_k, top_p)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    full = logits.clone().scatter_(1, order, sampler._filter_sorted(sorted_logits, top_k, top_p))
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], full[full.isfinite()])


def test_tp2_greedy_equals_tp1(tiny):
    """Gemma 3 shards as Llama does (same layer names): TP=2 gives TP=1's greedy tokens."""
    from test_tensor_parallel import assert_same, engine, run
    folder = tiny[0]
    with engine(folder) as llm:
        reference = run(llm, 512)
    with engine(folder, tensor_parallel_size=2) as llm:
        assert llm.engine.model_runner.shard.size == 2
        assert_same(reference, run(llm, 512))


def _write_gguf(path, arch: str, tensor) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_gguf_architecture_and_tensor_type_are_named(tmp_path):
    import numpy as np

    from engine.models.gguf_loader import iter_gguf_weights, read_gguf_config
    _write_gguf(tmp_path / "mamba.gguf", "mamba", np.zeros((4, 32), np.float32))
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported \(supported: gemma3, llama"):
        read_gguf_config(tmp_path / "mamba.gguf")
    _write_gguf(tmp_path / "f64.gguf", "llama", np.zeros((4, 32), np.float64))
    with pytest.raises(ValueError, match=r"type F64, which is not supported \(supported: Q4_0, .*Q4_K.*F32"):
        list(iter_gguf_weights(tmp_path / "f64.gguf", None))
