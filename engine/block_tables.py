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
    row 0  │ 7  3 12  0  0 ...    │ ◄─ _Row(table=<list [7, 3, 12]>, num_written=3)
    row 1  │ 5  9  0  0  0 ...    │
           └──────────────────────┘
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class _Row:
    index: int
    table: list[int]  # the list it mirrors (kept so its id() stays unique while cached)
    num_written: int  # leading entries copied into the array


class BlockTables:
    def __init__(self, width: int, capacity: int = 64) -> None:
        self.array = np.zeros((capacity, max(width, 1)), dtype=np.int64)
        self._rows: dict[int, _Row] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def invalidate(self) -> None:
        """Forget every row: entries may have changed in place (copy-on-write)."""
        self._free += [row.index for row in self._rows.values()]
        self._rows = {}

    def gather(self, tables: list[list[int]], width: int) -> np.ndarray:
        """These tables as a [len(tables), width] array (entries past a table's end are 0).
        Rows of tables absent from this call are released: call once per forward."""
        previous, current, index = self._rows, {}, []
        for table in tables:
            key = id(table)
            row = current.get(key)  # a draft verification's rows share their sequence's table
            if row is None:
                row = previous.pop(key, None)
                if row is None:
                    row = _Row(self._take_row(), table, 0)
                if row.num_written != len(table):
                    self._write(row)
                current[key] = row
            index.append(row.index)
        self._free += [row.index for row in previous.values()]
        self._rows = current
        return self.array[index, :width]

    def _write(self, row: _Row) -> None:
        """Copy the entries appended since the last write (a table never shrinks)."""
        table, start = row.table, row.num_written
        if len(table) > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], len(table)), dtype=np.int64)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        self.array[row.index, start:len(table)] = table[start:]
        row.num_written = len(table)

    def _take_row(self) -> int:
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        index = self._free.pop()
        self.array[index] = 0
        return index
