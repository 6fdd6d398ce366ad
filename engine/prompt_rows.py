"""Which hidden rows of a step feed something other than sampling: the rows that score a
prompt's tokens (prompt_logprobs) and the rows a pooling request (task embed) pools.

Row offsets follow the runner's packing (`ModelRunner._prepare`, and the decode graph's: one
token each): `order`'s requests start at row `first_row`, after the steady decodes, each
taking its `num_new_tokens` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import ScheduledRequest
from engine.request import Request
from engine.sampler import prompt_logprobs

PROMPT_LOGPROBS_ROWS = 512  # prompt positions scored per LM-head call


@dataclass(slots=True)
class PromptJob:
    request: Request
    first_position: int  # the row at position p scores prompt token p + 1


def prompt_jobs(order: list[ScheduledRequest], first_row: int) -> tuple[list[PromptJob], list[tuple[int, int]]]:
    """The hidden rows to score for requests that asked for prompt_logprobs: their chunk's
    rows, not only the last one, in slices that bound the [rows, vocab] logits."""
    jobs, slices = [], []
    if all(s.request.sampling_params.prompt_logprobs is None for s in order):
        return jobs, slices
    row = first_row
    for s in order:
        r = s.request
        if r.needs_prompt_logprobs:
            # The row at position p scores prompt token p+1; the last prompt row samples.
            start = r.num_computed_tokens
            num_rows = min(start + s.num_new_tokens, r.num_prompt_tokens - 1) - start
            for first in range(0, max(num_rows, 0), PROMPT_LOGPROBS_ROWS):
                jobs.append(PromptJob(r, start + first))
                slices.append((row + first, row + min(num_rows, first + PROMPT_LOGPROBS_ROWS)))
        row += s.num_new_tokens
    return jobs, slices


def score_prompts(jobs: list[PromptJob], logits: list[torch.Tensor]) -> dict[str, list[dict[int, float]]]:
    """Each job's logits -> its prompt tokens' logprobs (and top ones), per request in order."""
    out: dict[str, list[dict[int, float]]] = {}
    for job, scores in zip(jobs, logits):
        r, first = job.request, job.first_position
        targets = r.prompt_token_ids[first + 1:first + 1 + scores.shape[0]]
        out.setdefault(r.request_id, []).extend(prompt_logprobs(scores, targets, r.sampling_params.prompt_logprobs))
    return out


def pool_jobs(order: list[ScheduledRequest], first_row: int) -> tuple[list[Request], list[tuple[int, int]]]:
    """Pooling requests (task embed) and the hidden rows each computes this step: its whole
    prompt (after any cached prefix), in one step."""
    requests, slices, row = [], [], first_row
    for s in order:
        if s.request.pooling is not None:
            requests.append(s.request)
            slices.append((row, row + s.num_new_tokens))
        row += s.num_new_tokens
    return requests, slices
