"""A step's rows as the model runner builds its inputs from them: `ForwardRow`s (a sequence's
tokens this step), the steady decodes as columns (`SteadyRows`), single-token rows as arrays
(`DecodeInputs`), and the tests that pick a step's path (which rows run as decodes, whether
every row samples plain greedy, whether a step may be launched ahead)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from engine.outputs import ScheduledRequest
from engine.request import Request


@dataclass(slots=True)
class ForwardRow:
    """One sequence's share of a forward: what to compute and which rows need logits."""

    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of the first
    block_ids: list[int]  # its block table
    num_logits: int  # trailing rows whose logits are needed: 0, 1, or 1 + drafts
    lora_slot: int = -1  # the LoRA adapter slot its tokens use; -1: the base model


@dataclass(slots=True)
class SteadyRows:
    """A step's steady decodes (SchedulerOutput.num_steady) as columns, built without a
    ForwardRow each: every one computes its last token and needs its logits."""

    token_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    block_tables: list[list[int]]  # the block manager's live tables

    @classmethod
    def of(cls, entries: list[ScheduledRequest], requests: list[Request]) -> SteadyRows:
        """`requests`: the entries' (SchedulerOutput.steady_requests)."""
        # map() over attrgetters runs its loop in C: a list comprehension costs 2-3x as much.
        n = len(requests)
        return cls(_last_tokens(requests), np.fromiter(map(_num_computed_tokens, requests), np.int64, n),
                   list(map(_block_ids, entries)))

    def following(self, requests: list[Request]) -> SteadyRows:
        """The rows of the same `requests` one step later, each having computed one more token."""
        return SteadyRows(_last_tokens(requests), self.positions + 1, self.block_tables)


def _last_tokens(requests: list[Request]) -> np.ndarray:
    return np.fromiter(map(_last, map(_all_token_ids, requests)), np.int64, len(requests))


request_of = operator.attrgetter("request")
_all_token_ids = operator.attrgetter("all_token_ids")
_last = operator.itemgetter(-1)
_num_computed_tokens = operator.attrgetter("num_computed_tokens")
_block_ids = operator.attrgetter("block_ids")
_output_token_ids = operator.attrgetter("output_token_ids")
_greedy_from = operator.attrgetter("greedy_from")
_ahead_from = operator.attrgetter("ahead_from")


def forward_row(s: ScheduledRequest) -> ForwardRow:
    """A scheduled request's row: its uncomputed tokens, then the drafts it verifies."""
    r, drafts = s.request, s.spec_token_ids
    start = r.num_computed_tokens
    tokens = r.all_token_ids[start:start + s.num_new_tokens - len(drafts)]
    if drafts:
        tokens += drafts
    return ForwardRow(tokens, start, s.block_ids, (1 + len(drafts)) if s.num_samples else 0)


@dataclass(slots=True)
class DecodeInputs:
    """A step's single-token rows as arrays (int64)."""

    token_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]; the context length is position + 1
    slots: np.ndarray  # [n] where each row's K/V goes
    block_tables: np.ndarray  # [n, width], width = blocks up to the furthest position
    logits_rows: np.ndarray  # rows that need logits (a 1-token prefill chunk short of the end has none)


def num_leading_decodes(rows: list[ForwardRow]) -> int:
    return next((i for i, f in enumerate(rows) if len(f.token_ids) != 1), len(rows))


def forward_order(scheduled: list[ScheduledRequest], lora: bool) -> list[ScheduledRequest]:
    """Single-token rows and draft verifications run the batched decode path: they go first.
    With LoRA, then by adapter, so that each adapter's tokens are contiguous (engine/lora/ops.py)."""
    if lora:
        return sorted(scheduled, key=lambda s: (not _runs_as_decodes(s), s.request.lora_name or ""))
    decodes = [s for s in scheduled if _runs_as_decodes(s)]
    if len(decodes) == len(scheduled):
        return decodes
    return decodes + [s for s in scheduled if not _runs_as_decodes(s)]


def _runs_as_decodes(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 or bool(s.spec_token_ids)


def padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`values` then `fill` up to `size` (np.pad costs 10 µs a call)."""
    if len(values) == size:
        return values
    out = np.full(size, fill, dtype=values.dtype)
    out[:len(values)] = values
    return out


def all_plain_greedy(requests: list[Request], others: list[ScheduledRequest]) -> bool:
    """Whether every sampling row is plain greedy: the steady decodes' `requests` (one row
    each, no drafts, so only the request decides: Request.greedy_from), and `others`."""
    # One max() decides in the common case, where no request waits on min_tokens or samples.
    steady_greedy = (not requests or max(map(_greedy_from, requests)) == 0
                     or all(map(operator.ge, map(len, map(_output_token_ids, requests)), map(_greedy_from, requests))))
    return steady_greedy and all(_plain_greedy(s) for s in others)


def all_ahead(requests: list[Request]) -> bool:
    """Whether every steady decode's token (of `requests`) can be sampled on the device alone
    (Request.ahead_from)."""
    return all(map(operator.ge, map(len, map(_output_token_ids, requests)), map(_ahead_from, requests)))


def _plain_greedy(s: ScheduledRequest) -> bool:
    """A row whose token is the argmax of its logits, and nothing more to compute."""
    return (s.num_samples == 1 and not s.spec_token_ids
            and len(s.request.output_token_ids) >= s.request.greedy_from)


def as_decodes(f: ForwardRow) -> list[ForwardRow]:
    if not 1 < len(f.token_ids) == f.num_logits:
        return [f]
    return [ForwardRow([t], f.start + i, f.block_ids, 1, f.lora_slot) for i, t in enumerate(f.token_ids)]
