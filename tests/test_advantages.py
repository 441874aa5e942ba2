"""GRPO advantages and the ±σ baseline perturbation against hand-worked values and binomial bounds."""

import math

import pytest
import torch

from kv4rl.algo import ADVANTAGES, AdvantageConfig, compute_advantages, grpo_advantages, perturb_baseline


def test_hand_worked_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    adv = grpo_advantages(rewards, group_size=4)
    std0 = math.sqrt((4 * 0.25) / 3)  # sample std of [1, 0, 0, 1]
    std1 = math.sqrt((9 + 1 + 1 + 9) / 3)  # of [2, 4, 6, 8], mean 5
    expected = [0.5 / (std0 + 1e-6) * s for s in (1, -1, -1, 1)]
    expected += [d / (std1 + 1e-6) for d in (-3, -1, 1, 3)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_the_whole_batchs_std_as_trls_scale_rewards_batch():
    """Group means, then one unbiased std over all eight rewards (mean 0.5, every deviation 0.5: var = 2/7); a
    flat group stays exactly zero; with normalize_std off the scope changes nothing."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                           dtype=torch.float64)
    cfg = AdvantageConfig(std_scope="batch")
    adv, _ = compute_advantages(rewards[:8], 4, cfg)
    std = math.sqrt(2 / 7)
    want = [d / (std + 1e-6) for d in (0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25)]
    assert adv.tolist() == pytest.approx(want, rel=1e-12)
    # one rank's share with the whole batch's rewards (torchrun): the std is the batch's, not the share's
    adv, _ = compute_advantages(rewards[:4], 4, cfg, batch_rewards=rewards[:8])
    assert adv.tolist() == pytest.approx(want[:4], rel=1e-12)
    adv, _ = compute_advantages(rewards, 4, cfg)
    assert adv[8:].tolist() == [0.0] * 8 and adv[0] == pytest.approx(0.75 / (float(rewards.std()) + 1e-6), rel=1e-12)
    off = AdvantageConfig(std_scope="batch", normalize_std=False)
    assert compute_advantages(rewards, 4, off)[0].tolist() == grpo_advantages(rewards, 4, normalize_std=False).tolist()
    with pytest.raises(ValueError, match="advantage.std_scope"):
        AdvantageConfig(std_scope="global").validate()


def test_without_std_normalisation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    adv = grpo_advantages(rewards, group_size=4, normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_equal_rewards_give_exact_zeros(normalize_std):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.0])  # 0.1·3/3 != 0.1 in floats
    adv = grpo_advantages(rewards, group_size=3, normalize_std=normalize_std)
    assert adv[:6].tolist() == [0.0] * 6
    assert adv[6:].abs().min() > 0.1


def test_group_of_one_and_integer_rewards():
    assert grpo_advantages(torch.tensor([3.0, -1.0]), group_size=1).tolist() == [0.0, 0.0]
    adv = grpo_advantages(torch.tensor([True, False]), group_size=2)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])


def test_rewards_on_a_large_offset_keep_their_advantages():
    """The group mean was taken in float32: 1e8 + 8 and 1e8 (both exact in float32) gave advantages
    [0, 1.22, 0, 1.22], not ±0.87, and the loop's float32 rewards rounded 3e7 + 1 to 3e7."""
    def reference(values, size):  # float64 by hand
        out = []
        for g in range(0, len(values), size):
            group = values[g:g + size]
            mean = sum(group) / size
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (size - 1))
            out += [(x - mean) / (std + 1e-6) for x in group]
        return out

    exact32 = [1e8, 1e8 + 8, 1e8, 1e8 + 8]
    adv = grpo_advantages(torch.tensor(exact32, dtype=torch.float32), group_size=4)
    assert adv.dtype == torch.float32 and adv.tolist() == pytest.approx(reference(exact32, 4), rel=1e-6)
    offset = [3e7 + 1, 3e7 + 2, 3e7 + 3, 3e7 + 4]
    adv = grpo_advantages(torch.tensor(offset, dtype=torch.float64), group_size=4)
    assert adv.dtype == torch.float64 and adv.tolist() == pytest.approx(reference(offset, 4), rel=1e-9)


