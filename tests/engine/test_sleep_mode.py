"""Sleep, wake and weight updates in the engine (offline `LLM` and `EngineCore`): greedy output
is the same before and after a sleep of either level, a sleep in the middle of generation loses
nothing and changes no token, an update serves the new checkpoint's tokens (those of an `LLM`
loaded from it), and a wrong shape, another architecture or a missing path is refused with the
old weights still serving. No KV block leaks (the autouse fixture checks every engine)."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest, Unavailable
from common.sampling_params import SamplingParams
from helpers import assert_engine_idle
from pagedserve import LLM

PROMPTS = ["The capital of France is", "Count: 1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=1)


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def checkpoints(weight_checkpoints):
    return weight_checkpoints


@pytest.fixture(scope="module")
def bundled(bundled_path):
    return LLM(str(bundled_path), dtype="float32", num_kv_blocks=64, num_threads=1)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Each checkpoint's greedy tokens, from an LLM loaded from it."""
    return {name: tokens(LLM(str(checkpoints[name]), **OPTIONS)) for name in ("a", "b")}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_keeps_greedy_output(bundled, level):
    llm = bundled
    before = tokens(llm)
    llm.sleep(level)
    runner = llm.engine.model_runner
    assert runner.kv_caches == [] and (runner.model is None) == (level == 2)
    llm.sleep(level)  # asleep already: nothing to do
    with pytest.raises(InvalidRequest, match="asleep at level"):
        llm.sleep(3 - level)
    with pytest.raises(Unavailable, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    llm.wake_up()  # awake already: nothing to do
    assert tokens(llm) == before
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sleep_mid_generation_loses_nothing(checkpoints, async_scheduling):
    """Requests running when the engine falls asleep wait, then finish with the same tokens;
    with async scheduling, the step in flight at the sleep gives its tokens then."""
    core = LLM(str(checkpoints["a"]), async_scheduling=async_scheduling, **OPTIONS).engine
    ids = [list(range(5, 5 + 7 * (i + 1))) for i in range(3)]
    want = {}
    for i, prompt in enumerate(ids):  # uninterrupted first
        core.add_request(f"w{i}", prompt, GREEDY)
    while core.has_unfinished_requests():
        for out in core.step():
            want.setdefault(out.request_id[1:], []).extend(out.new_token_ids)
    got = {}
    for i, prompt in enumerate(ids):
        core.add_request(f"s{i}", prompt, GREEDY)
    for _ in range(4):  # prefills and a few decodes
        for out in core.step():
            got.setdefault(out.request_id[1:], []).extend(out.new_token_ids)
    assert (core._inflight is not None) == async_scheduling  # a step in flight at the sleep
    for out in core.sleep(1):
        got.setdefault(out.request_id[1:], []).extend(out.new_token_ids)
    assert core.stats().num_running == 0 and core.stats().num_waiting == 3
    assert not core.has_unfinished_requests() and core.step() == []
    core.wake_up()
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id[1:], []).extend(out.new_token_ids)
    assert got == want
    assert core.scheduler.num_preemptions >= 3


def test_update_weights_serves_the_new_checkpoint(checkpoints, reference):
    assert reference["a"] != reference["b"]
    llm = LLM(str(checkpoints["a"]), enable_prefix_caching=True, **OPTIONS)
    assert tokens(llm) == reference["a"]
    llm.update_weights(str(checkpoints["b"]))
    assert tokens(llm) == reference["b"]  # the prefix cache forgot a's KV of the same prompts
    assert llm.engine.weights_path == checkpoints["b"]
    llm.sleep(2)  # a level-2 wake reloads the updated weights, not the started ones
    llm.wake_up()
    assert tokens(llm) == reference["b"]


@pytest.mark.parametrize("name, match", [("wide", "does not fit the live model: .* is \\["),
                                         ("qwen2", "is a qwen2 model"),
                                         ("missing", "does not exist")])
def test_update_weights_refuses_what_does_not_fit(checkpoints, reference, tmp_path, name, match):
    llm = LLM(str(checkpoints["a"]), **OPTIONS)
    path = str(checkpoints.get(name, tmp_path / "nothing-here"))
    with pytest.raises(InvalidRequest, match=match):
        llm.update_weights(path)
    assert tokens(llm) == reference["a"]  # the old weights keep serving


def test_with_lora_level_1_only_and_no_update(checkpoints, reference):
    """The adapters' layers wrap the live weights: a level-2 sleep or an update is refused, clearly."""
    llm = LLM(str(checkpoints["a"]), enable_lora=True, max_lora_rank=8, **OPTIONS)
    with pytest.raises(InvalidRequest, match="enable-lora"):
        llm.sleep(2)
    with pytest.raises(InvalidRequest, match="enable-lora"):
        llm.update_weights(str(checkpoints["b"]))
    llm.sleep(1)
    llm.wake_up()
    assert tokens(llm) == reference["a"]


@pytest.mark.parametrize("level", [1, 2])
def test_update_weights_while_asleep(checkpoints, reference, level):
    """An RL loop's order: sleep, (train), update, wake. A level-2 sleep freed the weights: the
    update is checked against their names, shapes and dtypes, kept from before."""
    llm = LLM(str(checkpoints["a"]), **OPTIONS)
    llm.sleep(level)
    with pytest.raises(InvalidRequest, match="does not fit the live model"):
        llm.update_weights(str(checkpoints["wide"]))
    llm.update_weights(str(checkpoints["b"]))
    assert llm.engine.sleep_level == level and llm.engine.model_runner.kv_caches == []
    llm.wake_up()
    assert tokens(llm) == reference["b"]
