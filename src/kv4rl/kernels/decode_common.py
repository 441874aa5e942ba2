"""What the two decode-attention bodies (Triton, `decode_attention`; CUDA INT4, `int4_decode_cuda`) share.

Named kernel kinds (a KV format binds to one, see `KVFormat.decode_kind`), the per-step batch every
layer reads, and the description of one split launch, so the dispatcher hands either body the same
object and both fill the same partial outputs for the Triton merge. Imports only torch: the engine
and the formats may name kinds on machines without Triton.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634  # both bodies run exp2 on scores pre-scaled by log2(e)


class DecodeKind(enum.IntEnum):
    """The kernels' `KIND` constant: how a cache row is stored (values are the kernels' numbers; the fused
    writer's `STORE` uses the first three the same way)."""

    BF16 = 0  # values as they are
    FP8 = 1  # e4m3 codes, one float32 scale per token and head
    INT4 = 2  # packed nibbles, fp16 scale and zero per token and head
    INT8_SIDE = 3  # KV4's protected INT8 rows (per-sequence sink rows and recent ring)


@dataclass
class DecodeBatch:
    """Per-step inputs shared by every layer (static buffers when replayed in a CUDA graph).

    block_tables[B, max_blocks] int32, context_lens[B] int32 (0 = padding row), seq_slots[B] int32
    (KV4's protected rows), split_size[1] int32 (tokens per split), max_splits (grid size).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    seq_slots: torch.Tensor
    split_size: torch.Tensor
    max_splits: int
    block_size: int


@dataclass
class SplitLaunch:
    """One split-kernel launch over positions [start, L - end_off) of every sequence, filling
    `o_part[:, :, split_base:split_base + num_splits]` / `lse_part` with normalised partial outputs and
    their log2-sum-exp. `out` set (KV4's INT8 item only): merge with the body's partials into it.
    `rotate_query`: q is raw and the kernel rotates it (the CUDA INT4 body, `q_rot_out` receiving it, and
    KV4's CUDA INT8 item launched beside that body)."""

    q: torch.Tensor
    kind: DecodeKind
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_zero: torch.Tensor | None
    batch: DecodeBatch
    o_part: torch.Tensor
    lse_part: torch.Tensor
    num_splits: int
    sm_scale: float
    start: int = 0
    end_off: int = 0
    n_sink: int = 0
    n_recent: int = 0
    split_base: int = 0
    rotate_query: bool = False
    q_rot_out: torch.Tensor | None = None
    out: torch.Tensor | None = None

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q.shape[1] // self.k.shape[1]