def test_the_loop_scores_rewards_in_float64(tmp_path, monkeypatch):
    """A plug-in reward of 3e7 + 1 .. 3e7 + 4 a group: its mean and zero-mean advantages reach the metrics."""
    import json

    from kv4rl.config import load_config
    from kv4rl.loop import train
    from kv4rl.rewards import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    @base.register_reward("offset")
    def make():
        return lambda responses, golds: base.RewardResult([3e7 + 1 + i % 4 for i in range(len(responses))], {})

    cfg = load_config(overrides=["reward.name=offset", f"out_dir={tmp_path}", "name=r", "trainer.iterations=1",
                                 "rollout.quota_groups=1", "rollout.group_size=4", "rollout.max_slots=4"])
    train(cfg, show_progress=False)
    (row,) = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward_mean"] == 3e7 + 2.5
    assert abs(row["adv_mean"]) < 1e-12 and row["adv_absmax"] == pytest.approx(1.5 / math.sqrt(5 / 3), rel=1e-6)


@pytest.mark.parametrize(
    "rewards, group_size", [(torch.zeros(6), 4), (torch.zeros(2, 3), 3), (torch.zeros(0), 2)]
)
def test_bad_shapes(rewards, group_size):
    with pytest.raises(ValueError):
        grpo_advantages(rewards, group_size)


