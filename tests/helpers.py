"""Shared test utilities: HF references, tiny random models, leak checks."""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

import torch

LONG = os.environ.get("PAGEDSERVE_LONG_TESTS") == "1"  # `pytest --long`: release-check sizes

# pytest-xdist runs the suite in several worker processes ("gw0", "gw1", ...; none without -n).
# Each draws its ports from its own block, below the kernel's ephemeral range (32768 up), where
# every `--grpc-port 0` bind lands: a port one worker hands to a server it is about to start can
# then be neither another worker's nor one the kernel gives out meanwhile. Test processes that
# share a block (runs without -n are all "gw0") keep apart by a lock on each port they hand out,
# held while they live: a free port is not yet bound, so it is not enough that it binds now.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_BLOCK = 1000  # ports per worker: 12 blocks from 20000 to 32000
_FIRST_PORT = 20000 + _WORKER % 12 * _BLOCK
_next_port = _FIRST_PORT
_LOCKS = Path(tempfile.gettempdir()) / "pagedserve-test-ports"
_held: dict[int, int] = {}  # port -> the descriptor whose lock reserves it for this process


def free_port(span: int = 1) -> int:
    """A loopback port that nothing listens on and no other test process has, from this test
    worker's own block; with `span`, the first of that many consecutive ones (a server that
    listens on p, p + 1, ...)."""
    global _next_port
    for _ in range(_BLOCK):
        if _next_port + span > _FIRST_PORT + _BLOCK:
            _next_port = _FIRST_PORT
        first, _next_port = _next_port, _next_port + span
        ports = range(first, first + span)
        if all(_reserve(port) and _bindable(port) for port in ports):
            return first
    raise RuntimeError(f"no {span} free ports in a row from {_FIRST_PORT} to {_FIRST_PORT + _BLOCK - 1}")


def _reserve(port: int) -> bool:
    """Whether this process holds the port's lock (taking it if no other process does)."""
    if port not in _held:
        _LOCKS.mkdir(exist_ok=True)
        fd = os.open(_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another test process handed it out
            os.close(fd)
            return False
        _held[port] = fd  # never closed: the lock goes when the process does
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:  # in use, or still in TIME_WAIT
            return False


TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, vocab_size=512,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_hf_config(model_type: str, **overrides):
    """Small random-weight configs for every architecture we implement, with each one's quirk."""
    from transformers import AutoConfig
    extra = {
        "llama": dict(tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2": dict(tie_word_embeddings=True),
        "qwen3": dict(tie_word_embeddings=False, head_dim=32),
        "mistral": dict(tie_word_embeddings=False, sliding_window=512),
        # LongRoPE: short and long factors (head_dim 16 -> 8 each) around a 64-token original length
        "phi3": dict(tie_word_embeddings=False, original_max_position_embeddings=64, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)]}),
        "mixtral": dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
        # one dense layer (mlp_only_layers), 8 experts of width 32, top-2 not renormalised
        "qwen3_moe": dict(tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=False),
        # 4 layers alternating an 8-token window and full attention, 4 experts of width 32
        # (top 2), YaRN around a 64-token original length; sinks and biases set by the caller
        "gpt_oss": dict(tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_parameters={
                            "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
    }[model_type]
    return AutoConfig.for_model(model_type, **{**TINY_COMMON, **extra, **overrides})


def split_gguf(source: Path, target: Path, num_parts: int) -> list[Path]:
    """`source` rewritten by gguf-py's own tools as a split GGUF of `num_parts` parts next to
    `target` (TARGET_STEM-0000k-of-0000N.gguf, as convert_hf_to_gguf.py --split-max-tensors
    names them), every key-value and tensor as stored; the parts, first first."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents(),
                             split_max_tensors=-(-len(reader.tensors) // num_parts))
    copy_with_new_metadata(reader, writer, {}, [])  # gguf_new_metadata.py's copy: keys and tensors as stored
    return sorted(target.parent.glob(f"{target.stem}-*-of-*.gguf"))


def build_tiny_model(model_type: str, folder: Path, tokenizer, **overrides) -> Path:
    """Save a random-weight HF model (safetensors) plus a tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, **overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)  # its own: the weights' draws stay as they were
    with torch.no_grad():  # HF starts biases at zero (Qwen2's qkv), which would hide a dropped bias
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, top_logprobs: int = 5):
    """HF greedy generation, one prompt at a time (no padding), with top-N logprobs per step."""
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [dict(zip(*[t.tolist() for t in reversed(torch.log_softmax(step[0].float(), -1)
                                                          .topk(top_logprobs))]))
                    for step in out.logits]
        results.append((tokens, logprobs))
    return results


