"""The runner's persistent block tables: exact rows, written by diff, keyed by table identity."""

from __future__ import annotations

import numpy as np

from engine.block_tables import BlockTables


def test_rows_are_the_tables_padded_with_zeros():
    tables = BlockTables(width=4, capacity=2)
    a, b = [7, 3, 12], [5]
    assert tables.gather([a, b], 3).tolist() == [[7, 3, 12], [5, 0, 0]]


def test_an_appended_block_is_written_and_nothing_else_is():
    tables = BlockTables(width=4)
    a = [7, 3]
    tables.gather([a], 2)
    index = tables._rows[id(a)]
    tables.array[index, 0] = 99  # were the whole row rewritten, this would be undone
    a.append(12)
    assert tables.gather([a], 3).tolist() == [[99, 3, 12]]


def test_a_new_table_with_the_same_contents_gets_a_fresh_row():
    tables = BlockTables(width=4)
    a = [7, 3]
    tables.gather([a], 2)
    tables.array[tables._rows[id(a)], 0] = 99
    resumed = [7, 3]  # a preempted sequence's new table, say
    assert tables.gather([resumed], 2).tolist() == [[7, 3]]


def test_tables_absent_from_a_call_give_their_rows_back():
    tables = BlockTables(width=2, capacity=2)
    a, b, c = [1], [2], [3]
    tables.gather([a, b], 1)
    assert tables.gather([c], 1).tolist() == [[3]]
    assert len(tables._rows) == 1 and len(tables._free) == tables.array.shape[0] - 1


def test_rows_that_share_a_table_share_a_row():
    tables = BlockTables(width=2)
    a = [4, 5]  # a draft verification: k + 1 rows over one sequence's table
    assert tables.gather([a, a, a], 2).tolist() == [[4, 5]] * 3
    assert len(tables._rows) == 1


def test_invalidate_rereads_entries_changed_in_place():
    tables = BlockTables(width=2)
    a = [4, 5]
    tables.gather([a], 2)
    a[1] = 9  # copy-on-write replaced the shared last block
    tables.invalidate()
    assert tables.gather([a], 2).tolist() == [[4, 9]]


def test_capacity_and_width_grow_when_needed():
    tables = BlockTables(width=2, capacity=1)
    rows = [list(range(i, i + 5)) for i in range(3)]
    assert np.array_equal(tables.gather(rows, 5), np.array(rows))
    assert tables.array.shape[0] >= 3 and tables.array.shape[1] >= 5
