"""Token sampling that reports each token's log-prob under the distribution actually sampled.

The reported log-prob is `log_softmax(truncate(logits / τ))` at the sampled token, so with top-p = 1
and top-k and min-p off it is exactly the behaviour policy μ that RL needs; greedy rows report 0 (a point mass).

Randomness is counter-based: the Gumbel noise for a token is a hash of (the sequence's seed, its
position, the vocabulary index). A sequence therefore samples the same tokens whatever batch it
shares, whether it was preempted and recomputed, or resumed from a checkpoint — which is what makes
partial rollout and resume reproducible. Gumbel-max over the truncated logits is an exact sample; it
needs no normalisation (a row's constant moves no argmax), so both paths add the noise to the scaled
logits themselves. The torch path reports `log_softmax` at the token; the fused path subtracts the
row's log-sum-exp from the kernel's own pass, equal to a few float32 roundings.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # as signed int64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
TOP_BITS = 2**53 - 2  # the largest 53-bit hash whose (bits + 0.5) * 2^-53 stays below 1


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float64 uniforms in (0, 1), a pure function of (seed, step, vocab index).

    The top hash value 2^53 - 1 would round to u = 1 (noise +inf, and NaN on a masked -inf logit, which
    argmax would pick); it is taken as 2^53 - 2 (u = 1 - 2^-52), as the Triton kernel takes it."""
    row = splitmix64(seeds ^ splitmix64(steps))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.long) * _GOLDEN
    bits = _shr(splitmix64(row[:, None] + cols[None, :]), 11).clamp_(max=TOP_BITS)
    return (bits.double() + 0.5) * 2.0**-53


def truncate_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask logits outside min-p / top-k / top-p with -inf (rows with min_p == 0 / k <= 0 / p == 1 are unchanged),
    in vLLM's order: min-p keeps a token at least `min_p` times as likely as the row's likeliest, then top-k, then
    top-p over what is left (transformers applies min-p last, which with top-p can keep more tokens)."""
    vocab = scaled.shape[-1]
    if min_p is not None and bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  z_i - z_max >= log(min_p); log(0) = -inf keeps a row whole
        floor = scaled.max(dim=-1, keepdim=True).values + min_p.double().log().float()[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        # rows at p = 1 keep every token: float32's cumsum reaches 1.0 before a long tail ends, which cut
        # their tail whenever another row of the step truncated
        drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _fused_usable(device: torch.device, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
                  truncated: bool | None) -> bool:
    """The fused kernel covers untruncated rows (top-k off, top-p = 1, min-p = 0) on CUDA or the interpreter;
    greedy rows are fine too, their token is the logits' argmax whatever the kernel draws."""
    from kv4rl.kernels import kernels_usable

    if not kernels_usable(device):
        return False
    if truncated is None:
        truncated = bool(((top_k > 0) | (top_p < 1)).any()) or (min_p is not None and bool((min_p > 0).any()))
    return not truncated


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    fused: bool = False,
    truncated: bool | None = None,
    greedy_rows: bool | None = None,
    unit_temperature: bool | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits[B, V] -> (token ids[B], log-probs[B]); per-row temperature / top-k / top-p / seed / step, and min-p
    where given (None: off).

    `fused` draws the Gumbel-max tokens with the Triton kernel (`kv4rl.kernels.sampling`: the same
    tokens without materialising the [B, V] noise, and log-probs equal to float32 rounding) when no row
    is truncated and the kernels can run on the logits' device; otherwise, and for truncated batches,
    the torch path below runs. `truncated`: whether any row has top-k, top-p or min-p on, when the caller
    knows it from the host-side parameters; None reads it from the tensors, a device-to-host wait
    before the sampling kernels are launched.
    `greedy_rows` (any row at temperature <= 0) and `unit_temperature` (every row at temperature 1 or
    greedy), when the caller knows them, skip passes over the [B, V] logits that cannot change a value:
    the argmax no row takes, and a division by 1 (exact in IEEE arithmetic). None does them all.
    """
    logits = logits.float()
    greedy = temperature <= 0
    if unit_temperature:
        scaled = logits
    else:
        safe_temp = torch.where(greedy, torch.ones_like(temperature), temperature)
        scaled = logits / safe_temp[:, None]
    if fused and _fused_usable(logits.device, top_k, top_p, min_p, truncated):
        from kv4rl.kernels.sampling import gumbel_argmax

        # no row truncates, so truncate_logits would return `scaled`; the kernel's pass also gives each
        # row's log-sum-exp, so only the sampled token is normalised (no log_softmax over [B, V])
        sampled, log_norm = gumbel_argmax(scaled, seeds, steps, with_log_norm=True)
        token_logprob = lambda tokens: (scaled.gather(1, tokens[:, None]).squeeze(1).double() - log_norm).float()
    else:
        kept = truncate_logits(scaled, top_k, top_p, min_p)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
        sampled = (kept.double() + gumbel).argmax(-1)
        logprobs_all = kept.log_softmax(-1)
        token_logprob = lambda tokens: logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    if greedy_rows is False:
        return sampled, token_logprob(sampled)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    logprobs = torch.where(greedy, torch.zeros_like(sampled, dtype=scaled.dtype), token_logprob(tokens))
    return tokens, logprobs


def as_int64(value: int) -> int:
    """`value` modulo 2**64 as a signed 64-bit integer, the form the noise's int64 arithmetic takes (any
    Python int is a seed; those already in range are unchanged)."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def request_seed(seed: int, index: int) -> int:
    """A well-mixed 62-bit sampling seed for request `index` of a call seeded with `seed`.

    The seed is mixed before the index is added, so no two (seed, index) pairs of plausible size share
    a stream (a linear `seed * C + index` gave seed 1's request 0 the stream of seed 0's request C)."""
    mixed = splitmix64(torch.tensor([as_int64(seed)], dtype=torch.long))
    return int(splitmix64(mixed + as_int64(index))) & (2**62 - 1)


def stream_seed(seed: int, stream: int, index: int) -> int:
    """The seed of call `index` of a numbered `stream` of calls under one run seed (e.g. the evaluation
    at each iteration): independent of the run's other streams and of other run seeds' streams."""
    return request_seed(request_seed(seed, -1 - stream), index)
