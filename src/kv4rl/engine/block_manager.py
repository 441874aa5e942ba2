"""Fixed-size KV block allocator (torch-free): which cache blocks each sequence owns."""

from __future__ import annotations

from collections import deque

from kv4rl.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out block ids from a free list; a sequence's blocks cover positions 0..len-1.

    Blocks are reference-counted so that the responses of a GRPO group can hold one copy of their
    shared prompt: `share` adds a holder, `free` drops one, and a block returns to the free list only
    when its last holder lets go.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.num_shared_blocks = 0  # blocks held by more than one sequence right now

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for `num_tokens` tokens (caller checked `can_grow`)."""
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            block = self._free.popleft()
            self._refs[block] = 1
            seq.block_table.append(block)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Append blocks another sequence holds to `seq`'s table (read-only for both from now on)."""
        for block in blocks:
            if self._refs[block] <= 0:  # an explicit check: under `python -O` an assert would let two sequences own it
                raise RuntimeError(f"block {block} is free and cannot be shared")
            self._refs[block] += 1
            self.num_shared_blocks += self._refs[block] == 2
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._refs[block] -= 1
            self.num_shared_blocks -= self._refs[block] == 1
            if self._refs[block] == 0:
                self._free.append(block)
        seq.block_table = []
        seq.table_epoch += 1  # the table starts again: host mirrors of it (`BlockTableMirror`) are stale
        seq.num_cached_tokens = 0
