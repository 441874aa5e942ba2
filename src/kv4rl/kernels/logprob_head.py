"""The learner's log-prob head in two Triton passes over the logits: per-token log-prob and entropy
forward, the logits' gradient backward.

`kv4rl.algo.logprobs` (the reference) works on fp32 chunks of the `[B, T, V]` logits with torch ops,
each of which reads and writes a vocabulary-sized fp32 tensor: the cast, the division by τ, exp,
logsumexp's reductions, and in backward the cast, division, exp, product, scatter and cast back; the
entropy for logging takes another pass of six. At 16k tokens x 152k vocabulary one such op moves ~20 GB,
and in the profile of a fused 1.7B learner step (bench/results/2026-12-01-h200-profile-learner-1p7b-fused.json)
the four kernel kinds called once per vocabulary chunk (76 chunks a step) took ~260 of its 2,270 ms:
casts 87, fp32 division 75, exp 56, softmax 40 ms. Here
the forward reads each logit once (an online logsumexp that also accumulates Σ e^{x-m}(x-m) about the
running max m, so the entropy comes free) and the backward reads it once and writes its gradient once:

    x = logits / τ,  lse = log Σ_v e^{x_v},  logp = x_id - lse,  H = lse - Σ_v e^{x_v - lse} x_v,
    ∂logp/∂logits_v = ([v = id] - p_v) / τ,  ∂H/∂logits_v = -p_v (x_v - lse + H) / τ,  p_v = e^{x_v - lse}.

The entropy's gradient (an entropy bonus, `algo.entropy_coeff`) is taken only when the entropy reaches
the loss; logged alone it costs the backward nothing.

Maths in fp32; the gradient is written in the logits' dtype, as the reference writes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _forward_kernel(logits_ptr, stride_b, stride_t, ids_ptr, logp_ptr, lse_ptr, ent_ptr, length, vocab, inv_t,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b = row // length
    base = logits_ptr + b.to(tl.int64) * stride_b + (row - b * length).to(tl.int64) * stride_t
    lane = tl.arange(0, BLOCK)
    run_max = float("-inf")
    run_sum = 0.0  # Σ e^{x - run_max}
    run_dot = 0.0  # Σ e^{x - run_max} (x - run_max): shifted, so H = log run_sum - run_dot / run_sum keeps
    for start in range(0, vocab, BLOCK):  # its digits at any logit size (lse - Σ p x cancelled them)
        offs = start + lane
        live = offs < vocab
        x = tl.load(base + offs, mask=live, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        scale = tl.exp(run_max - new_max)
        e = tl.exp(x - new_max)
        shift = tl.where(run_sum > 0, (run_max - new_max) * run_sum, 0.0)  # re-centre the old terms
        run_dot = (run_dot + shift) * scale + tl.sum(tl.where(e > 0, e * (x - new_max), 0.0), axis=0)  # no 0 * -inf
        run_sum = run_sum * scale + tl.sum(e, axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    token = tl.load(ids_ptr + row)
    x_id = tl.load(base + token).to(tl.float32) * inv_t
    tl.store(logp_ptr + row, x_id - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(ent_ptr + row, tl.log(run_sum) - run_dot / run_sum)


@triton.jit
def _backward_kernel(logits_ptr, stride_b, stride_t, ids_ptr, lse_ptr, grad_out_ptr, ent_ptr, grad_ent_ptr, grad_ptr,
                     length, vocab, inv_t, BLOCK: tl.constexpr, HAS_ENT: tl.constexpr):
    row = tl.program_id(0)
    b = row // length
    base = logits_ptr + b.to(tl.int64) * stride_b + (row - b * length).to(tl.int64) * stride_t
    out = grad_ptr + row.to(tl.int64) * vocab  # the gradient is a fresh contiguous [B, T, V]
    lane = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_out_ptr + row).to(tl.float32)
    token = tl.load(ids_ptr + row)
    if HAS_ENT:
        g_ent = tl.load(grad_ent_ptr + row).to(tl.float32)
        h = tl.load(ent_ptr + row)
    for start in range(0, vocab, BLOCK):
        offs = start + lane
        live = offs < vocab
        x = tl.load(base + offs, mask=live, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(x - lse)
        grad = (tl.where(offs == token, 1.0, 0.0) - p) * g
        if HAS_ENT:  # p = 0 (a -inf logit) adds nothing, where 0 * -inf would be NaN
            grad -= g_ent * tl.where(p > 0, p * (x - lse + h), 0.0)
        grad = grad * inv_t
        tl.store(out + offs, grad.to(grad_ptr.dtype.element_ty), mask=live)


class FusedLogprobHead(torch.autograd.Function):
    """(log softmax(logits/τ)[ids], entropy of softmax(logits/τ)) for `[B, T, V]` logits (unit stride
    over V) and `[B, T]` ids; both differentiable."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temperature: float):
        batch, length, vocab = logits.shape
        rows = batch * length
        ids_flat = ids.reshape(-1).to(torch.int64).contiguous()
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse, ent = torch.empty_like(logp), torch.empty_like(logp)
        if rows:
            _forward_kernel[(rows,)](logits, logits.stride(0), logits.stride(1), ids_flat, logp, lse, ent, length,
                                     vocab, 1.0 / temperature, BLOCK=BLOCK_V)
        ctx.save_for_backward(logits, ids_flat, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # the entropy's gradient is None unless it reached the loss
        return logp.view(batch, length), ent.view(batch, length)

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):
        logits, ids_flat, lse, ent = ctx.saved_tensors
        batch, length, vocab = logits.shape
        grad = torch.empty((batch, length, vocab), dtype=logits.dtype, device=logits.device)
        if grad_logp is None:  # only the entropy reached the loss
            grad_logp = torch.zeros_like(lse)
        has_ent = grad_ent is not None
        if batch * length:
            _backward_kernel[(batch * length,)](logits, logits.stride(0), logits.stride(1), ids_flat, lse,
                                                grad_logp.contiguous(), ent,
                                                grad_ent.contiguous() if has_ent else ent, grad, length, vocab,
                                                1.0 / ctx.temperature, BLOCK=BLOCK_V, HAS_ENT=has_ent)
        return grad, None, None


def fused_token_logprobs(logits: torch.Tensor, ids: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies `[B, T]` of `logits / τ`, both differentiable."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3 or logits.shape[:-1] != ids.shape:
        raise ValueError(f"expected logits [B, T, V] and ids [B, T], got {tuple(logits.shape)} and {tuple(ids.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return FusedLogprobHead.apply(logits, ids, temperature)
