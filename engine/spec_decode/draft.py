"""Draft-model proposer: a small model with the target's tokenizer drafts k tokens greedily.

It runs in the engine process on the target's device, with its own paged KV cache of the
target's block count, indexed by the same block ids: a request's block table serves both
models, so no second allocator exists. The scheduler allocates k slots ahead of each step's
tokens (SchedulerConfig.num_lookahead_tokens) for the drafts the draft model writes.

Per request it remembers how far its KV is valid: the real tokens it has computed, plus the
drafts it wrote after them (valid as far as the target accepted them). Each call:

    catch up:  one forward over each request's tokens the draft has not computed yet
               (after a rejection: the target's token; a new request: its whole context)
               -> draft 1 = argmax of the last row
    draft:     k - 1 single-token forwards, batched over the requests that want more

Drafts are greedy (argmax), so verification treats them as one-hot: lossless at any
temperature. A request preempted since (its blocks freed) starts over from position 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.source import model_files
from engine.request import Request
from engine.step_rows import ForwardRow


@dataclass(slots=True)
class _DraftState:
    num_preemptions: int  # the request's count when this state began
    num_computed: int = 0  # real tokens whose draft KV is written
    written_drafts: list[int] = field(default_factory=list)  # drafts written after them, in order


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelRunner, max_model_len: int) -> None:
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, num_kv_blocks=target.num_kv_blocks,
            max_model_len=max_model_len, speculative_method=None, speculative_model=None,
            cuda_graphs=False)
        path = model_files(config, "speculative_model")
        self.runner = ModelRunner(draft_config, path, eos_token_ids=())
        if self.runner.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(f"speculative_model: its vocabulary has {self.runner.arch.vocab_size} "
                             f"tokens, the model's {target.arch.vocab_size}: a draft model must share "
                             "the model's tokenizer")
        self._states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_drafts: list[int], block_tables: list[list[int]],
                blocks_to_copy: Sequence[tuple[int, int]]) -> list[list[int]]:
        runner = self.runner
        runner.copy_blocks(list(blocks_to_copy))
        drafts: list[list[int]] = [[] for _ in requests]
        starts = [self._valid(r) for r in requests]
        rows = [ForwardRow(r.all_token_ids[start:], start, table, 1)
                for r, start, table in zip(requests, starts, block_tables)]
        active = list(range(len(requests)))
        while active:
            tokens = self._argmax([rows[i] for i in active])
            for i, token in zip(active, tokens):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < max_drafts[i]]
            for i in active:  # feed the draft back: its KV goes to the lookahead slots
                rows[i] = ForwardRow([drafts[i][-1]], rows[i].start + len(rows[i].token_ids),
                                     block_tables[i], 1)
        for r, d, k in zip(requests, drafts, max_drafts):
            state = self._states[r.request_id]
            state.num_computed = r.num_tokens
            state.written_drafts = d[:k - 1]  # the last draft was never fed back
        return drafts

    def release(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def _valid(self, r: Request) -> int:
        """Tokens of `r` whose draft KV is valid: real ones computed, then the written drafts
        that the target accepted (they equal its tokens at those positions)."""
        state = self._states.get(r.request_id)
        if state is None or state.num_preemptions != r.num_preemptions:
            state = self._states[r.request_id] = _DraftState(r.num_preemptions)
        valid = state.num_computed
        for draft in state.written_drafts:
            if valid >= r.num_tokens - 1 or r.all_token_ids[valid] != draft:
                break
            valid += 1
        # The last token always runs: its logits give the first draft.
        return min(valid, r.num_tokens - 1)

    def _argmax(self, rows: list[ForwardRow]) -> list[int]:
        """One forward of the draft model; the argmax after each row's last token."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids) != 1)
        hidden, last_rows = self.runner.forward([rows[i] for i in order])
        logits = self.runner.model.compute_logits(hidden[last_rows])[:len(rows)]
        tokens = logits.argmax(dim=-1).tolist()
        out = [0] * len(rows)
        for position, i in enumerate(order):
            out[i] = tokens[position]
        return out

