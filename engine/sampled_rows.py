"""A step's rows to sample, and their tokens back by request: what ModelRunner.execute does
around the sampler.

Most requests sample one row. A forking prompt (n > 1) samples n rows from one logits row; a
request verifying k speculative drafts samples k + 1 rows, row j scoring the position after
drafts[:j]. `sampling_rows` lays them out with the request and the logits row of each;
`group_by_request` gives each request its sampled tokens, dropping verification rows past the
accepted run.
"""

from __future__ import annotations

import numpy as np

from engine.outputs import ModelRunnerOutput, ScheduledRequest
from engine.sampler import NOT_EMITTED
from engine.sampling_batch import SamplingBatch, rng_keys
from engine.step_rows import request_of


def sampling_rows(sampling: list[ScheduledRequest]) -> tuple[SamplingBatch, list[int], list[int]]:
    """Rows to sample (one per request, unless it forks or verifies drafts), the request
    each belongs to, and the logits row each reads."""
    if all(s.num_samples == 1 and not s.spec_token_ids for s in sampling):
        rows = list(range(len(sampling)))
        return SamplingBatch.of_requests(list(map(request_of, sampling))), rows, rows
    params, prompts, outputs, seeds, positions, matchers, drafts = [], [], [], [], [], [], []
    owner, logits_index = [], []
    next_logits = 0
    for i, s in enumerate(sampling):
        r = s.request
        matcher = None if r.structured is None else r.structured.matcher
        spec = s.spec_token_ids
        # Row j verifies spec[j] after spec[:j]; the last row follows them all. A forking
        # prompt's n rows read one logits row and share sample 0's matcher (none has a
        # token yet); sample k's seed is seed + k.
        for j in range(len(spec) + 1 if spec else s.num_samples):
            params.append(r.sampling_params)
            prompts.append(r.prompt_token_ids)
            outputs.append(r.output_token_ids + spec[:j] if spec else r.output_token_ids)
            seeds.append(None if r.seed is None else r.seed + (0 if spec else j))
            positions.append(r.num_output_tokens + (j if spec else 0))
            matchers.append(matcher)
            drafts.append(spec[j] if j < len(spec) else None)
            owner.append(i)
            logits_index.append(next_logits)
            next_logits += 1 if spec else 0
        next_logits += 0 if spec else 1
    batch = SamplingBatch(params, prompts, outputs, rng_keys(seeds, np.array(positions, np.int64)),
                          matchers if any(m is not None for m in matchers) else None,
                          drafts if any(d is not None for d in drafts) else None)
    return batch, owner, logits_index

def group_by_request(sampling: list[ScheduledRequest], row_owner: list[int], sampled, num_steady: int
           ) -> ModelRunnerOutput:
    """The sampled rows by request. The first `num_steady` requests are steady decodes,
    which own the first `num_steady` rows, one each."""
    rest = sampling[num_steady:]
    out = ModelRunnerOutput(request_ids=[s.request.request_id for s in rest],
                            token_ids=[[] for _ in rest], logprobs=[[] for _ in rest],
                            steady_token_ids=sampled.token_ids[:num_steady],
                            steady_logprobs=sampled.logprobs[:num_steady])
    for owner, token, logprobs in zip(row_owner[num_steady:], sampled.token_ids[num_steady:],
                                      sampled.logprobs[num_steady:]):
        if token == NOT_EMITTED:  # a verification row past the accepted run
            continue
        out.token_ids[owner - num_steady].append(token)
        out.logprobs[owner - num_steady].append(logprobs)
    return out
