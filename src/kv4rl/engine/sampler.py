"""Token sampling that reports each token's log-prob under the distribution actually sampled.

The reported log-prob is `log_softmax(truncate(logits / τ))` at the sampled token, so with top-p = 1
and top-k off it is exactly the behaviour policy μ that RL needs; greedy rows report 0 (a point mass).
"""

from __future__ import annotations

import torch


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside top-k / top-p with -inf (rows with k <= 0 / p == 1 are unchanged)."""
    vocab = scaled.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits[B, V] -> (token ids[B], log-probs[B]); per-row temperature / top-k / top-p."""
    logits = logits.float()
    greedy = temperature <= 0
    safe_temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = _truncate(logits / safe_temp[:, None], top_k, top_p)
    logprobs_all = scaled.log_softmax(-1)
    sampled = torch.multinomial(logprobs_all.exp(), 1, generator=generator).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    logprobs = torch.where(greedy, torch.zeros_like(logprobs), logprobs)
    return tokens, logprobs
