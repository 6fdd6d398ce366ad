"""Multi-LoRA against HF+PEFT: each request's greedy output equals HF's with its adapter
merged (`merge_and_unload`), float32, while requests for three adapters (different ranks and
targets, one rsLoRA) and the base model share steps, under chunking, prefix caching and
preemption; the prefix cache never lets two adapters share KV; errors are clear."""

from __future__ import annotations

import argparse

import pytest
import torch

import cpu_kernels
from common.errors import LoraError
from engine.layers.quantized import QuantLinear, dequantize_modules
from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak, check_outputs_match
from lora_helpers import build_lora_setup, lora_prompts, references

MAX_NEW = 12
NAMES = [None, "a", "b", "c"]
CONFIGS = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "preempted_cached": dict(num_kv_blocks=16, max_num_batched_tokens=48),
    "two_slots": dict(max_loras=2),  # requests for a third adapter wait their turn
    "ngram": dict(speculative_method="ngram", enable_prefix_caching=False),  # drafts verified per adapter
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled_tokenizer):
    folder, adapters = build_lora_setup(tmp_path_factory.mktemp("lora"), bundled_tokenizer)
    prompts = lora_prompts()
    return folder, adapters, prompts, references(folder, adapters, prompts, MAX_NEW)


def _llm(setup, **config) -> LLM:
    folder, adapters, _, _ = setup
    return LLM(str(folder), dtype="float32", lora_modules={n: str(p) for n, p in adapters.items()},
               max_lora_rank=16, **config)


def _record_steps(llm: LLM) -> list[set]:
    """The set of adapters (None: base) of each step's scheduled requests."""
    steps, execute = [], llm.engine.model_runner.execute

    def recording(sched):
        steps.append({s.request.lora_name for s in sched.scheduled})
        return execute(sched)

    llm.engine.model_runner.execute = recording
    return steps


@pytest.mark.parametrize("config", list(CONFIGS))
def test_mixed_adapters_match_hf_peft(setup, config):
    _, _, prompts, refs = setup
    llm = _llm(setup, **CONFIGS[config])
    steps = _record_steps(llm)
    # Every prompt under every adapter and the base model, all in one generate.
    jobs = [(p, name) for p in range(len(prompts)) for name in NAMES]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    runs = 2 if llm.config.enable_prefix_caching else 1
    for _ in range(runs):  # the second run is served from the prefix cache, where it is on
        outs = llm.generate([prompts[p] for p, _ in jobs], params, lora_name=[n for _, n in jobs])
        ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert check_outputs_match(ours, [refs[n][p] for p, n in jobs]) <= 1
    max_loras = llm.config.max_loras
    assert max(len(s - {None}) for s in steps) == min(3, max_loras)  # steps really mixed adapters
    assert any(None in s and len(s) >= min(3, max_loras) for s in steps)  # ... with the base model
    assert all(len(s - {None}) <= max_loras for s in steps)
    stats = llm.engine.stats()
    if "num_kv_blocks" in CONFIGS[config]:
        assert stats.num_preemptions > 0
    if llm.config.enable_prefix_caching:
        assert stats.num_prefix_cache_hits > 0
    if llm.config.speculative_method:
        assert stats.spec_decoding.num_draft_tokens > 0
    assert_no_leak(llm)


def test_adapters_change_the_output(setup):
    """Guards the test above: the adapters are far enough from the base and each other."""
    _, _, _, refs = setup
    tokens = {name: [t for t, _ in refs[name]] for name in NAMES}
    assert len({str(t) for t in tokens.values()}) == len(NAMES)


def test_prefix_cache_is_keyed_by_adapter(setup):
    _, _, prompts, refs = setup
    llm = _llm(setup)
    prompt = prompts[1]  # 60 tokens: 3 full blocks
    params = SamplingParams(temperature=0, max_tokens=4)
    cached = {}
    for name in ("a", "b", None, "a", None):
        out = llm.generate(prompt, params, lora_name=name)[0]
        assert out.outputs[0].token_ids == refs[name][1][0][:4]
        cached.setdefault(name, []).append(out.num_cached_tokens)
    assert cached["b"] == [0] and cached[None][0] == 0  # other adapters' blocks are never hit
    assert cached["a"][1] == 48 and cached[None][1] == 48  # the same adapter (or base) again hits
    assert_no_leak(llm)


