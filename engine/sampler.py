"""Turn a batch of logits rows into next tokens, following vLLM's semantics.

Order of work per step (each stage runs only if some row needs it):

    raw logits [B, V] ──► structured output: the grammar's bitmask, -inf where it forbids
        │
        ├─► logprobs (log_softmax of the logits so far: they reflect the grammar)
        ├─► allowed_token_ids, bad_words, logit_bias (engine/logit_rules.py)
        ├─► min_tokens: mask eos + stop_token_ids to -inf (not on constrained rows)
        ├─► penalties: repetition (prompt ∪ output), frequency, presence (output)
        ├─► greedy rows: argmax
        └─► random rows: / temperature ─► top_k ─► top_p ─► min_p ─► exponential race

Speculative decoding adds verification groups: a request's k draft tokens give k + 1
consecutive rows, row j scoring the position after drafts[:j] (its penalties count those
drafts, its grammar mask has accepted them). Each row goes through every stage above and
samples as a normal row would; then the group keeps its drafts while they equal the sampled
tokens, and the first sampled token that differs (see `_verify`: for one-hot drafts this is
exactly rejection sampling). Rows past a group's emitted run get token -1.

Sampling uses the exponential race, argmax(p / q) with q ~ Exp(1), which draws
from p without a cumsum or a renormalisation. A seeded row's q is a pure function of its
key and the column (a counter-based hash, engine/keyed_random.py): one batched op for every
seeded row, no generator object per row, and its tokens do not depend on the rest of the
batch. Every stage touches only the rows that need it, so an unconstrained row samples the
same token whatever it is batched with. Columns past `num_tokens` (an LM head padded beyond
the tokenizer) are never sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import functools
import time

import numpy as np
import torch

import cpu_kernels
from cpu_kernels import ops

from common.structured_output.backend import GrammarBackend, GrammarMatcher
from engine.keyed_random import seeded_exponentials
from engine.logit_rules import apply_logit_rules
from engine.sampling_batch import (FREQUENCY, GREEDY, LOGIT_RULES, LOGPROBS, MIN_P, PENALTIES, PRESENCE, REPETITION,
                                   TEMPERATURE, TOP_K, TOP_P, UNSEEDED, SamplingBatch)
from engine.rejection_sampler import greedy_verify

NOT_EMITTED = -1  # a verification row past its group's emitted run


@dataclass(slots=True)
class SamplerOutput:
    """What one sampler step produced, one entry per row."""

    token_ids: list[int]  # NOT_EMITTED on verification rows past their group's run
    # None where params.logprobs is None (or not emitted); else the token plus the top-N.
    logprobs: list[dict[int, float] | None]
    grammar_s: float | None = None  # time spent on the grammar's bitmask; None: no constrained row


class Sampler:
    """Samples one token per row. Stateless apart from the eos ids and the vocabulary's size."""

    def __init__(self, eos_token_ids: Sequence[int], num_tokens: int | None = None):
        self.eos_token_ids = list(eos_token_ids)
        self.num_tokens = num_tokens  # the tokenizer's size, when the LM head has padding rows

    def argmax_tensor(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of plain rows (see SamplingParams.plain_greedy), as an int64 tensor on
        the logits' device (no wait for it)."""
        logits = self._tokens_only(logits)
        if logits.device.type != "cpu":  # the upcast would be exact, and a copy of all the logits
            return logits.argmax(dim=-1)  # (an H100 spent 0.13 ms a step on it at 256 x 151,936)
        # CPU argmax over bf16 is ~5x slower than the (exact) upcast + fp32 argmax.
        return _argmax(logits.float())

    def sample_tensor(self, logits: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
        """The tokens of rows that are each plain greedy or plain random (SamplingParams), as
        an int64 tensor on the logits' device, without waiting for the device: what `__call__`
        samples for them, for a step launched ahead (engine/async_step.py)."""
        return _sample_tensor(self._tokens_only(logits).to(torch.float32, copy=True), rows)

    def __call__(self, logits: torch.Tensor, rows: SamplingBatch) -> SamplerOutput:
        lm_head_rows = logits.shape[-1]  # what a grammar's bitmask covers
        logits = self._tokens_only(logits)
        if rows.plain_greedy():
            return _greedy(logits, rows, lm_head_rows)
        # A copy: the stages below write in place and the caller keeps its logits.
        logits = logits.to(torch.float32, copy=True)
        grammar_s = _apply_grammar(logits, rows, lm_head_rows)
        logprob_idx = np.flatnonzero(rows.columns[:, LOGPROBS] >= 0).tolist()
        raw_logprobs = (torch.log_softmax(logits[_index(logprob_idx, logits)], dim=-1)
                        if logprob_idx else None)
        if rows.flag(LOGIT_RULES).any():
            apply_logit_rules(logits, rows)
        self._mask_min_tokens(logits, rows)
        penalty_idx = np.flatnonzero(rows.flag(PENALTIES)).tolist()
        if penalty_idx:
            index = _index(penalty_idx, logits)
            logits[index] = _apply_penalties(logits[index], rows.take(penalty_idx))
        token_ids = _sample(logits, rows)
        logprobs = _collect_logprobs(raw_logprobs, logprob_idx, token_ids, rows)
        return SamplerOutput(token_ids, logprobs, grammar_s)

    def _tokens_only(self, logits: torch.Tensor) -> torch.Tensor:
        """The columns of the tokenizer's tokens: a view, so padding rows of the LM head never compete."""
        if self.num_tokens is not None and self.num_tokens < logits.shape[-1]:
            return logits[:, :self.num_tokens]
        return logits

    def _mask_min_tokens(self, logits: torch.Tensor, rows: SamplingBatch) -> None:
        """Forbid every way of stopping until a row has min_tokens outputs. A grammar decides
        where a constrained row may end instead (banning eos where the grammar allows nothing
        else would leave no token at all)."""
        vocab_size = logits.shape[-1]
        row_idx: list[int] = []
        token_idx: list[int] = []
        for i in np.flatnonzero(rows.min_tokens_pending()).tolist():
            # Ids past the vocab (a tokenizer larger than the lm head) cannot be sampled.
            banned = {t for t in (*self.eos_token_ids, *rows.params[i].stop_token_ids) if t < vocab_size}
            row_idx.extend([i] * len(banned))
            token_idx.extend(banned)
        if row_idx:
            logits[_index(row_idx, logits), _index(token_idx, logits)] = float("-inf")


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (fp32 logits). On CPU numpy's: it is vectorised and torch's is not
    (2.1 against 9.5 ms over 256 x 49,152 logits). Both take the first of equal maxima."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _greedy(logits: torch.Tensor, rows: SamplingBatch, lm_head_rows: int) -> SamplerOutput:
    """The hot path: argmax. The upcast is exact, and CPU argmax over bf16 is ~5x slower than
    upcast + argmax over fp32. Constrained rows are copied out and masked on their own, so the
    others cost what they cost alone."""
    logits = logits.float()
    token_ids = _argmax(logits)
    constrained = rows.constrained()
    grammar_s = None
    if constrained:
        index = _index(constrained, logits)
        masked = logits[index]  # a copy: the caller keeps its logits
        grammar_s = _apply_grammar(masked, rows.take(constrained), lm_head_rows)
        token_ids[index] = _argmax(masked)
    return SamplerOutput(_verify(token_ids.tolist(), rows), [None] * len(rows), grammar_s)


def _apply_grammar(logits: torch.Tensor, rows: SamplingBatch, lm_head_rows: int) -> float | None:
    """Set what each constrained row's grammar forbids to -inf: one bitmask for the batch,
    filled row by row, unpacked and applied to those rows only. Returns the time it took."""
    constrained = rows.constrained()
    if not constrained:
        return None
    start = time.perf_counter()
    bitmask = torch.zeros(len(constrained), GrammarBackend.bitmask_width(lm_head_rows), dtype=torch.int32)
    # One thread, row by row: llguidance's own thread pool measured slower inside the engine
    # (its threads fight torch's, which spin on for a while after the forward). A forking
    # prompt's n rows share one matcher: it is filled once and the row copied. A verification
    # group's rows share one too: it accepts each row's draft before the next row's fill, and
    # is rolled back after. Once it rejects a draft, later rows of the group are moot (that
    # draft's probability is 0, so verification stops there): they copy the last mask.
    filled: dict[tuple[int, int], int] = {}  # (matcher, drafts it has accepted) -> bitmask row
    advanced: dict[int, tuple[GrammarMatcher, int]] = {}  # matcher -> (it, drafts accepted)
    dead: set[int] = set()
    drafts = rows.draft_token_ids or [None] * len(rows)
    for row, i in enumerate(constrained):
        matcher, draft = rows.matchers[i], drafts[i]
        depth = advanced.get(id(matcher), (matcher, 0))[1]
        key = (id(matcher), depth)
        if key in filled or id(matcher) in dead:
            bitmask[row] = bitmask[filled.get(key, row - 1)]
        else:
            matcher.fill_bitmask(bitmask, row)
            filled[key] = row
        if draft is not None and id(matcher) not in dead:
            # Ask the mask first: a matcher that rejects a token is left in an error state.
            if _allows(bitmask[row], draft) and matcher.accept(draft):
                advanced[id(matcher)] = (matcher, depth + 1)
            else:
                dead.add(id(matcher))
    for matcher, depth in advanced.values():
        matcher.rollback(depth)
    if logits.device.type == "cpu" and _bitmask_kernel():
        ops.apply_token_bitmask(logits, bitmask, torch.tensor(constrained, dtype=torch.long))
    else:
        apply_token_bitmask(logits, bitmask.to(logits.device), _index(constrained, logits))
    return time.perf_counter() - start


def _allows(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: -inf where the bitmask forbids (bit t of a row's int32 words, little-endian).
    The reference for the CPU kernel; it unpacks the whole [R, V] mask, about 10x slower."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[-1]]
    logits[rows] = logits[rows].masked_fill_(allowed == 0, float("-inf"))


@functools.cache
def _bitmask_kernel() -> bool:
    return cpu_kernels.available("layer_ops")


def _index(ids: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=like.device)


def _per_row(values: np.ndarray | list[float], like: torch.Tensor) -> torch.Tensor:
    """A [B, 1] column of per-row parameters, to broadcast against [B, V]."""
    return torch.as_tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _padded(seqs: list[list[int]], pad: int, like: torch.Tensor) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return _index([s + [pad] * (width - len(s)) for s in seqs], like).view(len(seqs), width)


def _apply_penalties(logits: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    """vLLM penalties on [P, V] logits of the rows that use them."""
    num_rows, vocab_size = logits.shape
    # Pad with vocab_size: scatter into one spare column, then drop it.
    output_ids = _padded(rows.output_token_ids, vocab_size, logits)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    prompt_ids = _padded(rows.prompt_token_ids, vocab_size, logits)
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :vocab_size] | (counts > 0)

    repetition = _per_row(rows.columns[:, REPETITION], logits)
    # Dividing a positive logit and multiplying a negative one both push it down.
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    frequency = _per_row(rows.columns[:, FREQUENCY], logits)
    presence = _per_row(rows.columns[:, PRESENCE], logits)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _sample(logits: torch.Tensor, rows: SamplingBatch) -> list[int]:
    return _verify(_sample_tensor(logits, rows).tolist(), rows)


def _sample_tensor(logits: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    """Each row's token, on the device. Nothing here waits for the device unless a row filters
    by top-k or top-p (`_window` checks its exactness on the host)."""
    greedy = rows.flag(GREEDY)
    if not greedy.any():  # every row draws: no index to gather or scatter through
        return _race(_filtered_probs(logits, rows.columns), rows.rng_keys)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy_idx, random_idx = np.flatnonzero(greedy).tolist(), np.flatnonzero(~greedy).tolist()
    index = _index(greedy_idx, logits)
    token_ids[index] = _argmax(logits[index])
    if random_idx:
        index = _index(random_idx, logits)
        token_ids[index] = _race(_filtered_probs(logits[index], rows.columns[random_idx]), rows.rng_keys[random_idx])
    return token_ids


def _groups(rows: SamplingBatch) -> list[range]:
    """The verification groups (rows with drafts, then the row after): ranges of > 1 rows."""
    if rows.draft_token_ids is None:
        return []
    groups, start = [], None
    for i, draft in enumerate(rows.draft_token_ids):
        if draft is not None:
            start = i if start is None else start
        elif start is not None:
            groups.append(range(start, i + 1))
            start = None
    return groups


def _verify(tokens: list[int], rows: SamplingBatch) -> list[int]:
    """Each verification group: `tokens` holds the token every row sampled (argmax, or its own
    exponential race) as if its drafts were right; accept drafts while they equal those, then
    emit the first sampled token that differs, or the bonus after the last draft.

    Under random sampling this is the rejection sampler for drafts proposed deterministically
    (one-hot q, as n-gram lookup and a greedy draft model give): draft x is accepted with
    probability P(sample = x) = p(x) = min(1, p(x)/q(x)), and on rejection the emitted token
    is a sample of p given that it is not x, which is norm(max(p - q, 0)). The output is the
    target's distribution exactly (tests/unit/test_sampler.py; rejection_sampler
    is the general form, for drafts sampled from a full q). And since each row's randomness is
    its own (a seeded row's is keyed by its output position), a seeded request samples the
    very tokens it samples without speculation."""
    groups = _groups(rows)
    if not groups:
        return tokens
    width = max(len(g) for g in groups)
    target = torch.tensor([[tokens[i] for i in g] + [0] * (width - len(g)) for g in groups])
    drafts = torch.tensor([[rows.draft_token_ids[i] for i in g[:-1]] + [0] * (width - len(g))
                           for g in groups]).view(len(groups), width - 1)
    emitted, counts = greedy_verify(target, drafts, torch.tensor([len(g) - 1 for g in groups]))
    _scatter_runs(tokens, groups, emitted.tolist(), counts.tolist())
    return tokens


def _scatter_runs(tokens: list[int], groups: list[range], emitted: list[list[int]], counts: list[int]) -> None:
    for g, run, count in zip(groups, emitted, counts):
        for j, i in enumerate(g):
            tokens[i] = run[j] if j < count else NOT_EMITTED


def _filtered_probs(logits: torch.Tensor, columns: np.ndarray) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p (the rows' SamplingBatch columns); returns
    unnormalised probs."""
    vocab_size = logits.shape[-1]
    logits = logits / _per_row(columns[:, TEMPERATURE], logits)
    top_k_col, top_p_col = columns[:, TOP_K], columns[:, TOP_P]
    if ((top_k_col > 0) & (top_k_col < vocab_size)).any() or (top_p_col < 1.0).any():
        top_k = np.where((top_k_col > 0) & (top_k_col < vocab_size), top_k_col, vocab_size).astype(int).tolist()
        logits = _apply_top_k_top_p(logits, top_k, top_p_col.tolist())
    probs = logits.softmax(dim=-1)
    min_p = columns[:, MIN_P]
    if (min_p > 0.0).any():
        threshold = probs.amax(dim=-1, keepdim=True) * _per_row(min_p, probs)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # The race below needs no renormalisation: argmax(p / q) scales out.
    return probs


# Top-k/top-p look at each row's best PREFILTER logits (a partial sort) where that is exact:
# a full sort of Gemma 3's 262,144 logits took most of a sampled step.
PREFILTER = 1024


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k, then top-p, over each row's logits in descending order; k = V and p = 1 keep
    every token. Over the best `width` logits only where that gives the same tokens (see
    `_window`), else over a full sort."""
    window = _window(logits, top_k, top_p)
    if window is None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        return logits.scatter_(1, order, _filter_sorted(sorted_logits, top_k, top_p))
    values, order, full_lse = window
    whole = [i for i, k in enumerate(top_k) if k >= logits.shape[-1]]  # top-p only
    kept = _filter_sorted(values, [min(k, values.shape[-1]) for k in top_k], top_p, (whole, full_lse))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, kept)


def _window(logits: torch.Tensor, top_k: list[int], top_p: list[float]):
    """(best values, their ids, each row's logsumexp) when filtering those alone is exact:
    every row filters, no logit past the window ties a row's k-th, and the window holds more
    than p of each top-p-only row's mass (what lies past it is dropped either way). Else None."""
    vocab_size = logits.shape[-1]
    if any(k >= vocab_size and p >= 1.0 for k, p in zip(top_k, top_p)):
        return None
    width = max([PREFILTER, *(k for k in top_k if k < vocab_size)])
    if width * 4 > vocab_size:
        return None
    values, order = logits.topk(width, dim=-1)
    k_rows = [i for i, k in enumerate(top_k) if k < vocab_size]
    if k_rows:
        index = _index(k_rows, logits)
        kth = values[index].gather(1, _index([top_k[i] for i in k_rows], logits).unsqueeze(1) - 1)
        if ((logits[index] >= kth).sum(dim=-1) > width).any():
            return None
    full_lse = logits.logsumexp(dim=-1, keepdim=True)
    p_rows = [i for i, k in enumerate(top_k) if k >= vocab_size]
    if p_rows:
        index = _index(p_rows, logits)
        mass = (values[index] - full_lse[index]).exp().sum(dim=-1)
        if (mass < _per_row([top_p[i] for i in p_rows], mass) + 1e-3).any():  # margin: float error
            return None
    return values, order, full_lse


def _filter_sorted(sorted_logits: torch.Tensor, top_k: list[int], top_p: list[float],
                   whole_rows: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """`sorted_logits` (each row's logits, descending, or the best of them) filtered in
    place. `whole_rows`: (rows without top-k, every row's logsumexp over the vocabulary),
    which normalises those rows' probabilities when only their best logits are here."""
    kth = sorted_logits.gather(1, _index(top_k, sorted_logits).unsqueeze(1) - 1)
    # Ties with the k-th logit stay, as in vLLM.
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    if whole_rows is not None and whole_rows[0]:
        index = _index(whole_rows[0], probs)
        probs[index] = (sorted_logits[index] - whole_rows[1][index]).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    p = _per_row(top_p, sorted_logits)
    # Keep a token while the mass before it is short of p (the top token's is
    # exactly 0, and p > 0, so it always stays); p = 1 is exempt so that float
    # error in the cumsum cannot clip the tail of a disabled row.
    drop = (mass_before >= p) & (p < 1.0)
    return sorted_logits.masked_fill_(drop, float("-inf"))


def _race(probs: torch.Tensor, rng_keys: np.ndarray) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): a draw from p with one random vector per row; a seeded row's
    (rng_keys, int64, UNSEEDED for none) a function of its key alone."""
    seeded = rng_keys != UNSEEDED
    if not seeded.any():
        q = torch.empty_like(probs).exponential_()
    elif seeded.all():
        q = seeded_exponentials(torch.from_numpy(rng_keys).to(probs.device), probs.shape[-1]).to(probs.dtype)
    else:
        q = torch.empty_like(probs)
        seeded_idx, unseeded_idx = np.flatnonzero(seeded).tolist(), np.flatnonzero(~seeded).tolist()
        keys = torch.from_numpy(rng_keys[seeded_idx]).to(probs.device)
        q[_index(seeded_idx, q)] = seeded_exponentials(keys, probs.shape[-1]).to(q.dtype)
        q[_index(unseeded_idx, q)] = torch.empty(len(unseeded_idx), probs.shape[-1],
                                                 device=probs.device).exponential_()
    # q == 0 would give 0/0 = nan for a filtered token, and argmax would pick it.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _collect_logprobs(raw_logprobs: torch.Tensor | None, logprob_idx: list[int],
                      token_ids: list[int], rows: SamplingBatch) -> list[dict[int, float] | None]:
    """Per row: the sampled token's raw logprob plus the top-N, as plain floats."""
    out: list[dict[int, float] | None] = [None] * len(rows)
    if raw_logprobs is None:
        return out
    kept = [k for k, i in enumerate(logprob_idx) if token_ids[i] != NOT_EMITTED]
    if not kept:
        return out
    entries = _logprob_entries(raw_logprobs[_index(kept, raw_logprobs)],
                               [token_ids[logprob_idx[k]] for k in kept],
                               [int(rows.columns[logprob_idx[k], LOGPROBS]) for k in kept])
    for k, entry in zip(kept, entries):
        out[logprob_idx[k]] = entry
    return out


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], num_top: int) -> list[dict[int, float]]:
    """Row j of `logits` [R, V] scores `target_ids[j]`, the prompt token after it: its raw
    logprob plus the top-`num_top`, the same entries as the sampler's `logprobs`."""
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _logprob_entries(raw_logprobs, target_ids, [num_top] * len(target_ids))


def _logprob_entries(raw_logprobs: torch.Tensor, token_ids: list[int], top_n: list[int]
                     ) -> list[dict[int, float]]:
    """Row j: {token_ids[j]: its logprob, then the top_n[j] most likely}, as plain floats."""
    chosen = _index(token_ids, raw_logprobs).unsqueeze(1)
    chosen_lp = raw_logprobs.gather(1, chosen).squeeze(1).tolist()
    max_n = min(max(top_n), raw_logprobs.shape[-1])
    top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1)  # k = 0 gives empty rows
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    entries = []
    for j, n in enumerate(top_n):
        # The chosen token first, as vLLM orders them; a top-N copy has the same value.
        entry = {token_ids[j]: chosen_lp[j]}
        entry.update(zip(top_ids[j][:n], top_lp[j][:n]))
        entries.append(entry)
    return entries
