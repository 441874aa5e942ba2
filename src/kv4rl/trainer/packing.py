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

import heapq
from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices into micro-batches of at most `max_tokens` tokens, as evenly filled as the
    rows allow, in about as many as longest-first first fit needs (at 8k long-tailed rows even filling
    needed 2% more).

    Even sizes are for compiled layers: first fit leaves a remainder (470 tokens beside 16,384-token
    micro-batches in a 4B step on 2026-12-02) whose size falls outside the range inductor specialised
    the step's graphs for, and recompiling them cost ~20 s in the middle of the timed step. Rows go
    longest first to the emptiest of `n` micro-batches (the least filled one has the most room), so
    the sizes differ by at most one row's length; where a row then fits nowhere, `n` grows: by doubling
    steps, then halving back to an `n` that fills where `n - 1` did not (8,192 long-tailed rows: 12 fills,
    where one more at a time took 39). A row longer than `max_tokens` goes alone (it cannot be split: its
    tokens attend to each other). Every index appears exactly once; within a micro-batch rows keep the order
    they were placed in.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = _first_fit_count(order, lengths, max_tokens)
    bins = _fill_evenly(order, lengths, max_tokens, n)
    if bins is not None:
        return bins
    failed, step = n, 1
    while True:
        filled = min(failed + step, len(lengths))  # len(lengths) always fills: one row each
        if (bins := _fill_evenly(order, lengths, max_tokens, filled)) is not None:
            break
        failed, step = filled, step * 2
    while filled - failed > 1:
        mid = (failed + filled) // 2
        if (trial := _fill_evenly(order, lengths, max_tokens, mid)) is None:
            failed = mid
        else:
            filled, bins = mid, trial
    return bins


def _fill_evenly(order: list[int], lengths: list[int], max_tokens: int, n: int) -> list[list[int]] | None:
    """Rows in `order`, each to the emptiest of `n` micro-batches; None where one fits in none."""
    bins: list[list[int]] = [[] for _ in range(n)]
    heap = [(0, b) for b in range(n)]  # (tokens so far, micro-batch), the emptiest first
    for row in order:
        load, b = heapq.heappop(heap)
        if bins[b] and load + lengths[row] > max_tokens:
            return None
        bins[b].append(row)
        heapq.heappush(heap, (load + lengths[row], b))
    return bins


def _first_fit_count(order: list[int], lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches longest-first first fit packs the rows into (a lower bound to start from).

    The first micro-batch with room for a row is found in a tree of the largest room under each node, so a
    row costs O(log rows), not a scan of every open micro-batch (287 ms at 8k rows and 1,800 micro-batches)."""
    size = 1
    while size < max(len(order), 1):
        size *= 2
    most = [-1] * (2 * size)  # most[node]: the largest room of the micro-batches under it; -1 where none is open
    opened = 0
    for row in order:
        need = lengths[row]
        if most[1] >= need:
            node = 1
            while node < size:  # down to the leftmost leaf with room
                node = 2 * node if most[2 * node] >= need else 2 * node + 1
            most[node] -= need
        else:
            node = size + opened
            opened += 1
            most[node] = max(max_tokens - need, 0)
        node //= 2
        while node:
            most[node] = max(most[2 * node], most[2 * node + 1])
            node //= 2
    return opened


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
