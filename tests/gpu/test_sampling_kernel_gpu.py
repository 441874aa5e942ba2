"""The fused Gumbel-max kernel on CUDA at Qwen3's vocabulary: the same noise, scores and tokens as the
torch sampler, bit for bit (the CPU tests can only check the hash exactly, their log is numpy's), and
log-probs from the kernel's own log-sum-exp within float32 rounding of float64."""

import pytest
import torch

from kv4rl.engine.sampler import sample, uniform_noise

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 151936


def _rows(b, gen):
    """Bf16-valued logits at assorted sharpness (as the model hands them over), random temperatures,
    seeds over the full 62-bit range and steps."""
    logits = (torch.randn(b, VOCAB, generator=gen) * torch.rand(b, 1, generator=gen).mul(6).add(1)).bfloat16()
    temp = torch.rand(b, generator=gen) + 0.4
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    steps = torch.randint(0, 2**20, (b,), generator=gen)
    rows = (logits, temp, torch.zeros(b, dtype=torch.long), torch.ones(b), seeds, steps)
    return tuple(t.cuda() for t in rows)


def test_scores_and_tokens_equal_torch_at_256_rows():
    from kv4rl.kernels.sampling import gumbel_scores

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    logits, temp, top_k, top_p, seeds, steps = _rows(256, gen)
    logprobs_all = (logits.float() / temp[:, None]).log_softmax(-1)
    ref_u = uniform_noise(seeds, steps, VOCAB)
    ref_scores = logprobs_all.double() + -torch.log(-torch.log(ref_u))
    tokens, u, scores = gumbel_scores(logprobs_all, seeds, steps)
    assert torch.equal(u, ref_u), f"{int((u != ref_u).sum())} uniforms differ"
    differ = scores != ref_scores
    assert not differ.any(), (
        f"{int(differ.sum())} scores differ, max |diff| {float((scores - ref_scores)[differ].abs().max()):.3g}")
    assert torch.equal(tokens, ref_scores.argmax(-1))
    del ref_u, ref_scores, u, scores
    want, want_lp = sample(logits, temp, top_k, top_p, seeds, steps)
    got, got_lp = sample(logits, temp, top_k, top_p, seeds, steps, fused=True)
    assert torch.equal(got, want)
    scaled = logits.float() / temp[:, None]
    ref = torch.log_softmax(scaled.double(), -1).gather(1, want[:, None]).squeeze(1)
    for lp in (got_lp, want_lp):  # the fused log-sum-exp and torch's log_softmax, each near float64
        assert ((lp.double() - ref).abs() <= 5e-6 + 2**-20 * ref.abs()).all()


@pytest.mark.parametrize("b", [1, 3, 64, 300])
def test_tokens_equal_torch_at_other_batch_sizes(b):
    """Small batches split each row over many programs, large ones over few."""
    gen = torch.Generator().manual_seed(b)
    rows = _rows(b, gen)
    for _ in range(3):
        want = sample(*rows)
        got = sample(*rows, fused=True)
        assert torch.equal(got[0], want[0]) and ((got[1] - want[1]).abs() <= 4e-6 * (1 + want[1].abs())).all()
        rows = rows[:5] + (rows[5] + 1,)
