"""A step's prefill chunks as arrays (engine/step_rows.prefill_inputs): exact rows, slots and
tables, against the per-chunk layout they replace."""

from __future__ import annotations

import numpy as np

from engine.step_rows import ForwardRow, prefill_inputs

BLOCK = 4


def test_chunks_are_laid_out_after_the_decode_rows_with_one_padded_table():
    rows = [ForwardRow([11, 12, 13], 5, [7, 3, 9, 8], 1),  # over 5 cached tokens; a block to spare
            ForwardRow([21, 22, 23, 24, 25], 0, [6, 2], 0),  # a fresh prompt's chunk short of its end
            ForwardRow([31, 32], 2, [5], 1)]
    out = prefill_inputs(rows, first_row=3, block_size=BLOCK)
    assert out.token_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 25, 31, 32]
    assert out.positions.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 2, 3]
    assert out.token_starts.tolist() == [3, 6, 11] and out.num_tokens.tolist() == [3, 5, 2]
    assert out.context_lens.tolist() == [8, 5, 4] and out.num_blocks.tolist() == [2, 2, 1]
    # Entries up to each context's end, 0 after: the spare block (9) is not part of it.
    assert out.block_tables.tolist() == [[7, 3], [6, 2], [5, 0]]
    assert out.slots.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 24, 25, 26, 27, 2 * 4 + 0, 22, 23]
    assert out.logits_rows.tolist() == [5, 12]  # each sampling chunk's last row; none for the middle one
    assert all(a.dtype == np.int64 for a in (out.token_ids, out.positions, out.slots, out.logits_rows))


def test_a_chunk_that_needs_several_logits_gets_its_last_rows():
    out = prefill_inputs([ForwardRow([1, 2, 3, 4], 0, [0], 3)], first_row=0, block_size=BLOCK)
    assert out.logits_rows.tolist() == [1, 2, 3]