def test_perturbation_values_and_frequencies():
    num = 20_000
    adv = torch.linspace(-2, 2, num)
    sigma = 0.3
    out = perturb_baseline(adv, sigma, torch.Generator().manual_seed(0))
    plus = out == adv + sigma
    minus = out == adv - sigma
    assert bool((plus | minus).all())
    bound = 5 * math.sqrt(num * 0.25)
    assert abs(int(plus.sum()) - num / 2) < bound
    # independence per response: the sign of a response says nothing about its neighbour's
    agree = int((plus[1:] == plus[:-1]).sum())
    assert abs(agree - (num - 1) / 2) < 5 * math.sqrt((num - 1) * 0.25)
    again = perturb_baseline(adv, sigma, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_perturbation_rejects_misuse():
    with pytest.raises(ValueError, match="sigma"):
        perturb_baseline(torch.zeros(3), -1.0)
    with pytest.raises(ValueError, match="1-D"):
        perturb_baseline(torch.zeros(2, 3), 0.1)


def test_compute_advantages_metrics_and_noise():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    clean, metrics = compute_advantages(rewards, 2, AdvantageConfig())
    assert metrics["zero_var_group_frac"] == pytest.approx(0.5)  # groups 0 and 2 are flat
    torch.testing.assert_close(clean, grpo_advantages(rewards, 2))
    assert metrics["reward_mean"] == pytest.approx(4 / 8)
    assert metrics["adv_absmax"] == pytest.approx(float(clean.abs().max()))
    noisy, _ = compute_advantages(
        rewards, 2, AdvantageConfig(baseline_noise=0.5), torch.Generator().manual_seed(1)
    )
    assert sorted(set((noisy - clean).abs().tolist())) == [0.5]


def test_advantage_registry_and_config():
    assert "grpo" in ADVANTAGES
    AdvantageConfig(normalize_std=False, baseline_noise=0.2).validate()
    with pytest.raises(ValueError, match="advantage.baseline_noise"):
        AdvantageConfig(baseline_noise=-0.1).validate()
    with pytest.raises(ValueError, match="advantage.estimator"):
        AdvantageConfig(estimator="gae").validate()
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(torch.zeros(4), 2, AdvantageConfig(estimator="gae"))


def test_baseline_noise_of_a_group_is_the_same_on_any_rank_and_at_any_place_in_the_batch():
    """Each data-parallel rank drew its noise from one generator seeded by the iteration alone, so every rank
    drew the same signs and a 2-rank run trained differently from one process."""
    from kv4rl.algo.advantages import noise_key, perturb_baseline

    keys = [noise_key(0, 5, g) for g in range(4)]
    whole = perturb_baseline(torch.zeros(8), 0.5, group_keys=keys)  # one process: 4 groups of 2
    rank0 = perturb_baseline(torch.zeros(4), 0.5, group_keys=[keys[0], keys[2]])
    rank1 = perturb_baseline(torch.zeros(4), 0.5, group_keys=[keys[3], keys[1]])  # another order
    assert set(whole.tolist()) <= {-0.5, 0.5}
    by_group = whole.view(4, 2)
    assert torch.equal(rank0.view(2, 2), by_group[[0, 2]]) and torch.equal(rank1.view(2, 2), by_group[[3, 1]])
    assert not torch.equal(rank0, rank1)  # the ranks' draws differ (they were equal)
    many = perturb_baseline(torch.zeros(4000), 1.0, group_keys=[noise_key(0, 5, g) for g in range(2000)])
    assert abs(float(many.mean())) < 0.05  # fair signs


def test_rloo_is_the_leave_one_out_baseline_as_verl_writes_it():
    """Reference 1: each response's reward minus the mean of the others, by enumeration. Reference 2: verl's
    compute_rloo_outcome_advantage, r · n/(n−1) − mean · n/(n−1). A flat group and a group of one give 0."""
    from kv4rl.algo.advantages import compute_advantages, rloo_advantages
    from kv4rl.algo.config import AdvantageConfig

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.2, 0.9, 0.3])
    g = 4
    want = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g].double().tolist()
        flat = max(group) == min(group)
        want += [0.0 if flat else r - sum(group[:i] + group[i + 1:]) / (g - 1) for i, r in enumerate(group)]
    got = rloo_advantages(rewards, g)
    assert got.dtype == rewards.dtype
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-7)
    grouped = rewards.double().reshape(-1, g)
    verl = grouped * g / (g - 1) - grouped.mean(1, keepdim=True) * g / (g - 1)
    torch.testing.assert_close(got.double(), verl.reshape(-1), rtol=0, atol=1e-7)
    assert rloo_advantages(torch.tensor([0.3, 1.0]), 1).tolist() == [0.0, 0.0]
    # through the configured estimator: the same, with no std division whatever normalize_std says
    adv, metrics = compute_advantages(rewards, g, AdvantageConfig(estimator="rloo", normalize_std=True))
    torch.testing.assert_close(adv, got, rtol=0, atol=0)
    assert metrics["zero_var_group_frac"] == pytest.approx(1 / 3)


