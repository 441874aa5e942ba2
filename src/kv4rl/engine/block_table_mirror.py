"""The running sequences' block tables as one numpy array by sequence slot, kept up to date by copying
only what each sequence appended since it was last seen.

A decode step needs every row's block table as an int32 array. Converting each sequence's Python list
whole at every step costs O(batch x context / block_size) host work per step (1.6-1.8 ms at B128 x 4096
or B64 x 8192 on a 2-core CPU, with the GPU idle meanwhile); a table only ever grows by appends between
two `BlockManager.free` calls, which bump `Sequence.table_epoch`, so a row is rewritten whole only when
its slot changes owner or its owner's table was freed (preemption), and otherwise extended.
"""

from __future__ import annotations

import numpy as np

from kv4rl.engine.sequence import Sequence


class BlockTableMirror:
    """Rows by `seq_slot`; columns grow to the longest table seen. Entries past a table's end are 0."""

    def __init__(self, rows: int = 1, cols: int = 1) -> None:
        self.tables = np.zeros((rows, cols), dtype=np.int32)
        self.owner: list[tuple[int, int] | None] = [None] * rows  # (seq_id, table_epoch) of each row
        self.filled = np.zeros(rows, dtype=np.int64)  # entries of the owner's table copied so far

    def _reserve(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.tables.shape
        if rows <= old_rows and cols <= old_cols:
            return
        rows, cols = max(rows, old_rows), max(cols, 2 * old_cols if cols > old_cols else old_cols)
        grown = np.zeros((rows, cols), dtype=np.int32)
        grown[:old_rows, :old_cols] = self.tables
        self.tables = grown
        self.owner += [None] * (rows - old_rows)
        self.filled = np.concatenate((self.filled, np.zeros(rows - old_rows, dtype=np.int64)))

    def update(self, seqs: list[Sequence]) -> None:
        """Bring the rows of `seqs` (running, each in its own slot) up to date."""
        self._reserve(max(s.seq_slot for s in seqs) + 1, max(len(s.block_table) for s in seqs))
        tables, owner, filled = self.tables, self.owner, self.filled
        for s in seqs:
            slot, table = s.seq_slot, s.block_table
            key = (s.seq_id, s.table_epoch)
            n = len(table)
            done = int(filled[slot])
            if owner[slot] != key or n < done:  # a new owner, or its table was freed and grown again
                tables[slot, :done] = 0
                owner[slot], done = key, 0
            if n > done:
                tables[slot, done:n] = table[done:n]
                filled[slot] = n

    def gather(self, seqs: list[Sequence], seq_slots: np.ndarray, width: int) -> np.ndarray:
        """`[len(seqs), width]` int32: each sequence's block table, zero-padded (a new array). Sequences
        that share a slot (the memory profile's dummy rows all use slot 0) are converted whole instead."""
        if len(np.unique(seq_slots)) < len(seqs):
            tables = np.zeros((len(seqs), width), dtype=np.int32)
            for i, s in enumerate(seqs):
                tables[i, :len(s.block_table)] = s.block_table
            return tables
        self.update(seqs)
        return self.tables[seq_slots, :width]
