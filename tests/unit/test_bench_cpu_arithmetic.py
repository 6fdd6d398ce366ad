"""bench/cpu_arithmetic.py's parts without a model: perplexity from logprobs, the KL divergence,
greedy agreement, issue 49's rule, the prompt set and the chart (the benchmark takes minutes)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import cpu_arithmetic, cpu_arithmetic_report as report


def test_perplexity_is_exp_of_the_mean_negative_logprob():
    assert report.perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert report.perplexity([math.log(0.5), math.log(0.125)]) == pytest.approx(4.0)  # exp((ln 2 + ln 8) / 2)


def test_kl_matches_the_formula_and_is_zero_against_itself():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    q = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]])
    kl = report.kl_divergence(p.log(), q.log(), chunk_rows=1)  # chunks of one row: the same numbers
    expected = 0.5 * math.log(0.5 / 0.6) + 0.25 * math.log(0.25 / 0.3) + 0.25 * math.log(0.25 / 0.1)
    assert kl.tolist() == pytest.approx([expected, 0.0], abs=1e-7)
    assert report.kl_divergence(q.log(), p.log())[0].item() != pytest.approx(expected)  # KL is not symmetric


def test_kl_is_taken_from_logits_or_rounded_logprobs_alike_and_never_negative():
    logits = torch.randn(50, 1000, generator=torch.Generator().manual_seed(0)) * 4
    rounded = torch.log_softmax(logits, -1).bfloat16().float()  # sums to 1 only roughly
    kl = report.kl_divergence(rounded, rounded + 3.0)  # a shift is the same distribution
    assert kl.abs().max().item() < 1e-12
    assert report.kl_divergence(logits, logits * 1.1).min().item() > 0


def test_kl_refuses_different_shapes():
    with pytest.raises(ValueError, match="shape"):
        report.kl_divergence(torch.zeros(3, 5), torch.zeros(3, 4))


def test_kl_summary_mean_p99_max():
    summary = report.kl_summary(torch.arange(101, dtype=torch.float64))
    assert summary == {"mean": pytest.approx(50.0), "p99": pytest.approx(99.0), "max": 100.0}


def test_leading_agreement_counts_up_to_the_first_difference():
    assert report.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert report.leading_agreement([7, 2], [1, 2]) == 0
    assert report.leading_agreement([1, 2, 3], [1, 2, 3]) == 3


def test_greedy_agreement_exact_share_and_mean_leading_share():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], [2, 2, 2, 2]]
    ours = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 1, 1, 1], [2, 2, 2, 2]]
    assert report.greedy_agreement(ours, reference) == {"exact": 0.5, "leading": pytest.approx((1 + 0.5 + 0 + 1) / 4)}
    with pytest.raises(ValueError):
        report.greedy_agreement(ours[:3], reference)


def _result(ppl: float, exact: float, leading: float) -> dict:
    return {"perplexity": ppl, "greedy": {"exact": exact, "leading": leading}, "plan": "x",
            "kl": {"mean": 1e-3, "p99": 1e-2, "max": 0.1}}


def test_rule_needs_perplexity_within_half_a_percent_of_float32():
    base = {"float32": _result(20.0, 1.0, 1.0), "avx512_bf16": _result(20.01, 0.8, 0.9)}
    assert report.verdicts({**base, "int8": _result(20.09, 0.8, 0.9)})["int8"]["may_be_default"]  # +0.45%
    worse = report.verdicts({**base, "int8": _result(20.11, 0.9, 0.95)})["int8"]
    assert worse["ppl_vs_float32_pct"] == pytest.approx(0.55)
    assert not worse["ppl_within"] and worse["greedy_at_least_bf16"] and not worse["may_be_default"]
    assert report.verdicts({**base, "int8": _result(19.89, 0.8, 0.9)})["int8"]["ppl_within"] is False  # -0.55%


def test_rule_needs_greedy_agreement_of_the_best_bf16_on_both_measures():
    base = {"float32": _result(20.0, 1.0, 1.0), "avx512_bf16": _result(20.0, 0.8, 0.90),
            "amx": _result(20.0, 0.7, 0.95)}
    judged = report.verdicts({**base, "int8": _result(20.0, 0.8, 0.94)})["int8"]
    assert judged["bf16_best_greedy"] == {"exact": 0.8, "leading": 0.95}
    assert not judged["greedy_at_least_bf16"] and not judged["may_be_default"]
    assert report.verdicts({**base, "int8": _result(20.0, 0.8, 0.95)})["int8"]["may_be_default"]


def test_rule_judges_only_int8_and_not_without_its_baselines():
    assert report.verdicts({"float32": _result(20.0, 1, 1), "avx512_bf16": _result(20.0, 1, 1)}) == {}
    judged = report.verdicts({"float32": _result(20.0, 1, 1), "int8": _result(20.0, 1, 1)})["int8"]
    assert not judged["may_be_default"] and "did not run" in judged["reason"]


def test_table_rows_start_with_hf_and_give_ratios():
    rows = report.table_rows({"int8": _result(20.2, 0.5, 0.75)}, hf_perplexity=20.0)
    assert rows[0][0] == "HF float32"
    assert rows[1][:5] == ["int8", "x", "20.2000", "1.0100", "+1.000%"]
    assert rows[1][7:] == ["50%", "75.0%"]


def test_prompt_set_is_the_qa_questions_in_the_gen_tasks_prompt():
    prompts = cpu_arithmetic.qa_prompts()
    assert len(prompts) == 30
    assert prompts[0].startswith("Answer each question with a single word or number.")
    assert prompts[0].endswith("Question: What is 2 + 3?\nAnswer:") and "{{" not in prompts[0]


def test_plot_writes_a_png_named_in_the_result(tmp_path):
    path = tmp_path / "cpu-arithmetic-x.json"
    path.write_text(json.dumps({
        "machine": {"cpu": "test CPU"}, "model": "/m/SmolLM2.gguf", "hf_float32": {"perplexity": 20.0},
        "workload": {"num_prompts": 4, "output_len": 32, "num_threads": 2},
        "results": {"float32": _result(20.0, 1.0, 1.0), "int8": _result(20.2, 0.5, 0.75)}}))
    chart = report.plot(path)
    assert chart.is_file() and chart.suffix == ".png"
    assert json.loads(path.read_text())["plot"] == chart.name
