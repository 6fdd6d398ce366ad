"""Async scheduling (engine/async_step.py) on the bundled model, on CPU: the same pipeline as on
a GPU (steps scheduled and launched one ahead, stops applied one step late), with the forward
run synchronously. Nothing it does may change an output."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model_runner import ModelRunner
from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak

pytestmark = pytest.mark.heavy(110)  # seconds on the 2-core CI machine: scheduled first


def _count_launches(patch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts of ModelRunner.launch calls: 'ahead' (after a step in flight) and 'first'."""
    counts = collections.Counter()
    launch = ModelRunner.launch

    def counted(self, sched, previous=None):
        counts["ahead" if previous is not None else "first"] += 1
        return launch(self, sched, previous)
    patch.setattr(ModelRunner, "launch", counted)
    return counts


@pytest.fixture
def launches(monkeypatch):
    return _count_launches(monkeypatch)


def _workload(seed: int, vocab: int):
    """Prompts sharing prefixes (prefix caching), of mixed lengths (chunking), with stop tokens
    that end some requests early; seeded temperature samples (which go ahead too); mixed with
    rows that keep their steps synchronous: top-p, greedy n=2, min_tokens, logprobs."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(24)]
    prompts, params = [], []
    for i in range(28):
        prompts.append(shared[:rng.randrange(0, 24)] + [rng.randrange(100, vocab) for _ in range(rng.randrange(2, 50))])
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 56),
                                     stop_token_ids=[rng.randrange(100, 2000) for _ in range(40)]))
    params[3] = SamplingParams(temperature=0.8, seed=5, max_tokens=30)
    params[5] = SamplingParams(temperature=1.0, seed=11, min_p=0.05, max_tokens=40)
    params[9] = SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=25)
    params[7] = SamplingParams(temperature=0, n=2, max_tokens=30)
    params[11] = SamplingParams(temperature=0, min_tokens=12, max_tokens=20)
    params[13] = SamplingParams(temperature=0, logprobs=2, max_tokens=18)
    return prompts, params


def _run(bundled_path, async_scheduling: bool, **engine):
    llm = LLM(str(bundled_path), dtype="float32", async_scheduling=async_scheduling, **engine)
    prompts, params = _workload(0, llm.engine.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    return llm, [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


ENGINES = {
    "chunked": dict(max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=64),  # chunked prefills, prefix hits
    "preempting": dict(max_num_seqs=12, num_kv_blocks=14, max_num_batched_tokens=48),  # preemptions as well
}


@dataclass
class Run:
    outputs: list
    launches: collections.Counter  # ModelRunner.launch calls: "ahead" (after a step in flight), "first"
    carried: collections.Counter  # steps whose steady rows were carried from the step before (True) or not
    num_preemptions: int


def _observed_run(bundled_path, async_scheduling: bool, engine: dict) -> Run:
    """_run, counting launches, and checking every step's steady rows (ModelRunner._steady_rows
    reuses the previous step's where the steady decodes are the same requests) against rows
    read afresh from the requests."""
    from engine.step_rows import SteadyRows
    carried = collections.Counter()
    steady_rows = ModelRunner._steady_rows

    def checked(self, steady, requests):
        reused = self._last_steady is not None and self._last_steady[0] == requests
        rows = steady_rows(self, steady, requests)
        if rows is not None:
            fresh = SteadyRows.of(steady, requests)
            assert (rows.token_ids == fresh.token_ids).all() and (rows.positions == fresh.positions).all()
            assert rows.block_tables == fresh.block_tables
            carried[reused] += 1
        return rows

    with pytest.MonkeyPatch.context() as patch:
        launches = _count_launches(patch)
        patch.setattr(ModelRunner, "_steady_rows", checked)
        llm, outputs = _run(bundled_path, async_scheduling, **engine)
    return Run(outputs, launches, carried, llm.engine.scheduler.num_preemptions)


@pytest.fixture(scope="module")
def runs(bundled_path):
    """Run(engine name, async_scheduling): each run made once for the module (a minute of CPU
    each); the tests below check different things about the same runs."""
    done = {}

    def run(name: str, async_scheduling: bool) -> Run:
        if (name, async_scheduling) not in done:
            done[name, async_scheduling] = _observed_run(bundled_path, async_scheduling, ENGINES[name])
        return done[name, async_scheduling]
    return run


@pytest.mark.parametrize("name", ENGINES)
def test_outputs_equal_the_synchronous_engines(runs, name):
    expected, got = runs(name, False), runs(name, True)
    assert not expected.launches
    assert got.outputs == expected.outputs
    assert got.launches["ahead"] > 10  # steps did go ahead (fewer while preempted requests wait)
    if name == "preempting":
        assert got.num_preemptions > 0
    finish = collections.Counter(c[1] for r in got.outputs for c in r)
    assert finish["stop"] > 0 and finish["length"] > 0  # stops came one step late, unseen


def test_packed_plain_tokens_give_the_unpacked_outputs(bundled_path, monkeypatch):
    """EngineCore.step_packed (what the offline LLM and the engine process read) against step(),
    an EngineCoreOutput per token: the same outputs, a stop string's request (the output
    processor's general way) and n=2's second sample (not packed) among them."""
    def generate():
        llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
        prompts, params = _workload(1, llm.engine.vocab_size)
        params[2] = SamplingParams(temperature=0, max_tokens=30, stop=["12"])
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leak(llm)
        return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]

    packed = generate()
    monkeypatch.setattr(EngineCore, "step_packed", lambda self: (self.step(), None))
    assert generate() == packed
    assert packed[2][0][2] == "stop" and len(packed[7]) == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_rows_carried_from_the_step_before_equal_fresh_ones(runs, async_scheduling):
    """Through chunking, prefix hits, preemptions, stops and steps launched ahead, rows carried
    from the step before equal rows read afresh (checked on every step of every run)."""
    run = runs("preempting", async_scheduling)
    assert run.carried[True] > 10 and run.carried[False] > 0


def test_aborts_while_a_step_is_in_flight_lose_nothing(bundled_path, launches):
    config = EngineConfig(model=str(bundled_path), dtype="float32", num_kv_blocks=64, async_scheduling=True)
    core = EngineCore(config, (2,))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        core.add_request(f"r{i}", [100 + i, 200, 300 + i], params)
    tokens = collections.defaultdict(list)
    for step in range(60):
        if step == 5:
            assert core._inflight is not None  # the abort lands between a launch and its result
            core.abort_requests(["r1", "r4"])
        for out in core.step():
            assert not (step >= 5 and out.request_id in ("r1", "r4")), "an aborted request's token came out"
            tokens[out.request_id] += out.new_token_ids
        if not core.has_unfinished_requests():
            break
    assert not core.has_unfinished_requests()
    assert {len(tokens[f"r{i}"]) for i in (0, 2, 3, 5)} == {40}
    assert len(tokens["r1"]) < 40 and len(tokens["r4"]) < 40
    assert launches["ahead"] > 30


def test_seeded_temperature_samples_go_ahead_with_the_synchronous_engines_tokens(bundled_path, launches):
    """Plain random rows (a temperature, min_p) are sampled on the device in a step launched
    ahead, each seeded row keyed by the output position it samples: the same tokens as the
    synchronous engine's, whatever else runs."""
    prompts = ["Tell me a joke", "Once upon a time", "The capital of France is", "def f(x):"]
    params = [SamplingParams(temperature=t, seed=s, min_p=m, max_tokens=24, ignore_eos=True)
              for t, s, m in ((1.0, 1, 0.0), (0.6, 2, 0.1), (1.3, 3, 0.0), (0.9, 4, 0.02))]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    prompts.append("Hello")
    outs = {}
    for on in (False, True):
        llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=64, async_scheduling=on)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leak(llm)
    assert outs[True] == outs[False]
    assert launches["ahead"] > 15


def test_a_seeded_request_does_not_depend_on_its_batch(bundled_path):
    llm = LLM(str(bundled_path), dtype="float32", num_kv_blocks=128, async_scheduling=True)
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=20)
    alone = llm.generate(["Tell me a joke"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    greedy = SamplingParams(temperature=0, max_tokens=30)
    batch = llm.generate(["Hello", "Tell me a joke", "Once upon a time"], [greedy, seeded, greedy], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert_no_leak(llm)


def test_default_follows_cuda_graphs_and_off_with_a_speculator(bundled_path):
    # The default is on where decode runs in CUDA graphs (measured on an H100), off on a CPU.
    assert EngineConfig(model=str(bundled_path)).async_scheduling is False
    assert EngineConfig(model=str(bundled_path), async_scheduling=True).async_scheduling is True
    config = EngineConfig(model=str(bundled_path), dtype="float32", num_kv_blocks=32, async_scheduling=True,
                          speculative_method="ngram")
    assert EngineCore(config, (2,)).async_scheduling is False  # it proposes from each step's tokens
