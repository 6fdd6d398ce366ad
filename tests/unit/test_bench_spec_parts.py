"""`bench spec`'s parts without a server: the edit dataset, requests, acceptance figures, flags."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.spec_metrics import SpecCounters, acceptance, parse_spec_counters, same_as, speedup
from bench.spec_workloads import (SpecRecord, edit_requests, load_edit_tasks, random_spec_requests,
                                  shuffled_tasks)


def test_edit_tasks_are_ours_and_well_formed():
    tasks = load_edit_tasks()
    assert len(tasks) == 32 and len({t.name for t in tasks}) == 32
    for t in tasks:
        assert 60 <= len(t.text.split()) <= 150, t.name
        assert t.prompt.startswith("Rewrite the text below, changing \"") and t.prompt.endswith(t.text), t.name
        assert "{" not in t.prompt, t.name  # every placeholder filled


def test_a_phrase_missing_from_its_text_is_refused(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text('{"instruction": "{from} {to} {text}", "tasks": [{"name": "x", "from": "cat", "to": "dog", '
                    '"text": "a bird sang"}]}')
    with pytest.raises(ValueError, match="'cat' is not in its text"):
        load_edit_tasks(path)


def test_edit_requests_take_disjoint_ranges_and_cycle():
    tasks = load_edit_tasks()[:5]
    words = lambda text: len(text.split())  # noqa: E731
    first = edit_requests(tasks, 3, 0, 1.3, lambda p: 7, words)
    second = edit_requests(tasks, 3, 3, 1.3, lambda p: 7, words)
    assert [r.task for r in first] == [t.name for t in tasks[:3]]
    assert [r.task for r in second] == [tasks[3].name, tasks[4].name, tasks[0].name]  # past the end: cycles
    for r, t in zip(first, tasks):
        assert r.prompt == t.prompt and r.prompt_len == 7 and not r.ignore_eos
        assert r.output_len == math.ceil(1.3 * words(t.text))
    capped = edit_requests(tasks, 2, 0, 1.3, lambda p: 7, words, max_output_len=10)
    assert [r.output_len for r in capped] == [10, 10]


def test_shuffle_and_random_requests_are_seeded():
    tasks = load_edit_tasks()
    assert [t.name for t in shuffled_tasks(tasks, 0)] == [t.name for t in shuffled_tasks(tasks, 0)]
    assert [t.name for t in shuffled_tasks(tasks, 0)] != [t.name for t in shuffled_tasks(tasks, 1)]
    a = random_spec_requests(3, 16, 8, 1000, "0:c1")
    assert [r.prompt for r in a] == [r.prompt for r in random_spec_requests(3, 16, 8, 1000, "0:c1")]
    assert all(r.ignore_eos and len(r.prompt) == r.prompt_len == 16 and r.output_len == 8 for r in a)


def _page(drafts: int, proposed: int, accepted: int, per_pos: list[int]) -> str:
    """A /metrics page as the engine's prometheus_client writes it."""
    registry = CollectorRegistry()

    def counter(name: str, value: int, labels: tuple[str, ...] = (), **label_values) -> None:
        c = Counter(f"pagedserve:spec_decode_{name}", name, ("model_name", *labels), registry=registry)
        c.labels(model_name="m", **label_values).inc(value)

    counter("num_drafts", drafts)
    counter("num_draft_tokens", proposed)
    counter("num_accepted_tokens", accepted)
    per = Counter("pagedserve:spec_decode_num_accepted_tokens_per_pos", "per pos", ("model_name", "position"),
                  registry=registry)
    for i, v in enumerate(per_pos):
        per.labels(model_name="m", position=str(i)).inc(v)
    Counter("pagedserve:num_preemptions", "other", registry=registry).inc(5)
    return generate_latest(registry).decode()


