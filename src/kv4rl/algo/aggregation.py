"""Reduce per-token loss terms `[B, T]` to a scalar (docs/objectives.md: `token_mean`, `seq_mean`,
`token_sum_norm` or `seq_mean_token_sum`).

The denominators are explicit arguments because a learner splits a batch into micro-batches and
sums their losses: passing the *full batch's* token count (token_mean) or sequence count (seq_mean)
to every micro-batch makes that sum equal the full-batch loss exactly. When omitted they default
to this call's own counts. `seq_mean` divides each row by its own length first, so that part is
local to a row and survives any split by rows. `token_sum_norm` (Dr. GRPO) divides every row by one
constant length instead, so a long response's tokens weigh as much as a short one's.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AggMode = Literal["token_mean", "seq_mean", "token_sum_norm", "seq_mean_token_sum"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> Tensor:
    """Scalar reduction of `values [B, T]` over `mask [B, T]` (nonzero = valid token).

    - `token_mean`: Σ_{i,t} values·mask / num_tokens (default: valid tokens here, at least 1).
    - `seq_mean`: Σ_i [Σ_t values·mask / len_i] / num_seqs (default: rows here with len_i > 0,
      at least 1); rows with no valid token contribute 0.
    - `token_sum_norm`: Σ_{i,t} values·mask / (num_seqs · norm_tokens), `num_seqs` as in `seq_mean` and
      `norm_tokens` a constant length (the run's `rollout.max_new_tokens` unless `algo.loss_norm_tokens`).
    - `seq_mean_token_sum` (verl's seq-mean-token-sum): Σ_{i,t} values·mask / num_seqs, each response's token sum
      averaged over the responses.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    for name, denom in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("norm_tokens", norm_tokens)):
        if denom is not None and not denom > 0:
            raise ValueError(f"{name} must be > 0 when given, got {denom}")
    valid = mask.bool()
    masked = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "token_mean":
        denom = num_tokens if num_tokens is not None else valid.sum().clamp(min=1).to(values.dtype)
        return masked.sum() / denom
    if mode == "seq_mean":
        lengths = valid.sum(dim=-1)
        row_means = masked.sum(dim=-1) / lengths.clamp(min=1).to(values.dtype)
        denom = num_seqs if num_seqs is not None else (lengths > 0).sum().clamp(min=1).to(values.dtype)
        return row_means.sum() / denom
    if mode in ("token_sum_norm", "seq_mean_token_sum"):  # token sums over the responses (x one constant length)
        if mode == "token_sum_norm" and norm_tokens is None:
            raise ValueError("loss aggregation 'token_sum_norm' needs norm_tokens, the constant length each "
                             "response's token sum is divided by (LossInputs.aggregate passes it)")
        denom = num_seqs if num_seqs is not None else (valid.sum(dim=-1) > 0).sum().clamp(min=1).to(values.dtype)
        return masked.sum() / (denom * (norm_tokens if mode == "token_sum_norm" else 1.0))
    raise ValueError(f"unknown loss aggregation '{mode}' (known: {', '.join(AGG_MODES)})")


def batch_denominators(mask: Tensor) -> tuple[float, float]:
    """(num_tokens, num_seqs) of a full batch, to pass to every micro-batch's `aggregate`."""
    valid = mask.bool()
    return float(valid.sum()), float((valid.sum(dim=-1) > 0).sum())