def _verl_reinforce_pp(scores: list[float], lengths: list[int], group_size: int, baseline: bool) -> list[list[float]]:
    """verl's reinforce_plus_plus(_baseline) outcome advantages written out on a token matrix in float64 (b178a3c):
    the score at the last valid token, the row's sum, the group mean off (baseline; a group of more than one),
    spread over the row's tokens (γ = 1: every return is the score), then masked_whiten over every valid token:
    mean, variance times N/(N−1), (v − mean) · rsqrt(var + 1e-8), masked."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    token_rewards = torch.zeros_like(mask)
    for i, n in enumerate(lengths):
        token_rewards[i, n - 1] = scores[i]
    s = token_rewards.sum(-1)
    if baseline:
        for start in range(0, len(scores), group_size):
            s[start:start + group_size] -= s[start:start + group_size].mean()
    values = s[:, None] * mask
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    whitened = (values - mean) * torch.rsqrt(var + 1e-8) * mask
    return [whitened[i, :k].tolist() for i, k in enumerate(lengths)]


def test_reinforce_pp_baseline_by_hand():
    """Groups [1, 0] (lengths 1, 3) and [1, 1] (2, 2): c = [0.5, -0.5, 0, 0] over 8 tokens, μ = -1/8, the
    unbiased token variance (0.625² + 3·0.375² + 4·0.125²) / 7 = 1/8, A = (c − μ) / sqrt(1/8 + 1e-8)."""
    from kv4rl.algo.advantages import reinforce_pp_advantages

    got = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, torch.tensor([1.0, 3.0, 2.0, 2.0]))
    sigma = math.sqrt(1 / 8 + 1e-8)
    assert got.tolist() == pytest.approx([0.625 / sigma, -0.375 / sigma, 0.125 / sigma, 0.125 / sigma], rel=1e-7)
    # without the baseline the rewards themselves are whitened: [1, 0, 1, 1] over 8 tokens, μ = 5/8
    raw = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, torch.tensor([1.0, 3.0, 2.0, 2.0]), False)
    var = (5 * (3 / 8) ** 2 + 3 * (5 / 8) ** 2) / 7
    assert raw.tolist() == pytest.approx([d / math.sqrt(var + 1e-8) for d in (3 / 8, -5 / 8, 3 / 8, 3 / 8)],
                                         rel=1e-7)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus_baseline", "reinforce_plus_plus"])
def test_reinforce_pp_equals_verls_token_formula(estimator):
    """Every token's advantage of verl's formula equals the response's advantage here, on random rewards and
    lengths with a flat group; one rank's share with the whole batch beside it gets the whole batch's slice."""
    gen = torch.Generator().manual_seed(7)
    g = 4
    scores = torch.rand(16, generator=gen, dtype=torch.float64)
    scores[4:8] = 0.25  # a flat group
    lengths = torch.randint(1, 40, (16,), generator=gen)
    baseline = estimator.endswith("baseline")
    want = _verl_reinforce_pp(scores.tolist(), lengths.tolist(), g, baseline)
    adv, metrics = compute_advantages(scores, g, AdvantageConfig(estimator=estimator), lengths=lengths)
    for i, tokens in enumerate(want):
        assert tokens == pytest.approx([float(adv[i])] * len(tokens), rel=1e-12, abs=1e-12)
    assert metrics["zero_var_group_frac"] == pytest.approx(1 / 4)
    assert float((adv * lengths).sum()) == pytest.approx(0.0, abs=1e-9)  # whitened over the tokens: mean 0
    share, _ = compute_advantages(scores[8:], g, AdvantageConfig(estimator=estimator), lengths=lengths[8:],
                                  batch_rewards=scores, batch_lengths=lengths)
    assert share.tolist() == pytest.approx(adv[8:].tolist(), rel=1e-12)
    own, _ = compute_advantages(scores[8:], g, AdvantageConfig(estimator=estimator), lengths=lengths[8:])
    assert own.tolist() != pytest.approx(share.tolist(), rel=1e-3)  # the share alone is whitened otherwise


def test_reinforce_pp_refuses_missing_or_bad_lengths():
    cfg = AdvantageConfig(estimator="reinforce_plus_plus_baseline")
    with pytest.raises(ValueError, match="weighs responses by their tokens"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, cfg)
    with pytest.raises(ValueError, match="one token count per response"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, cfg, lengths=torch.tensor([3.0]))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, cfg, lengths=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="batch_lengths go with batch_rewards"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, cfg, lengths=torch.tensor([1.0, 2.0]),
                           batch_rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    AdvantageConfig(estimator="reinforce_plus_plus").validate()
    with pytest.raises(ValueError, match="advantage.estimator"):
        AdvantageConfig(estimator="reinforce++").validate()


def test_which_settings_read_the_whole_batch():
    """Under torchrun the loop gathers every rank's rewards (and token counts) only for these."""
    from kv4rl.algo.advantages import needs_whole_batch

    assert needs_whole_batch(AdvantageConfig(std_scope="batch"))
    assert not needs_whole_batch(AdvantageConfig())
    assert not needs_whole_batch(AdvantageConfig(estimator="rloo", std_scope="batch"))
    assert needs_whole_batch(AdvantageConfig(estimator="reinforce_plus_plus"))
    assert needs_whole_batch(AdvantageConfig(estimator="reinforce_plus_plus_baseline"))
    assert needs_whole_batch(AdvantageConfig(estimator="gpg"))  # its scale counts every rank's rewarded responses
    assert not needs_whole_batch(AdvantageConfig(estimator="opo"))


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus_baseline", "reinforce_plus_plus"])
def test_reinforce_pp_gives_exact_zeros_when_the_batch_tells_nothing_apart(estimator):
    """Every reward 0.1 (0.1 x 3 / 3 != 0.1 in floats) over unequal lengths: exactly 0, so the run's "reward taught
    nothing" watch (adv_std == 0) still sees it."""
    adv, metrics = compute_advantages(torch.full((6,), 0.1, dtype=torch.float64), 3,
                                      AdvantageConfig(estimator=estimator), lengths=torch.tensor([3.0, 7, 1, 9, 2, 5]))
    assert adv.tolist() == [0.0] * 6 and metrics["adv_std"] == 0.0


