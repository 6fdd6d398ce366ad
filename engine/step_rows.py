"""A step's rows as the model runner builds its inputs from them: `ForwardRow`s (a sequence's
tokens this step), the steady decodes as columns (`SteadyRows`), single-token rows and
prefill chunks as arrays (`DecodeInputs`, `PrefillInputs`), and the tests that pick a step's
path (which rows run as decodes, whether every row samples plain greedy, whether a step may
be launched ahead)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain

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
    # Positions [a, b) whose tokens attend to each other both ways (an image's, in Gemma 3).
    bidirectional: tuple[tuple[int, int], ...] = ()


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
_token_ids = operator.attrgetter("token_ids")
_start = operator.attrgetter("start")
_num_logits = operator.attrgetter("num_logits")
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
    spans = ()
    if r.whole_images:
        end = start + len(tokens)
        spans = tuple((im.offset, im.end) for im in r.images if im.offset < end and im.end > start)
    return ForwardRow(tokens, start, s.block_ids, (1 + len(drafts)) if s.num_samples else 0, bidirectional=spans)


@dataclass(slots=True)
class DecodeInputs:
    """A step's single-token rows as arrays (int64)."""

    token_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]; the context length is position + 1
    slots: np.ndarray  # [n] where each row's K/V goes
    block_tables: np.ndarray  # [n, width], width = blocks up to the furthest position
    logits_rows: np.ndarray  # rows that need logits (a 1-token prefill chunk short of the end has none)


@dataclass(slots=True)
class PrefillInputs:
    """A step's multi-token rows (prefill chunks) as arrays (int64), with their block tables
    in one padded array, so that the device gets one copy of them all:

        block_tables [C, W]     row c = chunk c's entries up to its context, then 0
              ┌─────────────┐
        c=0   │ 7  3 12  0  │  ◄─ context 40 at block size 16: 3 entries
        c=1   │ 5  0  0  0  │
              └─────────────┘
    """

    token_ids: np.ndarray  # [T], the chunks' tokens in order
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] where each token's K/V goes
    logits_rows: np.ndarray  # rows of the step (from first_row) that need logits
    token_starts: np.ndarray  # [C] each chunk's first row of the step
    num_tokens: np.ndarray  # [C]
    context_lens: np.ndarray  # [C] cached + new tokens
    num_blocks: np.ndarray  # [C] table entries up to the context's end
    block_tables: np.ndarray  # [C, max(num_blocks)]


def prefill_inputs(rows: list[ForwardRow], first_row: int, block_size: int) -> PrefillInputs:
    """`rows` (at least one), laid out from row `first_row` of the step, as arrays: one
    pass over the rows for their lists, the rest whole-array."""
    n, bs = len(rows), block_size
    lens = np.fromiter(map(len, map(_token_ids, rows)), np.int64, n)
    starts = np.fromiter(map(_start, rows), np.int64, n)
    ends = starts + lens
    num_blocks = -(-ends // bs)
    tables = np.zeros((n, int(num_blocks.max())), dtype=np.int64)
    for i, (f, k) in enumerate(zip(rows, num_blocks.tolist())):
        tables[i, :k] = f.block_ids[:k]
    offsets = np.cumsum(lens) - lens  # each chunk's first row, from first_row
    chunk = np.repeat(np.arange(n), lens)
    positions = np.arange(int(lens.sum()), dtype=np.int64) + (starts - offsets)[chunk]
    slots = tables[chunk, positions // bs] * bs + positions % bs
    # A chunk's last num_logits rows need logits.
    num_logits = np.fromiter(map(_num_logits, rows), np.int64, n)
    logits_end = first_row + offsets + lens
    logits_rows = (np.arange(int(num_logits.sum()), dtype=np.int64)
                   + np.repeat(logits_end - num_logits - (np.cumsum(num_logits) - num_logits), num_logits))
    token_ids = np.fromiter(chain.from_iterable(map(_token_ids, rows)), np.int64, len(positions))
    return PrefillInputs(token_ids, positions, slots, logits_rows, first_row + offsets, lens, ends, num_blocks,
                         tables)


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
