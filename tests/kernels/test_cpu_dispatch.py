"""cpu_kernels/dispatch.py: the measured choice of quantized-linear kernel, dtype and thread
count on this machine, cached next to the compiled kernels; and the engine taking it."""

from __future__ import annotations

import json
import logging
import time

import pytest

import cpu_kernels
from cpu_kernels import dispatch, ops
from engine.cpu_tuning import linear_shapes
from engine.models.loader import read_arch_config

SHAPES = [(64, 64), (96, 128)]

pytestmark = pytest.mark.skipif(not cpu_kernels.available("quant_linear"), reason="the quantized kernels did not build")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return tmp_path


def test_candidates_are_what_this_cpu_runs():
    names = dispatch.candidates()
    assert "float32" in names
    assert ("avx512_bf16" in names) == ops.bf16_dot_supported()
    assert ("amx" in names) == ops.bf16_amx_ready()
    assert ("int8" in names) == ops.int_dot_supported()


def test_plan_measures_once_then_reads_its_cache(cache):
    start = time.perf_counter()
    plan = dispatch.plan(SHAPES, 2)
    first = time.perf_counter() - start
    assert plan.arithmetic in dispatch.candidates() and plan.threads in (1, 2)
    assert set(plan.scores_us) == set(dispatch.candidates()) | {f"{n}@1threads" for n in dispatch.candidates()}
    names = [n for n in dispatch.candidates() if n in dispatch.EXACT]  # int8 is measured, never chosen
    assert plan.arithmetic in names
    if plan.threads == 2:  # the fastest at 2 threads, and no 1-thread one 3% faster
        assert plan.scores_us[plan.arithmetic] == min(plan.scores_us[n] for n in names)
        assert min(plan.scores_us[f"{n}@1threads"] for n in names) >= plan.scores_us[plan.arithmetic] * 0.97
    else:
        assert plan.scores_us[f"{plan.arithmetic}@1threads"] == min(plan.scores_us[f"{n}@1threads"] for n in names)
    assert plan.dtype == ("float32" if plan.arithmetic == "float32" else "bfloat16")
    assert plan.arithmetic in plan.reason() and "us per row" in plan.reason()
    files = list((cache / "cpu_kernels").glob("plan-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["arithmetic"] == plan.arithmetic
    start = time.perf_counter()
    assert dispatch.plan(SHAPES, 2) == plan
    assert time.perf_counter() - start < first / 5
    assert dispatch.plan(SHAPES + [(32, 64)], 2) is not None  # other shapes: another entry
    assert len(list((cache / "cpu_kernels").glob("plan-*.json"))) == 2


def test_a_corrupt_cache_entry_is_measured_again(cache):
    plan = dispatch.plan(SHAPES, 1)
    (path,) = (cache / "cpu_kernels").glob("plan-*.json")
    path.write_text("{not json")
    assert dispatch.plan(SHAPES, 1).arithmetic in dispatch.candidates()
    assert json.loads(path.read_text())["threads"] == plan.threads == 1


def test_remeasure_forgets_the_cached_plans(cache):
    dispatch.plan(SHAPES, 1)
    assert dispatch.forget() == 1 and not list(cache.glob("**/plan-*.json"))
    dispatch.plan(SHAPES, 1)
    assert len(list(cache.glob("**/plan-*.json"))) == 1


def _as_if_measured_under_load(path, winner: str, runner_up: str) -> None:
    """Rewrite a cached plan as a busy machine could have measured it: the runner-up's numbers
    under the winner's name and the other way round, so that the slower kernel stands as the
    winner."""
    data = json.loads(path.read_text())
    for value in data.values():
        if isinstance(value, dict) and winner in value and runner_up in value:
            value[winner], value[runner_up] = value[runner_up], value[winner]
    data["arithmetic"] = runner_up
    path.write_text(json.dumps(data))


two_kernels = pytest.mark.skipif(not ops.bf16_dot_supported(), reason="needs the bf16 kernels beside the float32 one")


@two_kernels
def test_a_plan_measured_under_load_is_caught_at_start_and_measured_again(cache, caplog):
    good = dispatch.plan(SHAPES, 1)  # one thread: the kernels' own speeds, steady on a shared machine
    assert good.arithmetic != "float32"  # the bf16 kernels do about twice the work per second
    (path,) = (cache / "cpu_kernels").glob("plan-*.json")
    _as_if_measured_under_load(path, good.arithmetic, "float32")
    with caplog.at_level(logging.INFO, logger="pagedserve.cpu_kernels"):
        again = dispatch.plan(SHAPES, 1)
    assert again.arithmetic == good.arithmetic, again.reason()
    assert json.loads(path.read_text())["arithmetic"] == good.arithmetic  # the cache is mended
    assert "measuring again" in caplog.text


@two_kernels
def test_a_good_cached_plan_is_kept_after_a_quick_check(cache, caplog):
    """The bundled model's plan: the check at start-up takes a small part of a measurement
    (about 0.1 s against 1-2 s on a 2-core VM) and keeps the plan as it is."""
    start = time.perf_counter()
    good = dispatch.plan(dispatch.DEFAULT_SHAPES, 1)
    measured_s = time.perf_counter() - start
    (path,) = (cache / "cpu_kernels").glob("plan-*.json")
    text = path.read_text()
    start = time.perf_counter()
    assert dispatch.quick_check(good, 1) is None
    checked_s = time.perf_counter() - start
    print(f"measured in {measured_s:.2f} s, checked in {checked_s:.3f} s")
    assert checked_s < measured_s / 4, (checked_s, measured_s)
    dispatch._HOLDING.clear()  # as in a new process: the cached plan is read, checked and kept
    with caplog.at_level(logging.INFO, logger="pagedserve.cpu_kernels"):
        assert dispatch.plan(dispatch.DEFAULT_SHAPES, 1) == good
    assert path.read_text() == text and "measuring again" not in caplog.text


def test_the_timed_bf16_weights_are_whole_packed_weights():
    """The weights the plan is timed on are random nibbles, and in the bf16 layout one packed
    super-group of 128 rows repeated: that must be the packing of a whole [n, k] weight (its
    rows repeated), so that the kernels read as much as a real layer's."""
    import torch

    from cpu_kernels import packing
    from cpu_kernels.quant_format import QuantizedTensor
    n, k = 300, 64  # two super-groups and a tail of 44 rows
    (data,) = dispatch._random_weight("avx512_bf16", n, k)
    qweight, scales, zeros = dispatch._random_weight("float32", 128, k)  # the same rows, by their seed
    rows = torch.cat([torch.arange(128), torch.arange(128), torch.arange(44)])
    whole = QuantizedTensor("int4", qweight[rows], scales[rows], zeros[rows])
    assert torch.equal(data, packing.pack(whole).data)


def test_the_environment_pins_a_kernel(cache, monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "float32")
    plan = dispatch.plan(SHAPES, 2)
    assert (plan.arithmetic, plan.threads, plan.dtype) == ("float32", 2, "float32")
    assert dispatch.ENV in plan.measured_at and not list(cache.glob("**/plan-*.json"))
    monkeypatch.setenv(dispatch.ENV, "tensor-cores")
    with pytest.raises(ValueError, match="this CPU runs"):
        dispatch.plan(SHAPES, 2)
    monkeypatch.setenv(dispatch.ENV, "int8")  # a choice of numbers: the engine's flag
    with pytest.raises(ValueError, match="--cpu-arithmetic int8"):
        dispatch.plan(SHAPES, 2)


@pytest.mark.skipif(not ops.int_dot_supported(), reason="the integer kernels need AVX512-VNNI")
def test_the_timed_int8_weights_are_whole_packed_weights():
    """As the bf16 ones: 128 rows packed for the integer kernels, repeated, are the packing of
    the whole weight of those rows repeated (the layout's groups of 16 rows are independent)."""
    import torch

    from cpu_kernels import int_dot_format
    from cpu_kernels.quant_format import QuantizedTensor
    n, k = 300, 64
    (data,) = dispatch._random_weight("int8", n, k)
    qweight, scales, zeros = dispatch._random_weight("float32", 128, k)
    rows = torch.cat([torch.arange(128), torch.arange(128), torch.arange(44)])
    whole = QuantizedTensor("int4", qweight[rows], scales[rows], zeros[rows])
    assert torch.equal(data, int_dot_format.pack(whole).data)


def test_dtype_auto_follows_the_machine_plan(cache, monkeypatch):
    from engine.config import resolve_dtype
    monkeypatch.setenv(dispatch.ENV, "float32")
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    if ops.bf16_dot_supported():
        monkeypatch.setenv(dispatch.ENV, "avx512_bf16")
        assert resolve_dtype("auto", "cpu") == "bfloat16"


def test_linear_shapes_of_the_bundled_model(bundled_path):
    """SmolLM2-135M: fused qkv (9 + 2 x 3 heads of 64), o, gate_up, down: the shapes the
    machine plan (`--dtype auto`) is measured on."""
    shapes = linear_shapes(read_arch_config(bundled_path))
    assert shapes == [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert sorted(shapes) == sorted(dispatch.DEFAULT_SHAPES)


@pytest.mark.skipif(not ops.bf16_dot_supported(), reason="the bf16 kernels need AVX512-BF16")
def test_the_engine_runs_the_plan(bundled_path, cache, monkeypatch):
    """The model runner asks for the plan of its model's shapes and packs the layers in its
    arithmetic; the same prompt alone and in a batch gives the same tokens and logprobs."""
    from pagedserve import LLM, SamplingParams
    arithmetic = "amx" if ops.bf16_amx_ready() else "avx512_bf16"
    monkeypatch.setenv(dispatch.ENV, arithmetic)
    llm = LLM(str(bundled_path), dtype="auto", device="cpu", num_kv_blocks=64)
    runner = llm.engine.model_runner
    assert runner.kernel_plan.arithmetic == arithmetic and runner.config.dtype == "bfloat16"
    assert runner.model.lm_head.amx == (arithmetic == "amx")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 2113, 314, 253, 7473, 30, 378, 1489, 563, 2],
               [1, 17, 18, 19, 20]]
    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_an_unchecked_read_takes_the_cached_plan_as_it_is(cache, monkeypatch):
    """A benchmark's report reads what its servers read: no quick check, which under a peer
    server's load would time that load and rewrite the shared plan."""
    plan = dispatch.plan(SHAPES, 1)
    monkeypatch.setattr(dispatch, "quick_check", lambda *args: pytest.fail("checked"))
    dispatch._HOLDING.clear()
    assert dispatch.plan(SHAPES, 1, unchecked=True) == plan
