"""Which attention kernel the learner's transformers model runs (`trainer.attention`).

A packed micro-batch is one `[1, T]` row whose `position_ids` restart at every sequence. With SDPA,
transformers turns that into a dense `[T, T]` block-diagonal mask, so SDPA cannot use its flash
kernels and does the whole row's quadratic work. With `flex_attention`, transformers'
`masking_utils` reads the same restarting positions (`find_packed_sequence_indices`: a position
step other than +1 starts a new document) and builds a `BlockMask` of causal-within-document
blocks; `integrations/flex_attention.py` compiles `flex_attention` once (`torch.compile`), and the
kernel skips every block that lies across documents. FlexAttention has no backward on the CPU
(torch raises), so `flex` needs CUDA; `auto` picks flex on CUDA when micro-batches are packed and
SDPA otherwise (padded rows gain nothing from a block mask).
"""

from __future__ import annotations

import torch

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