def test_load_unload_at_run_time(setup):
    folder, adapters, prompts, refs = setup
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8)
    assert llm.lora_adapters() == []
    names = [a.name for a in llm.load_lora("b", str(adapters["b"]))]
    assert names == ["b"]
    with pytest.raises(LoraError, match="exceeds --max-lora-rank 8") as e:
        llm.load_lora("c", str(adapters["c"]))  # rank 16
    assert e.value.kind == "invalid"
    with pytest.raises(LoraError, match="already loaded") as e:
        llm.load_lora("b", str(adapters["a"]))
    assert e.value.kind == "conflict"
    out = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=MAX_NEW), lora_name="b")
    assert out[0].outputs[0].token_ids == refs["b"][2][0]
    llm.engine.add_request("busy", prompts[2], SamplingParams(max_tokens=2), lora_name="b")
    with pytest.raises(LoraError, match="in flight") as e:  # unloading under running requests: refused
        llm.unload_lora("b")
    assert e.value.kind == "conflict"
    llm.engine.abort_requests(["busy"])
    assert llm.unload_lora("b") == []
    with pytest.raises(ValueError, match="'b' is not loaded"):
        llm.generate(prompts[2], lora_name="b")
    with pytest.raises(LoraError) as e:
        llm.unload_lora("b")
    assert e.value.kind == "not_found"
    assert_no_leak(llm)


def test_errors(setup):
    folder, adapters, prompts, _ = setup
    with pytest.raises(ValueError, match="rank 16 exceeds --max-lora-rank 8"):
        LLM(str(folder), dtype="float32", lora_modules={"c": str(adapters["c"])}, max_lora_rank=8)
    llm = LLM(str(folder), dtype="float32")  # LoRA off
    with pytest.raises(ValueError, match="'a' is not loaded .*LoRA is off"):
        llm.generate(prompts[0], lora_name="a")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.load_lora("a", str(adapters["a"]))
    llm = _llm(setup)
    with pytest.raises(ValueError, match="'nope' is not loaded"):  # nothing runs, nothing leaks
        llm.generate([prompts[0], prompts[1]], lora_name=["a", "nope"])
    with pytest.raises(ValueError, match="lora_name: got 1 for 2 prompts"):
        llm.generate([prompts[0], prompts[1]], lora_name=["a"])
    with pytest.raises(LoraError, match="cannot read adapter_config.json"):
        llm.load_lora("x", str(folder))  # the base model's folder is no adapter
    assert_no_leak(llm)


@pytest.mark.skipif(not cpu_kernels.available("quant_linear"), reason="CPU quant_linear kernels unavailable")
def test_quantized_base_layers(setup):
    """LoRA around QuantLinear (int4, as the bundled Q4_1 GGUF runs) equals LoRA around the
    dense layers of the same effective weights."""
    _, _, prompts, _ = setup
    llm = _llm(setup, quantization="int4", enable_prefix_caching=False)
    layer = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.base, QuantLinear)
    jobs = [(p, name) for p in range(3) for name in NAMES]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)

    def run():
        outs = llm.generate([prompts[p] for p, _ in jobs], params, lora_name=[n for _, n in jobs])
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    quantized = run()
    dequantize_modules(llm.engine.model_runner.model, torch.float32)
    assert not isinstance(layer.base, QuantLinear)
    assert check_outputs_match(quantized, run()) <= 1
    assert len({str(t) for t, _ in quantized[:len(NAMES)]}) == len(NAMES)  # the adapters act
    assert_no_leak(llm)


def test_bench_lora_runs(setup, tmp_path):
    """`pagedserve bench lora` end to end on the tiny model: adapters made by peft from the
    model's shapes alone, every mix run, the JSON written."""
    import json

    from bench.lora import add_arguments, run
    folder = setup[0]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--num-adapters", "1,3", "--ranks", "4,8",
                              "--num-prompts", "6", "--input-len", "8", "--output-len", "3",
                              "--dtype", "float32", "--repeats", "1", "--output-dir", str(tmp_path)])
    assert run(args) == 0
    result = json.loads(next(tmp_path.glob("lora-*.json")).read_text())
    rows = result["results"]
    assert list(rows) == ["base, LoRA off", "base, LoRA on", "1 adapter", "3 adapters"]
    assert rows["3 adapters"]["max_adapters_per_step"] == 3 and rows["1 adapter"]["max_adapters_per_step"] == 1
    assert all(r["output_tok_s"] > 0 for r in rows.values()) and len(result["loadavg_end"]) == 3
    assert next(tmp_path.glob("lora-*.png")).stat().st_size > 0
