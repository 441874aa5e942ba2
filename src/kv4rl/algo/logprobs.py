"""Per-token log-probabilities, entropy and the reference-KL penalties (k3, k1, k2, abs), computed from logits.

The LM head's logits `[B, T, V]` are the learner's largest activation (V ≈ 150k for Qwen3). A plain
`log_softmax(logits.float() / τ).gather(...)` materialises an fp32 `[B, T, V]` copy and autograd
keeps it (and the softmax) for backward. `token_logprobs` instead works on chunks of tokens and
saves only the logits it was given plus a `[B, T]` logsumexp; backward recomputes each chunk's
softmax. Peak extra memory is one fp32 chunk, whatever the sequence length.

Maths runs in fp32, or in the logits' dtype if that is wider (float64 in the tests).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Elements of fp32 work space per chunk (2**27 floats = 512 MiB).
CHUNK_ELEMENTS = 2**27


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _chunk_step(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is None:
        return max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens


def _chunks(batch: int, length: int, step: int) -> list[tuple[slice, slice]]:
    """(batch slice, token slice) blocks of at most `step` tokens that tile `[B, T]`.

    Indexing `[B, T, V]` by these gives views, so a sliced (non-contiguous) logits tensor is
    never copied whole.
    """
    if step >= length:
        rows = max(1, step // max(length, 1))
        return [(slice(b, b + rows), slice(None)) for b in range(0, batch, rows)]
    return [(slice(b, b + 1), slice(t, t + step)) for b in range(batch) for t in range(0, length, step)]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _checked_step(logits: Tensor, ids: Tensor, temperature: float, chunk_tokens: int | None) -> int:
    """Tokens per chunk, after refusing a temperature or shapes the heads cannot take."""
    _check_temperature(temperature)
    if logits.dim() != 3 or logits.shape[:-1] != ids.shape:
        raise ValueError(
            f"expected logits [B, T, V] and ids [B, T], got {tuple(logits.shape)} and {tuple(ids.shape)}"
        )
    return _chunk_step(logits.shape[-1], chunk_tokens)


def _logits_grad(logits_BTV: Tensor, ids_BT: Tensor, lse_BT: Tensor, ent_BT: Tensor | None, grad_logp_BT: Tensor | None,
                 grad_ent_BT: Tensor | None, temperature: float, step: int) -> Tensor:
    """The logits' gradient, one chunk at a time, of the log-probs at `ids` (`grad_logp`) and of the entropies
    (`grad_ent`; either may be None): ([v = id] − p_v)·g − p_v (log p_v + H)·g_H, over τ. A p_v of 0 (a −inf
    logit) adds nothing, where 0 · −inf would be NaN."""
    grad_logits = torch.empty_like(logits_BTV)
    for block in _chunks(*ids_BT.shape, step):
        log_p = logits_BTV[block].to(lse_BT.dtype) / temperature - lse_BT[block].unsqueeze(-1)
        p = log_p.exp()
        if grad_logp_BT is not None:
            g = grad_logp_BT[block].unsqueeze(-1).to(p.dtype)
            chunk_grad = (-g * p).scatter_add_(-1, ids_BT[block].unsqueeze(-1), g)
        else:
            chunk_grad = torch.zeros_like(p)
        if grad_ent_BT is not None:
            g_ent = grad_ent_BT[block].unsqueeze(-1).to(p.dtype)
            spread = torch.where(p > 0, p * (log_p + ent_BT[block].unsqueeze(-1)), torch.zeros_like(p))
            chunk_grad = chunk_grad - g_ent * spread
        grad_logits[block] = (chunk_grad / temperature).to(grad_logits.dtype)
    return grad_logits


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(logits/τ)[id] for `[B, T, V]` logits, chunked in both passes."""

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, ids_BT: Tensor, temperature: float, step: int) -> Tensor:
        dtype = _compute_dtype(logits_BTV)
        out_BT = torch.empty(ids_BT.shape, dtype=dtype, device=logits_BTV.device)
        lse_BT = torch.empty_like(out_BT)
        for block in _chunks(*ids_BT.shape, step):
            scaled = logits_BTV[block].to(dtype) / temperature
            lse_BT[block] = torch.logsumexp(scaled, dim=-1)
            out_BT[block] = scaled.gather(-1, ids_BT[block].unsqueeze(-1)).squeeze(-1) - lse_BT[block]
        ctx.save_for_backward(logits_BTV, ids_BT, lse_BT)
        ctx.temperature = temperature
        ctx.step = step
        return out_BT

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_BT: Tensor):
        logits_BTV, ids_BT, lse_BT = ctx.saved_tensors
        return _logits_grad(logits_BTV, ids_BT, lse_BT, None, grad_BT, None, ctx.temperature, ctx.step), None, None, None


def token_logprobs(
    logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None
) -> Tensor:
    """`log softmax(logits / τ)` at `ids`: logits `[B, T, V]`, ids `[B, T]` -> `[B, T]`.

    Differentiable w.r.t. `logits`. `chunk_tokens` caps how many tokens share one fp32 work
    chunk (default: about 512 MiB of fp32 per chunk).
    """
    step = _checked_step(logits, ids, temperature, chunk_tokens)
    return _SelectiveLogSoftmax.apply(logits, ids.long(), temperature, step)


