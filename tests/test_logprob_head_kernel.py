"""The learner's fused log-prob head (`kv4rl.kernels.logprob_head`) against the float64 torch reference
(`kv4rl.algo.logprobs`): log-probs, entropies and the logits' gradient, on fresh random inputs.

On the CPU the kernels run in Triton's interpreter on small shapes (several vocabulary blocks and a
ragged last one, a logits view that skips a position as the learner's `[:, :-1]` does); on a CUDA
machine at the Qwen3 vocabulary with bf16 logits."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.algo.logprobs import entropy_from_logits, token_logprobs, token_logprobs_and_entropy  # noqa: E402
from kv4rl.kernels.logprob_head import BLOCK_V, fused_token_logprobs  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (batch, positions, vocab): on the CPU three vocabulary blocks, the last one ragged, and exactly one
SHAPES = [(1, 257, 151936), (3, 40, 2 * BLOCK_V + 3)] if CUDA else [(2, 6, 2 * BLOCK_V + 3), (1, 3, BLOCK_V)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_gradient_match_float64(shape, temperature, gen):
    batch, length, vocab = shape
    dtype = torch.bfloat16 if CUDA else torch.float32
    full = (3.0 * torch.randn(batch, length + 1, vocab, generator=gen)).to(dtype)
    full[0, 0, 5] = 40.0  # one peaked row: the online max must rescale what came before
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[0, 0] = vocab - 1  # a token in the ragged last block
    weights = torch.randn(batch, length, generator=gen)

    logits = full.to(DEVICE, copy=True).requires_grad_(True)
    view = logits[:, :-1]  # a view with the learner's strides
    logp, ent = fused_token_logprobs(view, ids.to(DEVICE), temperature)
    (logp * weights.to(DEVICE)).sum().backward()

    ref_logits = full.double().requires_grad_(True)
    ref_view = ref_logits[:, :-1]
    ref_logp = token_logprobs(ref_view, ids, temperature)
    (ref_logp * weights.double()).sum().backward()
    ref_ent = entropy_from_logits(ref_view.detach(), temperature)

    # fp32 maths on both devices; on the GPU the inputs are the same bf16 values, so only summation
    # order and exp/log differ (1e-4 of a ~12-nat log-prob); the gradient is rounded to bf16 there
    tol = 2e-4 if CUDA else 2e-5
    torch.testing.assert_close(logp.double().cpu(), ref_logp.detach(), rtol=0, atol=tol * 10)
    torch.testing.assert_close(ent.double().cpu(), ref_ent, rtol=0, atol=tol * 10)
    grad, ref_grad = logits.grad.double().cpu(), ref_logits.grad
    assert grad[:, -1].abs().max() == 0  # the position the view skips gets no gradient
    g_tol = 2 ** -8 if CUDA else 1e-6
    torch.testing.assert_close(grad, ref_grad, rtol=g_tol, atol=g_tol * ref_grad.abs().max().item())
    assert ent.requires_grad and logp.requires_grad  # the entropy unused: no gradient of its own was taken


@pytest.mark.parametrize("use", ["both", "entropy"])
def test_the_entropy_gradient_matches_float64(use, gen):
    """An entropy bonus (`algo.entropy_coeff`) backpropagates through the entropy too: the logits' gradient of
    Σ w·logp + Σ u·H against the float64 reference, a -inf logit included (its gradient 0, never NaN)."""
    batch, length, vocab = SHAPES[-1]
    dtype = torch.bfloat16 if CUDA else torch.float32
    full = (3.0 * torch.randn(batch, length + 1, vocab, generator=gen)).to(dtype)
    full[0, 0, 3] = float("-inf")
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[0, 0] = 4
    w_logp, w_ent = torch.randn(batch, length, generator=gen), torch.randn(batch, length, generator=gen)

    def weighted(logp, ent, dev):
        terms = (ent * w_ent.to(dev, ent.dtype)).sum()
        return terms + (logp * w_logp.to(dev, logp.dtype)).sum() if use == "both" else terms

    logits = full.to(DEVICE, copy=True).requires_grad_(True)
    weighted(*fused_token_logprobs(logits[:, :-1], ids.to(DEVICE), 0.7), DEVICE).backward()
    ref_logits = full.double().requires_grad_(True)
    weighted(*token_logprobs_and_entropy(ref_logits[:, :-1], ids, 0.7), "cpu").backward()

    grad, ref_grad = logits.grad.double().cpu(), ref_logits.grad
    assert torch.isfinite(grad).all() and grad[0, 0, 3] == 0 and grad[:, -1].abs().max() == 0
    # the entropy's term p (x - lse + H) sums ~20-nat numbers in fp32: up to 2.1e-6 of the largest gradient (2 of
    # 25 seeds passed 1e-6, the log-prob's tolerance; 50 seeds all within 5e-6)
    g_tol = 2 ** -8 if CUDA else 5e-6
    torch.testing.assert_close(grad, ref_grad, rtol=g_tol, atol=g_tol * ref_grad.abs().max().item())


def test_bad_arguments_are_refused_by_name():
    logits = torch.zeros(1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fused_token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long, device=DEVICE), 0.0)
    with pytest.raises(ValueError, match=r"expected logits \[B, T, V\] and ids \[B, T\]"):
        fused_token_logprobs(logits, torch.zeros(1, 3, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("offset", [30.0, 1000.0, 10000.0])
def test_entropy_keeps_its_digits_when_the_logits_are_large(offset, gen):
    """H was lse - Σ p x in fp32: two numbers near the logits' size whose difference is a few nats lost
    ~1e-5 at logits ~100 and 3e-3 at 1e4. Reference: float64 on the same fp32 logits / τ the kernel forms
    (at 1e4 / 0.6 the fp32 division alone moves a logit by 1e-3)."""
    vocab = 2 * BLOCK_V + 3
    logits = (offset + 3.0 * torch.randn(2, 3, vocab, generator=gen)).float()
    logits[0, 0, -1] += 10.0  # the peak in the last block: the running max moves late
    ids = torch.randint(0, vocab, (2, 3), generator=gen)
    _, ent = fused_token_logprobs(logits.to(DEVICE), ids.to(DEVICE), 0.6)
    scaled = logits * torch.tensor(1 / 0.6, dtype=torch.float32)  # as the kernel scales, in fp32
    ref = entropy_from_logits(scaled.double(), 1.0)
    # on a GPU the scaling may fuse into the subtraction of the max (an FMA), so the kernel works from
    # logits/τ unrounded: within the fp32 rounding of the scaled logits of that reference
    tol = 5e-6 + (4 * (offset / 0.6 + 40) * 2**-24 if CUDA else 0)
    torch.testing.assert_close(ent.double().cpu(), ref, rtol=0, atol=tol)


def test_a_minus_infinity_logit_leaves_the_entropy_finite(gen):
    """A masked (-inf) logit made p log p = 0 * -inf: NaN entropy in both heads."""
    vocab = BLOCK_V + 5
    logits = torch.randn(1, 2, vocab, generator=gen)
    logits[0, 0, 7] = logits[0, 1, BLOCK_V + 2] = float("-inf")  # in the first block and in the ragged last
    _, ent = fused_token_logprobs(logits.to(DEVICE), torch.tensor([[1, 3]], device=DEVICE), 1.0)
    p = torch.softmax(logits.double(), -1)
    want = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(ent.double().cpu(), want, rtol=0, atol=5e-6)
    torch.testing.assert_close(entropy_from_logits(logits.double()), want, rtol=0, atol=1e-12)
