"""Sampler: reported log-probs are the log-probs of the distribution actually sampled."""

import math

import torch

from kv4rl.engine.sampler import sample


def test_logprobs_equal_log_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.randn(64, 11) * 3
    temp = torch.rand(64) * 1.5 + 0.3
    tokens, lp = sample(logits, temp, torch.zeros(64, dtype=torch.long), torch.ones(64))
    ref = torch.log_softmax(logits.double() / temp.double()[:, None], -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)


def test_greedy_rows_take_argmax_and_report_zero():
    logits = torch.randn(5, 7)
    tokens, lp = sample(logits, torch.zeros(5), torch.zeros(5, dtype=torch.long), torch.ones(5))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.all(lp == 0)


def test_top_k_samples_only_top_k_and_renormalises():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(1)
    k = torch.full((2000,), 2, dtype=torch.long)
    tokens, lp = sample(logits, torch.ones(2000), k, torch.ones(2000), g)
    assert set(tokens.tolist()) <= {3, 4}
    p4 = math.exp(4) / (math.exp(3) + math.exp(4))
    want = torch.where(tokens == 4, torch.tensor(math.log(p4)), torch.tensor(math.log(1 - p4)))
    assert torch.allclose(lp, want.float(), atol=1e-5)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    g = torch.Generator().manual_seed(2)
    tokens, lp = sample(logits, torch.ones(4000), torch.zeros(4000, dtype=torch.long), torch.full((4000,), 0.7), g)
    # 0.5 < 0.7 so token 1 is needed; 0.5 + 0.3 >= 0.7 so tokens 2, 3 are dropped
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(lp[tokens == 0], torch.tensor(math.log(0.5 / 0.8)), atol=1e-5)
    frac0 = (tokens == 0).float().mean().item()
    assert abs(frac0 - 0.625) < 4 * math.sqrt(0.625 * 0.375 / 4000)


def test_seeded_generator_is_reproducible():
    logits = torch.randn(32, 50)
    args = (torch.ones(32), torch.zeros(32, dtype=torch.long), torch.ones(32))
    a = sample(logits, *args, torch.Generator().manual_seed(5))
    b = sample(logits, *args, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])
