"""Which attention kernel the learner's transformers model runs (`trainer.attention`).

A packed micro-batch is one `[1, T]` row whose `position_ids` restart at every sequence. With SDPA,
transformers turns that into a dense `[T, T]` block-diagonal mask, so SDPA cannot use its flash
kernels and does the whole row's quadratic work. With `flex_attention`, transformers'
`masking_utils` reads the same restarting positions (`find_packed_sequence_indices`: a position
step other than +1 starts a new document) and builds a `BlockMask` of causal-within-document
blocks; `integrations/flex_attention.py` compiles `flex_attention` once (`torch.compile`), and the
kernel skips every block that lies across documents. transformers builds that mask with
`create_block_mask(_compile=True)`, and on the H200 (torch 2.11) inductor's kernel for it did not
finish compiling in 150 s at a 16,384-token row (ptxas on one reduction). `document_block_mask`
builds the same `BlockMask` directly from the sequence lengths, a few small tensor operations per
micro-batch, and the learner passes it as the 4-D mask, which transformers uses as given. FlexAttention has no backward on the CPU
(torch raises), so `flex` needs CUDA; `auto` picks flex on CUDA when micro-batches are packed and
SDPA otherwise (padded rows gain nothing from a block mask).
"""

from __future__ import annotations

import torch

BLOCK = 128  # FlexAttention's default block size

CHOICES = ("auto", "sdpa", "flex")
_HF_NAMES = {"sdpa": "sdpa", "flex": "flex_attention"}


def check_attention(choice: str, device: torch.device) -> None:
    """Refuse a setting that cannot run on `device`, before any model is loaded."""
    if choice not in CHOICES:
        raise ValueError(f"trainer.attention must be one of {', '.join(CHOICES)}, got '{choice}'")
    if choice == "flex" and device.type != "cuda":
        raise ValueError(f"trainer.attention=flex needs a CUDA device: FlexAttention has no backward pass on "
                         f"device {device} (torch {torch.__version__}); use trainer.attention=auto or sdpa")


def resolve_attention(choice: str, device: torch.device, packed: bool) -> str:
    """`sdpa` or `flex` for this device and micro-batch layout."""
    check_attention(choice, device)
    if choice == "auto":
        return "flex" if device.type == "cuda" and packed else "sdpa"
    return choice


def set_attention(model, attention: str) -> None:
    """Switch a transformers model (FSDP2-wrapped or not) to `attention` (`sdpa` or `flex`)."""
    name = type(model).__name__.removeprefix("FSDP")
    try:
        model.set_attn_implementation(_HF_NAMES[attention])
    except (ValueError, ImportError) as exc:
        raise ValueError(f"trainer.attention={attention}: {name} cannot use it ({exc})") from exc
    if model.config._attn_implementation != _HF_NAMES[attention]:  # transformers only warns for some models
        raise ValueError(f"trainer.attention={attention}: {name} cannot switch its attention implementation")


def document_block_mask(lengths: torch.Tensor, block: int = BLOCK, symbolic: bool | None = None):
    """The `BlockMask` of causal attention within each of the sequences laid end to end with
    `lengths` (a packed row of `T = sum(lengths)` tokens), built from the block structure itself.

    With `doc[t]` the sequence of token t, key block j is needed by query block i when some key
    k <= q shares q's sequence: j <= i and the last sequence in j reaches the first in i. It is
    full (no element masked) when j < i and both blocks lie in one sequence; the diagonal block
    and blocks cut by a boundary are partial, and `mask_mod` masks their elements.

    `symbolic`: its block counts marked dynamic for a compiled consumer (`mark_block_counts_dynamic`);
    default on CUDA only, as inductor's C++ FlexAttention kernel for the CPU does not compile with them
    (torch 2.13: an undeclared variable in the generated code).
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = lengths.device
    total = int(lengths.sum())
    n_blocks = -(-total // block)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    doc = torch.cat([doc, doc.new_full((n_blocks * block - total,), len(lengths))])  # the tail: a sequence of its own
    first, last = doc[::block], doc[block - 1::block]
    i = torch.arange(n_blocks, device=device)
    below = i[None, :] <= i[:, None]  # [query block, key block]
    needed = below & (last[None, :] >= first[:, None])
    full = (i[None, :] < i[:, None]) & (first[None, :] == last[:, None])
    partial = needed & ~full

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True)  # listed blocks first, in order
        return blocks.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    kv_num, kv_idx = listed(partial)
    full_num, full_idx = listed(full)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(total, total))
    if lengths.is_cuda if symbolic is None else symbolic:
        mark_block_counts_dynamic(mask, doc)
    return mask


def mark_block_counts_dynamic(mask, doc: torch.Tensor) -> None:
    """Let a compiled layer (`trainer.compile_layers`) take the block count of `mask` (and `doc`, which its
    `mask_mod` reads) as symbolic from its first graph. Packed micro-batches are nearly all full, so nearly
    all have the same block count (16,384 tokens: 128 blocks): dynamo compiled each graph for that count
    and recompiled it at the first micro-batch with another, which can come iterations later: the likely
    cause of a timed 4B update taking 39.4 s against 18.3 s (H200, 2026-12-02, bench/RESULTS.md)."""
    torch._dynamo.maybe_mark_dynamic(doc, 0)
    for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
              mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, list(range(2, t.dim())))
