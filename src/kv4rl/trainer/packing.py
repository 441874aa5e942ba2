"""Packed micro-batches: rows of a padded TrainBatch laid end to end in one row, without padding.

Padding costs compute in proportion to the longest row of a micro-batch; with log-normal response
lengths most of a padded grid can be padding. Packing concatenates the real tokens of several rows
(prompt + response) into one `[1, T]` row whose `position_ids` restart at 0 for every sequence.
transformers reads restarting positions with `attention_mask=None` as packed sequences and builds a
block-diagonal causal mask, so no token attends across a sequence boundary (tests/test_packing.py
checks this against separate forwards). The per-token outputs are then scattered back to the padded
`[b, L-1]` layout, so the loss sees exactly the tensors of the padded path: per-sequence
aggregations and the future-KL credit never mix sequences, and the loss normalisation is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices into micro-batches of at most `max_tokens` tokens, longest first, first fit.

    A row longer than `max_tokens` goes alone in its own micro-batch (it cannot be split: its tokens
    attend to each other). Every index appears exactly once; within a micro-batch rows keep the
    order in which they were placed.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[row]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(max(max_tokens - n, 0))
    return bins


@dataclass(slots=True)
class PackedRows:
    """One packed row and the map from it back to the padded `[b, L-1]` next-token grid."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for every sequence
    gather: torch.Tensor  # [b, L-1] index into the packed next-token axis (T-1); 0 where invalid
    valid: torch.Tensor  # [b, L-1] bool, True at the real next-token positions of each row

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[1, T-1]` per-token values of the packed row -> `[b, L-1]`, 0 off the real positions."""
        return torch.where(self.valid, packed[0][self.gather], 0)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack the right-padded rows `input_ids [b, L]` (real tokens where `attention_mask` is 1)."""
    lengths = attention_mask.sum(1)
    keep = attention_mask.bool()
    ids = input_ids[keep].unsqueeze(0)  # row-major: row 0's tokens, then row 1's, ...
    device = input_ids.device
    cols = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    positions = cols[keep].unsqueeze(0)
    starts = torch.cumsum(lengths, 0) - lengths  # offset of each row in the packed row
    # column j of a row predicts its token j+1 from position starts+j of the packed row
    gather = starts[:, None] + cols[:, :-1]
    valid = cols[:, :-1] < (lengths[:, None] - 1)
    return PackedRows(ids, positions, torch.where(valid, gather, 0), valid)
