"""`advantage.whiten` (AReaL's adv_norm with mean_level and std_level batch): the final advantages whitened over the
batch's response tokens, against AReaL's Normalization written out in float64 (AReaL 4aef98d: unbiased std, eps
1e-5 added to it), over ranks' shares as over one batch, through the learner's batch, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from kv4rl.algo.advantages import compute_advantages, grpo_advantages, whiten_over_tokens
from kv4rl.algo.config import AdvantageConfig
from kv4rl.config import ConfigError, load_config
from kv4rl.learner_batch import learner_batch


def areal_batch_norm(adv: list[float], lengths: list[int]) -> list[float]:
    """AReaL's Normalization(mean_level=batch, std_level=batch) of [B, T] advantages under the loss mask, a response's
    value on each of its tokens: (x − mean) / (std + 1e-5), std unbiased over the masked tokens."""
    tokens = [a for a, n in zip(adv, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1))
    return [(a - mean) / (std + 1e-5) for a in adv]


def _batch(seed: int, n: int = 12):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n,), generator=gen).double() + 0.1 * torch.rand(n, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, 40, (n,), generator=gen).double()
    return rewards, lengths


def test_whitening_equals_areals_batch_normalization():
    rewards, lengths = _batch(0)
    adv = grpo_advantages(rewards, 4, True)
    got = whiten_over_tokens(adv, lengths)
    want = torch.tensor(areal_batch_norm(adv.tolist(), [int(n) for n in lengths]), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weighted_mean = float((got * lengths).sum() / lengths.sum())
    assert abs(weighted_mean) < 1e-12 and abs(float(adv.mean())) < 1e-12  # GRPO's own mean is per response
    assert abs(float((adv * lengths).sum() / lengths.sum())) > 1e-3  # so whitening moved it: a real test


def test_ranks_shares_whiten_as_one_batch():
    """Two ranks' shares, each whitened with the other's sums added (the job's all-reduce), equal the whole batch."""
    rewards, lengths = _batch(1)
    adv = grpo_advantages(rewards, 4, True)
    whole = whiten_over_tokens(adv, lengths)
    shares = [(adv[:4], lengths[:4]), (adv[4:], lengths[4:])]

    def with_other(other_adv, other_len):
        calls = []

        def total(local):
            calls.append(local)
            if len(calls) == 1:  # (tokens, Σ w·A)
                return local + torch.stack([other_len.sum(), (other_len * other_adv).sum()])
            tokens = float(calls[0][0] + other_len.sum())
            mean = float(calls[0][1] + (other_len * other_adv).sum()) / tokens
            return local + (other_len * (other_adv - mean) ** 2).sum().reshape(1)
        return total

    got = torch.cat([whiten_over_tokens(shares[0][0], shares[0][1], with_other(*shares[1])),
                     whiten_over_tokens(shares[1][0], shares[1][1], with_other(*shares[0]))])
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def test_compute_advantages_whitens_after_the_estimator_and_the_learners_batch_carries_it():
    rewards, lengths = _batch(2, n=8)
    adv, metrics = compute_advantages(rewards, 4, AdvantageConfig(whiten=True), lengths=lengths)
    torch.testing.assert_close(adv, whiten_over_tokens(grpo_advantages(rewards, 4, True), lengths), rtol=0, atol=0)
    assert metrics["adv_mean"] == pytest.approx(float(adv.mean()))  # the logged advantages are the whitened ones
    cfg = load_config(None, ["advantage.whiten=true", "rollout.group_size=4"])
    responses = [[7] * int(n) for n in lengths]
    rows = ([[3, 4]] * 8, responses, [[-1.0] * len(r) for r in responses], [[0] * len(r) for r in responses])
    made = learner_batch(cfg, None, rows, rewards, 4, [0, 1], 0, 0, None)
    token_adv = made.batch.advantages[made.batch.response_mask.bool()]
    assert abs(float(token_adv.double().mean())) < 1e-6
    assert float(token_adv.double().std()) == pytest.approx(1.0, abs=1e-4)


def test_the_settings_it_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="whitens its advantages over the batch's tokens already"):
        load_config(None, ["advantage.whiten=true", "advantage.estimator=reinforce_plus_plus_baseline"])
    for setting in ("advantage.whiten=true", "advantage.estimator=reinforce_plus_plus", "advantage.baseline_noise=0.1"):
        with pytest.raises(ConfigError, match=f"but {setting.split('=')[0]}.* moves that 0 away, so no response"):
            load_config(None, [setting, "trainer.mask_zero_advantage=true"])


def areal_gae_without_critic(score: float, length: int, discount: float = 1.0, lam: float = 1.0) -> list[float]:
    """AReaL's `_compute_advantages` for one response without a critic (values 0) or KL (kl_ctl 0): the score on its
    last token, GAE backwards over the loss mask; a padded position after it."""
    width = length + 3
    rewards = [0.0] * width
    rewards[length - 1] = score
    mask = [1.0] * length + [0.0] * (width - length)
    out, last, next_value = [0.0] * width, 0.0, 0.0
    for t in reversed(range(width - 1)):
        delta = rewards[t] + discount * next_value - 0.0
        new = delta + discount * lam * last
        next_value = next_value * (1 - mask[t])
        last = last * (1 - mask[t]) + new * mask[t]
        out[t] = last
    return out[:length]


def test_raw_advantages_are_areals_without_reward_norm():
    """`advantage.estimator=raw`: AReaL without reward_norm (and no critic) gives every token its response's score;
    with `advantage.whiten` that is its adv_norm of them, which REINFORCE++'s whitening is not (eps apart)."""
    rewards, lengths = _batch(9)
    adv, metrics = compute_advantages(rewards, 4, AdvantageConfig(estimator="raw"), lengths=lengths)
    for a, r, n in zip(adv.tolist(), rewards.tolist(), lengths.int().tolist()):
        assert areal_gae_without_critic(r, n) == pytest.approx([a] * n, abs=1e-12)
    assert "zero_var_group_frac" in metrics and metrics["adv_mean"] == pytest.approx(float(rewards.mean()))
    whitened, _ = compute_advantages(rewards, 4, AdvantageConfig(estimator="raw", whiten=True), lengths=lengths)
    assert whitened.tolist() == pytest.approx(areal_batch_norm(rewards.tolist(), lengths.int().tolist()), abs=1e-12)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.reward_norm=null"])
    assert "advantage.estimator=raw" in str(info.value)
