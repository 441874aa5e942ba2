"""Fixed-size KV block allocator (torch-free): which cache blocks each sequence owns."""

from __future__ import annotations

from collections import deque

from kv4rl.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out block ids from a free list; a sequence's blocks cover positions 0..len-1."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for `num_tokens` tokens (caller checked `can_grow`)."""
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
