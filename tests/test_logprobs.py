"""Chunked log-probs and entropy against float64 references; their memory claim; k3."""

import pytest
import torch

from kv4rl.algo import entropy_from_logits, k3_kl, token_logprobs


def _reference_logprobs(logits, ids, temperature):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, ids[..., None]).squeeze(-1)


def _reference_entropy(logits, temperature):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def _logits(dtype=torch.float32, shape=(3, 11, 37), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(shape, generator=gen)).to(dtype)
    ids = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits, ids


@pytest.mark.parametrize("chunk_tokens", [None, 1, 4, 11, 25, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_match_float64(chunk_tokens, temperature):
    logits, ids = _logits()
    got = token_logprobs(logits, ids, temperature, chunk_tokens)
    assert got.dtype == torch.float32 and got.shape == ids.shape
    torch.testing.assert_close(got.double(), _reference_logprobs(logits, ids, temperature), rtol=0, atol=2e-5)


def test_bf16_logits_are_computed_in_fp32():
    logits, ids = _logits(torch.bfloat16)
    got = token_logprobs(logits, ids, 0.8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference_logprobs(logits, ids, 0.8), rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk_tokens", [None, 3, 7])
def test_gradient_matches_float64_autograd(chunk_tokens):
    logits, ids = _logits(torch.float64)
    weights = torch.randn(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    sliced = logits.requires_grad_()
    view = sliced[:, 1:-1]  # a non-contiguous slice, as a learner's shifted logits are
    ids_view = ids[:, 1:-1]
    (got,) = torch.autograd.grad(
        (token_logprobs(view, ids_view, 0.7, chunk_tokens) * weights[:, 1:-1]).sum(), sliced
    )
    (ref,) = torch.autograd.grad((_reference_logprobs(view, ids_view, 0.7) * weights[:, 1:-1]).sum(), sliced)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_bf16_gradient_has_the_logits_dtype():
    logits, ids = _logits(torch.bfloat16)
    logits.requires_grad_()
    token_logprobs(logits, ids).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().double().requires_grad_()
    _reference_logprobs(ref_logits, ids, 1.0).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=1e-2)


def test_backward_keeps_no_float32_copy_of_the_logits():
    logits, ids = _logits(torch.bfloat16, shape=(2, 64, 512))
    logits.requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(logits, ids, chunk_tokens=16)
    logits_bytes = logits.numel() * logits.element_size()
    assert sum(saved) <= logits_bytes + 16 * ids.numel()  # the logits themselves, ids and a [B, T] lse
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])
    assert sum(saved) >= 2 * logits_bytes  # what the plain version would have kept
    out.sum().backward()
    assert torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("chunk_tokens", [None, 2, 5])
def test_entropy_matches_float64(chunk_tokens):
    logits, _ = _logits()
    got = entropy_from_logits(logits, 0.9, chunk_tokens)
    torch.testing.assert_close(got.double(), _reference_entropy(logits, 0.9), rtol=0, atol=2e-5)
    uniform = entropy_from_logits(torch.zeros(1, 2, 8), 1.3)
    torch.testing.assert_close(uniform, torch.full((1, 2), torch.log(torch.tensor(8.0)).item()))


def test_entropy_gradient_matches_float64():
    logits, _ = _logits(torch.float64)
    logits.requires_grad_()
    (got,) = torch.autograd.grad(entropy_from_logits(logits, 0.9, 4).sum(), logits)
    (ref,) = torch.autograd.grad(_reference_entropy(logits, 0.9).sum(), logits)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_k3_by_hand_and_against_exact_kl():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -3.0], dtype=torch.float64)
    rho = (ref - logp).exp()
    torch.testing.assert_close(k3_kl(logp, ref), (rho - 1) - rho.log())
    assert k3_kl(logp, ref)[0] == 0 and (k3_kl(logp, ref) >= 0).all()
    # unbiased: E_{y~π}[k3] = KL(π‖π_ref) exactly when the expectation is taken over the vocabulary
    pi = torch.log_softmax(torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64), -1)
    pi_ref = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 0.2], dtype=torch.float64), -1)
    expected = (pi.exp() * (pi - pi_ref)).sum()
    torch.testing.assert_close((pi.exp() * k3_kl(pi, pi_ref)).sum(), expected)


def test_bad_arguments():
    logits, ids = _logits()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, 0.0)
    with pytest.raises(ValueError, match="ids"):
        token_logprobs(logits, ids[:, :-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        entropy_from_logits(logits, 1.0, 0)