def _verl_by_group(scores, group_size):
    """verl groups responses by uid with a dict of lists; here groups are contiguous."""
    return [list(range(s, s + group_size)) for s in range(0, len(scores), group_size)]


def test_opo_is_verls_length_weighted_baseline():
    """verl's compute_opo_outcome_advantage (b178a3c): each score minus its group's Σ L·r / Σ L; no std."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(12, generator=gen, dtype=torch.float64)
    scores[4:8] = 0.5  # flat
    lengths = torch.randint(1, 50, (12,), generator=gen)
    want = scores.clone()
    for idx in _verl_by_group(scores, 4):
        s, n = scores[idx], lengths[idx].double()
        want[idx] = s - (n * s).sum() / n.sum()
    adv, metrics = compute_advantages(scores, 4, AdvantageConfig(estimator="opo"), lengths=lengths)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    assert adv[4:8].tolist() == [0.0] * 4 and metrics["zero_var_group_frac"] == pytest.approx(1 / 3)
    # by hand: rewards 1, 0 with lengths 1, 3: baseline 1/4, advantages 3/4 and -1/4
    hand, _ = compute_advantages(torch.tensor([1.0, 0.0]), 2, AdvantageConfig(estimator="opo"), lengths=torch.tensor([1, 3]))
    assert hand.tolist() == [0.75, -0.25]
    with pytest.raises(ValueError, match="opo weighs a group's rewards by their tokens"):
        compute_advantages(scores, 4, AdvantageConfig(estimator="opo"))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_passk_is_verls(normalize_std):
    """verl's compute_grpo_passk_outcome_advantage: the group's best gets r_max − r_second (over std + 1e-6), the
    rest 0; a tie at the top gives 0 to all."""
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.2, 0.9, 0.4, 0.1], dtype=torch.float64)
    want = torch.zeros_like(scores)
    for idx in _verl_by_group(scores, 4):
        r = scores[idx]
        top, where = torch.topk(r, 2)
        lead = top[0] - top[1]
        want[idx[int(where[0])]] = lead / (torch.std(r) + 1e-6) if normalize_std else lead
    adv, _ = compute_advantages(scores, 4, AdvantageConfig(estimator="grpo_passk", normalize_std=normalize_std))
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    assert adv[4:8].tolist() == [0.0] * 4  # two at the top
    assert adv[9] == pytest.approx(0.5 / ((float(scores[8:].std()) + 1e-6) if normalize_std else 1.0))


def test_gpg_is_verls_and_counts_every_ranks_rewards():
    """verl's compute_gpg_outcome_advantage: α (r − group mean), α = batch size / non-zero scores in the batch."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    alpha = 8 / 3
    want = torch.cat([alpha * (scores[i:i + 4] - scores[i:i + 4].mean()) for i in (0, 4)])
    adv, _ = compute_advantages(scores, 4, AdvantageConfig(estimator="gpg"))
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    share, _ = compute_advantages(scores[4:], 4, AdvantageConfig(estimator="gpg"), batch_rewards=scores)
    torch.testing.assert_close(share, want[4:], rtol=0, atol=1e-15)  # α of the whole batch, not of the share (4/2)
    zero, _ = compute_advantages(torch.zeros(4, dtype=torch.float64), 2, AdvantageConfig(estimator="gpg"))
    assert zero.tolist() == [0.0] * 4


