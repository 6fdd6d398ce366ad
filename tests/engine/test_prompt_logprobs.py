"""SamplingParams.prompt_logprobs on the bundled SmolLM2 (fp32): every prompt position's logprob
and top-N equal HF transformers' log_softmax, under batching, chunked prefill, a warm prefix
cache, n>1 and preemption; emitted once, on the first output, with position 0 None."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidRequest
from common.ipc import output_from_proto, output_to_proto, sampling_params_from_proto, sampling_params_to_proto
from common.outputs import EngineCoreOutput
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.loader import eos_token_ids, load_tokenizer
from helpers import assert_engine_idle

TOL = 1e-3
TOP_N = 5
TEXTS = [
    "You are a meticulous assistant who answers questions about geography, history and science. "
    "Always give a short, direct answer first, then one sentence of explanation. What is the capital "
    "of France?",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker",
]


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer) -> list[list[int]]:
    return [bundled_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(bundled_hf_model, prompts) -> list[torch.Tensor]:
    """HF's raw log_softmax per prompt: row i-1 scores prompt token i."""
    with torch.inference_mode():
        return [torch.log_softmax(bundled_hf_model(torch.tensor([p])).logits[0].float(), dim=-1)
                for p in prompts]


def make_core(bundled_path, **overrides) -> EngineCore:
    # quantization "none": HF reads the GGUF dequantized to float32, so must we.
    config = EngineConfig(**{"dtype": "float32", "quantization": "none", "num_kv_blocks": 64,
                             "num_threads": 1, **overrides})
    return EngineCore(config, eos_token_ids(load_tokenizer(bundled_path)))


def run_to_end(core: EngineCore) -> list[EngineCoreOutput]:
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert_engine_idle(core)
    return outputs


def params(prompt_logprobs: int | None = TOP_N, **kwargs) -> SamplingParams:
    kwargs = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, **kwargs}
    return SamplingParams(prompt_logprobs=prompt_logprobs, **kwargs)


def prompt_logprobs_of(outputs: list[EngineCoreOutput], request_id: str) -> list:
    """The request's prompt logprobs, checking they came exactly once, on its first output."""
    mine = [o for o in outputs if o.request_id == request_id]
    carrying = [o for o in mine if o.prompt_logprobs is not None]
    assert len(carrying) == 1, f"{request_id}: prompt logprobs on {len(carrying)} outputs"
    assert carrying[0] is mine[0] and carrying[0].sample_index == 0
    return carrying[0].prompt_logprobs


def check_against_hf(entries: list, prompt: list[int], ref: torch.Tensor, top_n: int = TOP_N) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        assert prompt[i] in entry and len(entry) in (top_n, top_n + 1), (i, entry)
        for token_id, logprob in entry.items():
            assert abs(logprob - row[token_id].item()) < TOL, (i, token_id, logprob, row[token_id].item())
        # The top-N are the N largest (the prompt token, when extra, is below them all).
        ours = sorted(entry.values(), reverse=True)[:top_n]
        assert ours == pytest.approx(row.topk(top_n).values.tolist(), abs=TOL), i


def test_rejects_out_of_range():
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


def test_proto_round_trip():
    msg = sampling_params_to_proto(SamplingParams(prompt_logprobs=0))
    assert msg.HasField("prompt_logprobs") and sampling_params_from_proto(msg).prompt_logprobs == 0
    assert not sampling_params_to_proto(SamplingParams()).HasField("prompt_logprobs")
    entries = [None, {7: -0.5, 3: -1.25}, {9: -4.0, 3: -0.75}]
    out = EngineCoreOutput("r", 0, [5], None, prompt_logprobs=entries, prompt_token_ids=[1, 7, 9])
    msg = output_to_proto(out, "r")
    assert [p.sampled.token_id for p in msg.prompt_logprobs] == [7, 9]
    assert output_from_proto(msg).prompt_logprobs == entries
    assert not output_to_proto(EngineCoreOutput("r", 0, [5], None), "r").prompt_logprobs


def test_batched_with_other_requests(bundled_path, prompts, reference):
    core = make_core(bundled_path)
    core.add_request("plain", prompts[1], params(None))
    core.step()  # "plain" decodes next to the scored prefill: its row comes first
    core.add_request("a", prompts[0], params())
    core.add_request("b", prompts[1], params(0))
    outputs = run_to_end(core)
    check_against_hf(prompt_logprobs_of(outputs, "a"), prompts[0], reference[0])
    entries_b = prompt_logprobs_of(outputs, "b")
    assert all(list(e) == [t] for e, t in zip(entries_b[1:], prompts[1][1:]))  # 0: own token only
    check_against_hf(entries_b, prompts[1], reference[1], top_n=0)
    assert all(o.prompt_logprobs is None for o in outputs if o.request_id == "plain")


def test_chunked_prefill(bundled_path, prompts, reference):
    core = make_core(bundled_path, max_num_batched_tokens=10)
    assert len(prompts[0]) > 3 * 10  # several chunks, each scoring its own positions
    core.add_request("a", prompts[0], params())
    core.add_request("b", prompts[1], params())
    outputs = run_to_end(core)
    check_against_hf(prompt_logprobs_of(outputs, "a"), prompts[0], reference[0])
    check_against_hf(prompt_logprobs_of(outputs, "b"), prompts[1], reference[1])


def test_prefix_cache_hit_is_not_used(bundled_path, prompts, reference):
    core = make_core(bundled_path, enable_prefix_caching=True)
    for request_id in ("warm", "warm-again"):
        core.add_request(request_id, prompts[0], params(None))
        run_to_end(core)
    hits = core.stats().num_prefix_cache_hits
    assert hits > 0  # the prompt's full blocks are cached
    core.add_request("a", prompts[0], params())
    outputs = run_to_end(core)
    assert core.stats().num_prefix_cache_hits == hits and outputs[0].num_cached_tokens == 0
    check_against_hf(prompt_logprobs_of(outputs, "a"), prompts[0], reference[0])


def test_n_samples_score_the_prompt_once(bundled_path, prompts, reference):
    core = make_core(bundled_path)
    core.add_request("a", prompts[0], params(temperature=1.0, seed=0, n=2))
    outputs = run_to_end(core)
    assert {o.sample_index for o in outputs} == {0, 1}
    check_against_hf(prompt_logprobs_of(outputs, "a"), prompts[0], reference[0])


def test_preempted_mid_prefill_scores_once(bundled_path, prompts, reference, monkeypatch):
    core = make_core(bundled_path, num_kv_blocks=8, max_num_batched_tokens=16)
    preempted = []
    original = core.scheduler._preempt

    def recording_preempt(victim, *args):
        preempted.append((victim.request_id, victim.num_computed_tokens, victim.num_output_tokens))
        return original(victim, *args)

    monkeypatch.setattr(core.scheduler, "_preempt", recording_preempt)
    # "long" holds 6 of the 8 blocks and decodes; "a" prefills 15 tokens a step next to it, and
    # loses its 2 blocks when "long" crosses into its 7th block.
    core.add_request("long", (prompts[1] * 10)[:94], params(None, max_tokens=34))
    while not core.step():
        pass
    core.add_request("a", prompts[0], params())
    outputs = run_to_end(core)
    assert any(r == "a" and 0 < computed and not num_out for r, computed, num_out in preempted), preempted
    check_against_hf(prompt_logprobs_of(outputs, "a"), prompts[0], reference[0])
