"""Greedy output of a tiny random-weight Llama on CUDA: our LLM with the cupy backend
(with and without CUDA graphs) against HF transformers generate on the same GPU, fp32.

The model is built from a config (no download) with head size 64 and GQA 4:1, saved
with a word-level tokenizer made here, so that neither the bundled model nor gguf is
needed on the GPU machine."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)

MAX_NEW = 24
VOCAB = 512
CONFIGS = {
    # Async scheduling is on by default with graphs; these two keep the synchronous loop covered.
    "graphs": dict(cuda_graphs=True, async_scheduling=False),
    "eager": dict(cuda_graphs=False),
    "chunked_bs32": dict(cuda_graphs=True, async_scheduling=False, block_size=32, max_num_batched_tokens=64),
    # Decode steps one ahead (engine/async_step.py): plain greedy rows (ignore_eos rather than
    # min_tokens, which keeps a row off the argmax-only path until it is reached).
    "async": dict(cuda_graphs=True, async_scheduling=True),
    # The decoder's norms, rotary and activation in eager torch rather than cupy_kernels' fused ops.
    "eager_layers": dict(cuda_graphs=True, async_scheduling=False, layer_kernels=False),
}


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0",
                                   unk_token="t3")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig
    folder = tmp_path_factory.mktemp("tiny-llama-gpu")
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, vocab_size=VOCAB,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    build_tokenizer().save_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to("cuda").eval()
    prompts = make_prompts()
    return folder, prompts, [hf_greedy(hf, p) for p in prompts]


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    shared = [prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 33)]
    return shared + [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 15, 16, 17, 100, 300)]


@torch.inference_mode()
def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    logprobs = [torch.log_softmax(step[0].float(), -1).cpu() for step in out.logits]
    return out.sequences[0, len(ids):].tolist(), logprobs


def assert_greedy_match(ours: list[int], ref: tuple[list[int], list[torch.Tensor]], prompt: int) -> None:
    """Token for token; a first divergence passes only where HF's top two were within 1e-3
    (a near tie that fp32 summation order may break either way); comparison stops there."""
    tokens, logprobs = ref
    for pos, (a, b) in enumerate(zip(ours, tokens)):
        if a != b:
            top2 = logprobs[pos].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < 1e-3 and a in logprobs[pos].topk(2).indices.tolist(), (
                f"prompt {prompt} diverges at token {pos}: ours {a}, HF {b} (HF top-2 gap {gap:.2e})")
            return
    assert len(ours) == len(tokens)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_cupy_backend_matches_hf(tiny_llama, config):
    from pagedserve import LLM, SamplingParams
    folder, prompts, reference = tiny_llama
    llm = LLM(str(folder), device="cuda", dtype="float32", attention_backend="cupy", num_kv_blocks=256,
              max_model_len=512, max_num_seqs=8, **CONFIGS[config])
    runner = llm.engine.model_runner
    assert (runner.graphs is not None) == CONFIGS[config]["cuda_graphs"]
    replays = count_replays(runner)
    launches = count_launches(runner)
    if config == "async":
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for _ in range(2):  # the second run is served partly from the prefix cache
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert_greedy_match(out.outputs[0].token_ids, ref, i)
    assert llm.engine.stats().num_prefix_cache_hits > 0
    if runner.graphs is not None:
        assert replays[0] > 0, "no decode step went through a CUDA graph"
    assert (launches[0] > 0) == (config == "async")


def count_launches(runner) -> list[int]:
    """Steps launched ahead of the one before (previous= given), on this runner."""
    count = [0]
    launch = runner.launch

    def counted(sched, previous=None):
        count[0] += previous is not None
        return launch(sched, previous)
    runner.launch = counted
    return count


def count_replays(runner) -> list[int]:
    count = [0]
    if runner.graphs is not None:
        run = runner.graphs.run

        def counted(*args, **kwargs):
            count[0] += 1
            return run(*args, **kwargs)
        runner.graphs.run = counted
    return count


def test_auto_backend_on_cuda_is_cupy_with_graphs(tiny_llama):
    """With no backend named, a CUDA engine runs the cupy kernels in CUDA graphs, scheduled async."""
    from pagedserve import LLM, SamplingParams
    folder, prompts, reference = tiny_llama
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)
    runner = llm.engine.model_runner
    assert runner.backend.name == "cupy" and runner.graphs is not None and llm.engine.async_scheduling
    from cupy_kernels import ops
    from engine.layers.norm import RMSNorm
    assert all(m.kernels is ops for m in runner.model.modules() if isinstance(m, RMSNorm))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert_greedy_match(out.outputs[0].token_ids, ref, i)


def test_seeded_samples_launched_ahead_equal_the_synchronous_ones(tiny_llama):
    """Plain random rows sampled on the device in steps launched ahead (their seeded keys one
    output position further): the tokens of the synchronous engine, on the same GPU."""
    from pagedserve import LLM, SamplingParams
    folder, prompts, _ = tiny_llama
    params = [SamplingParams(temperature=0.5 + 0.25 * i, seed=i, min_p=0.02 * (i % 2), max_tokens=MAX_NEW,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for on in (False, True):
        llm = LLM(str(folder), device="cuda", dtype="float32", attention_backend="cupy", num_kv_blocks=256,
                  max_model_len=512, max_num_seqs=8, cuda_graphs=True, async_scheduling=on)
        launches = count_launches(llm.engine.model_runner)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (launches[0] > 0) == on
    assert outs[True] == outs[False]


def test_auto_device_and_a_gpu_share_size_the_pool(tiny_llama, caplog):
    """`--device auto` (the default) is cuda here, and --gpu-memory-utilization gives the KV pool
    its share of the GPU less the weights and a profiled step's activations (engine/kv_sizing.py)."""
    import logging
    from pagedserve import LLM, SamplingParams
    folder, prompts, reference = tiny_llama
    total = torch.cuda.mem_get_info()[1]
    share = min(0.3, (torch.cuda.mem_get_info()[0] - 2**30) / total)  # what the GPU has free, less 1 GiB
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        llm = LLM(str(folder), dtype="float32", gpu_memory_utilization=share, max_model_len=512, max_num_seqs=8)
    assert llm.config.device == "cuda"
    assert any(r.getMessage().startswith("device auto: cuda (") for r in caplog.records)
    sizing = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu_memory_utilization"))
    runner = llm.engine.model_runner
    pool_bytes = runner.num_kv_blocks * runner._bytes_per_block()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert share * total - weights - 2**30 < pool_bytes <= share * total - weights, sizing
    assert sum(c.numel() * c.element_size() for c in runner.kv_caches) == pool_bytes
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert_greedy_match(out.outputs[0].token_ids, ref, i)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        LLM(str(folder), dtype="float32", gpu_memory_utilization=1e-6, max_model_len=512, max_num_seqs=8)