def _verl_reinforce_pp_returns(scores, kl, mask, coef):
    """verl's reinforce_plus_plus outcome advantage with use_kl_in_reward, written out in float64 (b178a3c): token
    rewards are the score on the last valid token less coef·kl on every valid one; returns run backwards with γ = 1,
    the running return reset at each masked position; then masked_whiten (variance × N/(N−1)) and × mask."""
    token_rewards = -coef * kl * mask
    for i in range(len(scores)):
        last = int(mask[i].nonzero().max())
        token_rewards[i, last] += scores[i]
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(len(scores), dtype=torch.float64)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + running
        returns[:, t] = running
        running = running * mask[:, t]
    n = mask.sum()
    mean = (returns * mask).sum() / n
    var = (((returns - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


def test_reinforce_pp_with_a_kl_reward_equals_verls_token_returns():
    """Per-token advantages against verl's formula on ragged rows with a prompt offset; in two shares whose sums go
    through `over_ranks`, each share's rows equal the one-batch result; without a KL it is the per-response
    estimator's advantage on every token."""
    from kv4rl.algo.advantages import reinforce_pp_advantages
    from kv4rl.algo.token_advantages import reinforce_pp_token_advantages

    gen = torch.Generator().manual_seed(3)
    rows, width = 8, 12
    starts = torch.randint(0, 4, (rows,), generator=gen)
    lengths = torch.randint(1, 8, (rows,), generator=gen)
    cols = torch.arange(width)[None]
    mask = ((cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])).double()
    kl = torch.randn(rows, width, generator=gen, dtype=torch.float64).abs() * 0.3
    scores = torch.randint(0, 2, (rows,), generator=gen).double()
    got = reinforce_pp_token_advantages(scores, kl, mask, 0.05)
    torch.testing.assert_close(got, _verl_reinforce_pp_returns(scores, kl, mask, 0.05), rtol=1e-12, atol=1e-12)
    halves = [slice(0, 5), slice(5, rows)]
    for share in halves:
        other = [h for h in halves if h != share][0]

        def total(x, other=other):
            if x.numel() == 2:  # (tokens, sum of returns): the other share's, from the one-batch returns
                tail = torch.where(mask[other].bool(), kl[other], 0).flip(-1).cumsum(-1).flip(-1)
                ret = torch.where(mask[other].bool(), scores[other][:, None] - 0.05 * tail, 0)
                return x + torch.stack([mask[other].sum(), ret.sum()])
            tail = torch.where(mask.bool(), kl, 0).flip(-1).cumsum(-1).flip(-1)
            ret = torch.where(mask.bool(), scores[:, None] - 0.05 * tail, 0)
            mean = ret.sum() / mask.sum()
            return x + torch.where(mask[other].bool(), (ret[other] - mean) ** 2, 0).sum().reshape(1)

        own = reinforce_pp_token_advantages(scores[share], kl[share], mask[share], 0.05, over_ranks=total)
        torch.testing.assert_close(own, got[share], rtol=1e-10, atol=1e-12)
    plain = reinforce_pp_token_advantages(scores, kl, mask, 0.0)
    per_response = reinforce_pp_advantages(scores, 2, lengths.double(), baseline=False)
    torch.testing.assert_close(plain, per_response[:, None] * mask, rtol=1e-12, atol=1e-12)
    assert reinforce_pp_token_advantages(torch.ones(rows), torch.zeros(rows, width), mask, 0.1).abs().sum() == 0