def greedy_with_logprobs(llm, prompts: list, max_new: int, chat: bool = False) -> list[tuple[list[int], list[dict]]]:
    """Our greedy tokens and top-5 logprobs per prompt, in check_outputs_match's form.
    `chat`: the prompts are conversations (LLM.chat's; images in them, say)."""
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new, logprobs=5)
    outputs = llm.chat(prompts, params) if chat else llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_matches_hf(llm, prompts: list, reference, max_new: int, preempted: bool, chat: bool = False) -> None:
    """The HF-equality check every family runs under batching, chunking, caching and
    preemption: greedy output equals HF's (check_outputs_match); with prefix caching a second
    run is served from the cache (hits > 0); a pool sized to preempt did (`preempted`); no
    block leaked. `chat`: as greedy_with_logprobs'."""
    for _ in range(2 if llm.config.enable_prefix_caching else 1):
        assert check_outputs_match(greedy_with_logprobs(llm, prompts, max_new, chat), reference) <= 1
    stats = llm.engine.stats()
    if preempted:
        assert stats.num_preemptions > 0
    if llm.config.enable_prefix_caching:
        assert stats.num_prefix_cache_hits > 0
    assert_no_leak(llm)


def check_outputs_match(ours: list[tuple[list[int], list[dict]]], ref: list[tuple[list[int], list[dict]]]
                        ) -> int:
    """Token-for-token equality; where fp32 near-ties make that impossible, accept the first
    divergence only if each side's token is in the other's top logprobs there (vLLM's
    check_logprobs_close), and stop comparing that prompt. Returns how many prompts diverged."""
    diverged = 0
    for i, ((a_tok, a_lp), (b_tok, b_lp)) in enumerate(zip(ours, ref)):
        assert len(a_tok) == len(b_tok), f"prompt {i}: {len(a_tok)} tokens vs {len(b_tok)}"
        for pos, (a, b) in enumerate(zip(a_tok, b_tok)):
            if a == b:
                continue
            assert a in b_lp[pos] and b in a_lp[pos], (
                f"prompt {i} diverges at token {pos}: ours {a} (top {a_lp[pos]}) vs HF {b} (top {b_lp[pos]})")
            diverged += 1
            break
    return diverged


def logprob_gaps(ours, ref) -> list[float]:
    """|logprob ours - ref| of each chosen token, per prompt up to its first divergence
    (greedy_with_logprobs' results)."""
    gaps = []
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref):
        for token, lp, ref_token, ref_lp in zip(tokens, lps, ref_tokens, ref_lps):
            if token != ref_token:
                break
            gaps.append(abs(lp[token] - ref_lp[token]))
    return gaps


def assert_logprobs_close(ours, ref, tol: float) -> None:
    """The chosen tokens' logprobs within `tol` of ref's, per prompt up to its first
    divergence (which check_outputs_match judges)."""
    gaps = logprob_gaps(ours, ref)
    assert max(gaps, default=0.0) < tol, gaps


def assert_no_leak(llm) -> None:
    """After all requests end: every KV block free, nothing running or waiting."""
    assert_engine_idle(llm.engine)


def assert_engine_idle(core) -> None:
    stats = core.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, f"leaked KV blocks: {stats}"
    assert not core.has_unfinished_requests(), "a step still in flight (async scheduling)"
    core.block_manager.check_invariants()


class Oracle:
    """A speculative proposer that knows the answer: each prompt's reference continuation (or,
    `wrong`, each token one off), so verification steps take many tokens. `calls` counts them."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
        self.answers, self.wrong, self.calls = answers, wrong, 0

    def propose(self, requests, max_drafts, block_tables, blocks_to_copy):
        self.calls += 1
        drafts = []
        for r, k in zip(requests, max_drafts):
            known = self.answers[tuple(r.prompt_token_ids)][r.num_output_tokens:r.num_output_tokens + k]
            drafts.append([(t + 1) % 49152 for t in known] if self.wrong else known)
        return drafts

    def release(self, request_ids):
        pass


def frontend_metrics():
    """The process's one FrontendMetrics, for tests that build apps in-process: its series
    register in prometheus' global registry, so a second instance fails. Kept on the
    frontend.metrics module, which is imported once however test modules are named."""
    import frontend.metrics as metrics
    if not hasattr(metrics, "_tests_instance"):
        metrics._tests_instance = metrics.FrontendMetrics()
    return metrics._tests_instance