@pytest.mark.parametrize("kind,layer", [("gptq-actorder-asym", "TinyGemmInt4Linear"), ("awq", "TinyGemmInt4Linear"),
                                        ("ct-fp8", "ScaledMmFp8Linear")])
def test_quantized_checkpoint_on_cuda_runs_as_stored(tiny_llama, tmp_path, kind, layer):
    """A GPTQ (act-order, asymmetric), AWQ or FP8 checkpoint on CUDA keeps its layers as stored
    (engine/layers/cuda_quant.py) and its first greedy token is the float model of its
    dequantized weights' for most prompts (tinygemm's bf16 scales, FP8's quantized activations
    and bf16 itself may each move a near tie)."""
    from pagedserve import LLM, SamplingParams
    from quant_packing import export
    folder, prompts, _ = tiny_llama
    export(folder, tmp_path / kind, tmp_path / "reference", kind)
    engine = dict(device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    llm = LLM(str(tmp_path / kind), **engine)
    kinds = {type(m).__name__ for m in llm.engine.model_runner.model.modules()}
    assert layer in kinds or (layer == "ScaledMmFp8Linear" and torch.cuda.get_device_capability() < (8, 9))
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    del llm
    ref = [out.outputs[0].token_ids for out in LLM(str(tmp_path / "reference"), **engine).generate(prompts, params)]
    assert sum(a[0] == b[0] for a, b in zip(ours, ref)) >= len(prompts) - 2


def fp8_llm(folder, backend: str, graphs: bool):
    from pagedserve import LLM
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", attention_backend=backend, kv_cache_dtype="fp8",
              num_kv_blocks=256, max_model_len=512, max_num_seqs=8, cuda_graphs=graphs, async_scheduling=False)
    runner = llm.engine.model_runner
    assert runner.backend.name == backend and runner.kv_caches[0].dtype == torch.float8_e4m3fn
    return llm


@pytest.fixture(scope="module")
def fp8_torch_reference(tiny_llama):
    """The torch backend's greedy tokens and top-5 logprobs over an fp8 cache (bf16 model), two
    runs (the second from the prefix cache)."""
    from helpers import assert_no_leak, greedy_with_logprobs
    folder, prompts, _ = tiny_llama
    llm = fp8_llm(folder, "torch", graphs=False)
    runs = [greedy_with_logprobs(llm, prompts, MAX_NEW) for _ in range(2)]
    assert_no_leak(llm)
    return runs


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp8_kv_cache_on_cupy_matches_the_torch_reference(tiny_llama, fp8_torch_reference, graphs):
    """--kv-cache-dtype fp8 with a bf16 model: the cupy kernels (quantizing cache write, decode
    in CUDA graphs or eagerly, FlashAttention prefill over the widened cache) against the torch
    backend over the same fp8 format, the dequantizing reference: greedy tokens equal but for
    near ties (check_outputs_match: each side's token in the other's top 5), twice (the second
    run from the prefix cache), and no block leaked."""
    from helpers import assert_no_leak, check_outputs_match, greedy_with_logprobs
    folder, prompts, _ = tiny_llama
    llm = fp8_llm(folder, "cupy", graphs)
    replays = count_replays(llm.engine.model_runner)
    for run in range(2):  # bf16 arithmetic in another order (flash, split-K) may break near ties
        ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
        assert check_outputs_match(ours, fp8_torch_reference[run]) <= len(prompts) // 2
    assert llm.engine.stats().num_prefix_cache_hits > 0
    assert (replays[0] > 0) == graphs
    assert_no_leak(llm)