def test_counters_parse_and_give_acceptance_between_scrapes():
    before = parse_spec_counters(_page(10, 40, 20, [8, 6, 4, 2]))
    after = parse_spec_counters(_page(30, 120, 50, [20, 15, 10, 5]))
    assert before.found and before.totals == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20}
    assert before.per_pos == {0: 8, 1: 6, 2: 4, 3: 2}
    figures = acceptance(before, after)
    assert figures["num_drafts"] == 20 and figures["num_draft_tokens"] == 80 and figures["num_accepted_tokens"] == 30
    assert figures["acceptance_rate"] == pytest.approx(30 / 80)
    assert figures["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert figures["num_accepted_tokens_per_pos"] == [12, 9, 6, 3]
    assert figures["acceptance_rate_per_pos"] == pytest.approx([0.6, 0.45, 0.3, 0.15])


def test_no_counters_or_no_drafts():
    empty = parse_spec_counters("# nothing here\n")
    assert not empty.found and acceptance(SpecCounters(), empty) is None
    idle = parse_spec_counters(_page(0, 0, 0, []))
    figures = acceptance(SpecCounters(), idle)
    assert figures["num_drafts"] == 0
    assert figures["acceptance_rate"] is figures["mean_acceptance_length"] is figures["acceptance_rate_per_pos"] is None


def test_same_as_and_speedup():
    def rec(ids: list[int], ok: bool = True) -> SpecRecord:
        return SpecRecord(prompt_tokens=1, ok=ok, token_ids=ids)
    assert same_as([rec([1, 2]), rec([3]), rec([4], ok=False)], [rec([1, 2]), rec([3, 4]), rec([4])]) == 1
    assert speedup({"median_tpot_ms": 10.0, "output_tok_s": 200.0},
                   {"median_tpot_ms": 20.0, "output_tok_s": 100.0}) == {"tpot_speedup": 2.0,
                                                                        "output_tok_s_ratio": 2.0}
    assert speedup({"median_tpot_ms": 10.0, "output_tok_s": 1.0}, None)["tpot_speedup"] is None


@pytest.mark.parametrize("flags,message", [
    (["--configs", "off,eagle"], "--configs: a comma list"),
    (["--configs", "off,draft"], "needs --draft-model"),
    (["--draft-model", "x.gguf"], "needs --draft-model PATH, and --draft-model needs draft"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--workloads", "edit,edit"], "--workloads"),
    (["--speculative-method", "ngram"], "set per server by --configs"),
    (["--num-prompts", "0"], "--num-prompts"),
])
def test_bad_flags_are_refused(flags, message):
    from bench.spec_decode import check_args
    from pagedserve.cli import build_parser
    args = build_parser().parse_args(["bench", "spec", *flags])
    with pytest.raises(SystemExit, match=message):
        check_args(args)


def test_configs_map_to_engine_flags():
    from bench.servers import engine_flags
    from bench.spec_decode import config_for
    from engine.config import EngineConfig
    base = EngineConfig(num_speculative_tokens=3)
    assert "--speculative-method" not in engine_flags(config_for("off", base, None))
    flags = engine_flags(config_for("ngram", base, None))
    assert flags[flags.index("--speculative-method") + 1] == "ngram"
    assert flags[flags.index("--num-speculative-tokens") + 1] == "3"
    draft = config_for("draft", base, "small.gguf")
    assert (draft.speculative_method, draft.speculative_model) == ("draft", "small.gguf")


@pytest.mark.parametrize("lora_modules", [None, {"sql": "/adapters/sql", "chat": "/adapters/chat"}])
def test_engine_flags_rebuild_the_config(lora_modules):
    """What the benchmarks start engines with parses back to the same config (a dict of
    LoRA modules once went out as the string "{}")."""
    import argparse
    from bench.servers import engine_flags
    from engine.arg_utils import add_engine_args, engine_config_from_args
    from engine.config import EngineConfig
    config = EngineConfig(lora_modules=lora_modules, max_lora_rank=8)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(engine_flags(config))) == config
