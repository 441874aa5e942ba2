"""The learner's view of a rollout batch: padded token grids aligned for next-token log-probs.

Column j of every [B, L-1] tensor refers to predicting token j+1 from tokens 0..j, so the response
mask selects exactly the sampled tokens and the behaviour log-probs line up with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]   prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where token j+1 was sampled by the engine
    behavior_logprobs: torch.Tensor  # [B, L-1] log mu of token j+1 (0 off-mask)
    advantages: torch.Tensor  # [B, L-1] per-response advantage broadcast over its tokens
    versions: torch.Tensor  # [B, L-1] policy version that sampled token j+1 (-1 off-mask)

    @property
    def num_tokens(self) -> float:
        return float(self.response_mask.sum())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        return TrainBatch(*(getattr(self, f)[rows] for f in self.__slots__))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(*(getattr(self, f).to(device) for f in self.__slots__))


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    behavior_logprobs: list[list[float]],
    versions: list[list[int]],
    advantages: list[float] | list[torch.Tensor],
    pad_id: int,
    masked: list[bool] | None = None,
) -> TrainBatch:
    """Assemble rows `prompt + response`; every response must be non-empty. A row's advantage is one number for its
    response's tokens, or one per token (`with_advantages` gives a built batch its advantages). A row whose `masked` entry is true
    stays in the batch with no token to train (`trainer.mask_truncated`), in no loss denominator."""
    n = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length - 1)
    blp = torch.zeros(n, length - 1)
    adv = torch.zeros(n, length - 1)
    ver = torch.full((n, length - 1), -1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert r, "empty response"
        total = len(p) + len(r)
        ids[i, :total] = torch.tensor(p + r)
        attn[i, :total] = 1
        cols = slice(len(p) - 1, total - 1)
        mask[i, cols] = 0.0 if masked is not None and masked[i] else 1.0
        blp[i, cols] = torch.tensor(behavior_logprobs[i], dtype=torch.float32)
        adv[i, cols] = advantages[i]
        ver[i, cols] = torch.tensor(versions[i])
    return TrainBatch(ids, attn, mask, blp, adv, ver)


def untrained_rows(truncated: list[bool] | None, advantages: list[float], zero_advantage: bool) -> list[bool] | None:
    """The rows that stay in the batch with no token to train: the cut ones (`truncated`, given with
    `trainer.mask_truncated`) and, with `trainer.mask_zero_advantage`, those whose advantage is exactly 0."""
    if not zero_advantage:
        return truncated
    cut = truncated if truncated is not None else [False] * len(advantages)
    return [c or a == 0.0 for c, a in zip(cut, advantages, strict=True)]


def with_advantages(batch: TrainBatch, advantages: torch.Tensor, masked: list[bool] | None = None) -> TrainBatch:
    """`batch`, built with no row masked, given `advantages` ([B]: one a response, or [B, L-1]: one a token) on its
    response tokens and its `masked` rows out of the response mask: what `build_batch` builds from the same rows,
    without building it again (a KL in the reward builds the batch before the advantages exist)."""
    full = batch.response_mask
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(full.device) * full
    mask = full.clone()
    if masked is not None:
        mask[torch.tensor(masked, dtype=torch.bool)] = 0.0
    return TrainBatch(batch.input_ids, batch.attention_mask, mask, batch.behavior_logprobs, adv.float(), batch.versions)