class _LogprobsAndEntropy(torch.autograd.Function):
    """(log softmax(logits/τ)[id], entropy of softmax(logits/τ)), both differentiable, chunked in both passes.

    With x = logits/τ and log p = x − lse: ∂log p_id/∂x_v = [v = id] − p_v and ∂H/∂x_v = −p_v (log p_v + H);
    a p_v of 0 (a −inf logit) contributes 0 to both.
    """

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, ids_BT: Tensor, temperature: float, step: int):
        dtype = _compute_dtype(logits_BTV)
        out_BT = torch.empty(ids_BT.shape, dtype=dtype, device=logits_BTV.device)
        lse_BT, ent_BT = torch.empty_like(out_BT), torch.empty_like(out_BT)
        for block in _chunks(*ids_BT.shape, step):
            scaled = logits_BTV[block].to(dtype) / temperature
            lse_BT[block] = torch.logsumexp(scaled, dim=-1)
            log_p = scaled - lse_BT[block].unsqueeze(-1)
            out_BT[block] = log_p.gather(-1, ids_BT[block].unsqueeze(-1)).squeeze(-1)
            ent_BT[block] = -(log_p.exp() * log_p.clamp_min(torch.finfo(dtype).min)).sum(dim=-1)
        ctx.save_for_backward(logits_BTV, ids_BT, lse_BT, ent_BT)
        ctx.temperature, ctx.step = temperature, step
        ctx.set_materialize_grads(False)  # a None gradient (the entropy unused) costs nothing below
        return out_BT, ent_BT

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_BT: Tensor | None, grad_ent_BT: Tensor | None):
        logits_BTV, ids_BT, lse_BT, ent_BT = ctx.saved_tensors
        grad = _logits_grad(logits_BTV, ids_BT, lse_BT, ent_BT, grad_logp_BT, grad_ent_BT, ctx.temperature, ctx.step)
        return grad, None, None, None


def token_logprobs_and_entropy(
    logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` and the entropy of `softmax(logits / τ)`, both `[B, T]` and both differentiable
    w.r.t. `logits` (an entropy bonus, `algo.entropy_coeff`); memory as `token_logprobs`'."""
    step = _checked_step(logits, ids, temperature, chunk_tokens)
    return _LogprobsAndEntropy.apply(logits, ids.long(), temperature, step)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None) -> Tensor:
    """Entropy of `softmax(logits / τ)` per position: `[B, T, V]` -> `[B, T]`.

    Chunked over tokens so that, without grad (the usual logging case), only one fp32 chunk lives
    at a time. Differentiable through ordinary autograd.
    """
    _check_temperature(temperature)
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, T, V], got {tuple(logits.shape)}")
    batch, length, vocab = logits.shape
    entropy_BT = logits.new_empty((batch, length), dtype=_compute_dtype(logits))
    for block in _chunks(batch, length, _chunk_step(vocab, chunk_tokens)):
        log_p = torch.log_softmax(logits[block].to(entropy_BT.dtype) / temperature, dim=-1)
        # a -inf logit has p = 0 and log p = -inf: its term is 0, not NaN (the clamp moves nothing else)
        entropy_BT[block] = -(log_p.exp() * log_p.clamp_min(torch.finfo(log_p.dtype).min)).sum(dim=-1)
    return entropy_BT


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(π ‖ π_ref): `(ρ − 1) − log ρ`, `ρ = exp(ref_logp − logp)`.

    Non-negative, unbiased for the KL when tokens are sampled from π; gradients flow through both
    arguments (detach `ref_logp` at the call site, as usual).
    """
    log_rho = ref_logp - logp
    return torch.expm1(log_rho) - log_rho


# a log-ratio is held within ±LOG_RATIO_LIMIT before exp: e^88.7 overflows float32, and e^80 ≈ 5.5e34 is far past
# any clip, cap or bound
LOG_RATIO_LIMIT = 80.0

KLType = Literal["k3", "k1", "k2", "abs"]
KL_TYPES: tuple[str, ...] = get_args(KLType)


def ref_kl_terms(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token penalty of `algo.kl_ref_type` (verl's kl_loss_type), with `δ = logp − ref_logp`: `k3` (verl's
    low_var_kl: `k3_kl`), `k1` (kl: δ), `k2` (mse: δ²/2, whose gradient δ·∇logp is KL's unbiased one on-policy) or
    `abs` (|δ|). Gradients flow through both arguments, as in `k3_kl`."""
    if kind == "k3":
        return k3_kl(logp, ref_logp)
    delta = logp - ref_logp
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "abs":
        return delta.abs()
    raise ValueError(f"unknown reference-KL type {kind!r} (known: {', '.join(KL_TYPES)})")


SUM_PI_SQUARED_CHUNK_FLOATS = 2 ** 27  # 512 MiB of float32 a chunk of positions, as the log-prob head's


def sum_pi_squared(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`Σ_v softmax(logits / τ)_v²` per position, `[..., V] -> [...]` float32, no gradient: exp(lse(2x) − 2 lse(x)) with
    x = logits/τ (verl's calculate_sum_pi_squared_from_logits), what verl's optimal-token baseline reads; in chunks
    of positions, so that a 152k vocabulary's float32 copies stay within a fixed size."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = max(1, SUM_PI_SQUARED_CHUNK_FLOATS // max(flat.shape[-1], 1))
    for start in range(0, flat.shape[0], step):
        x = flat[start:start + step].float() / temperature
        out[start:start + step] = torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * torch.logsumexp(x, dim=-1))
    return out.reshape(logits.shape[:-1])
