"""Host-side planning of a prefill step for the prefill kernel (`prefill_triton`): launch settings per
format and step length, the per-step inputs every layer shares, and how the packed queries are cut into
query tiles. Kept apart from the kernel so the engine plans steps without the kernel's code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv4rl.kernels.decode_common import DecodeKind

# Tile shapes per (kind, KV4 side rows) (M rows = queries x GQA heads), chosen by tools/prefill_launch_sweep.py
# on an H200 at Qwen3 heads (bench/RESULTS.md). KV4 runs 128 x 32 at every length: with its INT8 passes in
# channel order it was 1.13-1.32x faster than 64 x 64 at 128-2,048 tokens at 8B heads, within 5% of the best at
# 1.7B heads (twenty-seventh session).
DEFAULT_PREFILL_LAUNCH = {
    (DecodeKind.BF16, False): {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    (DecodeKind.FP8, False): {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    (DecodeKind.INT4, False): {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    (DecodeKind.INT4, True): {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
}
# Steps whose longest row reaches LONG_PREFILL_CONTEXT tokens walk many key tiles per query tile, where INT4
# pages pay for other tiles: 1.37-1.60x at contexts of 1,280-2,304 tokens on an H200 at Qwen3 heads, 4-7%
# slower at 128 (bench/RESULTS.md, twenty-fifth session; 128-1,280 not timed), so short steps keep the defaults.
LONG_PREFILL_CONTEXT = 1024
LONG_PREFILL_LAUNCH = {  # (kind, KV4 side rows)
    (DecodeKind.INT4, False): {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
}


# Every tile holds all of a query's GQA heads, so a model with more query heads per KV head than the smallest
# BLOCK_M of any launch above cannot run the kernel (the engine prefills it on the torch path instead).
MAX_PREFILL_GROUP = min(launch["BLOCK_M"] for table in (DEFAULT_PREFILL_LAUNCH, LONG_PREFILL_LAUNCH)
                        for launch in table.values())


def prefill_launch(kind: DecodeKind, side: bool, longest_context: int) -> dict:
    """Launch settings of a prefill step whose longest row ends at `longest_context` tokens."""
    if longest_context >= LONG_PREFILL_CONTEXT and (kind, side) in LONG_PREFILL_LAUNCH:
        return LONG_PREFILL_LAUNCH[(kind, side)]
    return DEFAULT_PREFILL_LAUNCH[(kind, side)]


@dataclass
class PrefillBatch:
    """Per-step inputs shared by every layer (int32 device tensors).

    block_tables[B, W], context_lens[B] (tokens cached after the step's write), query_start[B + 1]
    (row b's new tokens are packed rows query_start[b]..query_start[b + 1] - 1), seq_slots[B] (KV4's side
    rows); tile_seq[T] / tile_query[T]: the sequence and first query of each program's query tile of
    `queries_per_tile` queries (see `prefill_tiles`).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    seq_slots: torch.Tensor
    tile_seq: torch.Tensor
    tile_query: torch.Tensor
    queries_per_tile: int
    block_size: int
    launch: dict | None = None  # the kernel's settings (None: DEFAULT_PREFILL_LAUNCH); tiles are cut for them


def queries_per_tile(block_m: int, group: int) -> int:
    """Queries of one tile: all G heads of each query fit in the M rows."""
    if group > block_m:
        raise ValueError(f"prefill kernel: {group} query heads per KV head exceed BLOCK_M={block_m}")
    return block_m // group


def prefill_tiles(query_lens: list[int], per_tile: int) -> tuple[list[int], list[int]]:
    """(sequence, first query) of every query tile, longest sequences' tiles first (they walk the most keys)."""
    order = sorted(range(len(query_lens)), key=lambda b: -query_lens[b])
    seqs, firsts = [], []
    for b in order:
        for q0 in range(0, query_lens[b], per_tile):
            seqs.append(b)
            firsts.append(q0)
    return seqs, firsts
