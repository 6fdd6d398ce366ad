"""Block-table rows that persist across steps: the runner's half of the persistent batch.

A decode step's attention needs every running sequence's block table as one [n, width]
array. Built from Python lists each step, that costs O(context) per sequence; here each
sequence keeps a row of one preallocated array and a step writes only the entries that
changed (a block appended, 1 step in block_size).

Rows are keyed by the block manager's own table list (`BlockManager.live_block_table`),
which lives exactly as long as the sequence's blocks: a preempted and resumed sequence gets
a new list, so a new row. Entries changed in place (a copy-on-write fork, a block released
behind a sliding window) are caught by `invalidate`, which the runner calls on steps with
block copies. Released entries are never read (engine/attention), so a stale one is moot.

    array [capacity, width] int64     row r = one sequence's table, 0 past its end
           ┌──────────────────────┐
    row 0  │ 7  3 12  0  0 ...    │ ◄─ the list [7, 3, 12], 3 entries written
    row 1  │ 5  9  0  0  0 ...    │
           └──────────────────────┘
"""

from __future__ import annotations

import operator

import numpy as np


class BlockTables:
    def __init__(self, width: int, capacity: int = 64) -> None:
        self.array = np.zeros((capacity, max(width, 1)), dtype=np.int64)
        self._rows: dict[int, int] = {}  # id(table) -> its row
        self._tables: list[list[int] | None] = [None] * capacity  # per row: the list it mirrors,
        # kept so that its id() stays unique while the row is in use
        self._written = np.zeros(capacity, dtype=np.int64)  # per row: leading entries copied
        self._free = list(range(capacity - 1, -1, -1))
        # The latest call's tables and their rows: a decode step usually asks for the very
        # same tables in the same order as the step before (engine/scheduler.py keeps the
        # running order), and then skips the lookups.
        self._last_tables: list[list[int]] = []
        self._last_rows = np.zeros(0, dtype=np.int64)

    def invalidate(self) -> None:
        """Forget every row: entries may have changed in place (copy-on-write)."""
        for index in self._rows.values():
            self._release(index)
        self._rows = {}
        self._last_tables = []

    def gather(self, tables: list[list[int]], width: int) -> np.ndarray:
        """These tables as a [len(tables), width] array (entries past a table's end are 0).
        Rows of tables absent from this call are released: call once per forward.

        The per-table work is in C (map over ids, lengths, row indices); Python only
        touches the tables that are new since the last call or have grown."""
        last = self._last_tables
        if len(last) == len(tables) and all(map(operator.is_, tables, last)):
            rows = self._last_rows
        else:
            rows = self._rows_of(tables)
            self._last_tables, self._last_rows = tables, rows
        lengths = np.fromiter(map(len, tables), np.int64, len(tables))
        written = self._written[rows]
        grown = np.flatnonzero(lengths != written)
        if len(grown):
            one = grown[lengths[grown] == written[grown] + 1]  # a decode's new block: one entry each
            if len(one) == len(grown) and lengths[one].max() <= self.array.shape[1]:
                self.array[rows[one], written[one]] = [tables[i][-1] for i in one.tolist()]
                self._written[rows[one]] += 1
            else:
                for i in grown.tolist():
                    self._write(int(rows[i]), tables[i])
        return self.array[rows, :width]

    def _rows_of(self, tables: list[list[int]]) -> np.ndarray:
        """Each table's row, taking rows for new tables and releasing those of absent ones."""
        keys = list(map(id, tables))
        index = list(map(self._rows.get, keys))
        if None in index:
            for i, key in enumerate(keys):
                if index[i] is None:
                    # A draft verification's rows share their sequence's table: one row.
                    index[i] = self._rows.get(key)
                    if index[i] is None:
                        index[i] = self._rows[key] = self._take_row(tables[i])
        if len(self._rows) > len(keys) or len(self._rows) != len(set(keys)):
            live = set(keys)
            for key in [k for k in self._rows if k not in live]:
                self._release(self._rows.pop(key))
        return np.array(index, dtype=np.int64)

    def _write(self, index: int, table: list[int]) -> None:
        """Copy the entries appended since the last write (a table never shrinks)."""
        start = int(self._written[index])
        if start == len(table):  # a shared table, written for an earlier row of this call
            return
        if len(table) > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], len(table)), dtype=np.int64)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        if start == len(table) - 1:  # a decode's new block: one entry, no list slice
            self.array[index, start] = table[start]
        else:
            self.array[index, start:len(table)] = table[start:]
        self._written[index] = len(table)

    def _take_row(self, table: list[int]) -> int:
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._written = np.concatenate([self._written, np.zeros_like(self._written)])
            self._tables += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        index = self._free.pop()
        self.array[index] = 0
        self._written[index] = 0
        self._tables[index] = table
        return index

    def _release(self, index: int) -> None:
        self._tables[index] = None
        self._free.append(index)
