"""`reward.aggregation=normalize_then_sum`, TRL's GDPO (`multi_objective_aggregation: normalize_then_sum`): each
reward normalised within its group before the weighted sum. Against TRL's code written out in float64 (trl
grpo_trainer.py, `_generate_and_score_completions`, with its `nanstd`), a hand-worked pair, and a CPU training's
rewards against the exact-match scores and overlong penalties of its own responses."""

from __future__ import annotations

import importlib
import json
import logging
import math

import pytest
import torch

from kv4rl.algo.advantages import compute_advantages
from kv4rl.algo.config import AdvantageConfig
from kv4rl.config import ConfigError, load_config
from kv4rl.loop import train
from kv4rl.reward_config import RewardConfig
from kv4rl.rewards import WeightedRewards, get_reward, reward_metrics, score_responses
from kv4rl.rewards.base import Reward, RewardResult
from kv4rl.rewards.gdpo import normalize_then_sum


def trl_nanstd(x, dim=None, keepdim=False):
    """TRL's nanstd: the NaN-skipping std with Bessel's correction."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=keepdim)
    return torch.sqrt(variance * count / (count - 1))


def trl_gdpo(rewards_per_func, weights, num_generations, batch_eps):
    """TRL's normalize_then_sum branch: (summed rewards, advantages); TRL's batch step adds 1e-4 to the std,
    `batch_eps` here, so that kv4rl's 1e-6 can be compared exactly."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    return rewards, (rewards - torch.nanmean(rewards)) / (trl_nanstd(rewards) + batch_eps)


def test_the_summed_scores_and_advantages_equal_trls_gdpo():
    """Three rewards (0/1, a 0-5 score, a small-scale penalty) over 6 groups of 4, one group flat in every reward
    and others flat in some: TRL's sums, then kv4rl's grpo with the batch's std equals TRL's advantages."""
    gen = torch.Generator().manual_seed(3)
    correct = torch.randint(0, 2, (24,), generator=gen).double()
    quality = torch.randint(0, 6, (24,), generator=gen).double()
    penalty = -torch.rand(24, generator=gen, dtype=torch.float64) * 1e-2
    correct[:4], quality[:4], penalty[:4] = 1.0, 3.0, 0.0  # group 0: flat everywhere
    correct[4:8] = 0.0  # group 1: no correct answer
    weights = torch.tensor([1.0, 0.3, 2.0], dtype=torch.float64)
    sums = normalize_then_sum([(float(w), r.tolist()) for w, r in zip(weights, (correct, quality, penalty))], [4] * 6)
    want_sums, want_adv = trl_gdpo(torch.stack([correct, quality, penalty], dim=1), weights, 4, batch_eps=1e-6)
    torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), want_sums, rtol=0, atol=1e-12)
    assert sums[:4] == [0.0] * 4
    adv, _ = compute_advantages(torch.tensor(sums, dtype=torch.float64), 4,
                                AdvantageConfig(estimator="grpo", std_scope="batch"))
    torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-9)


def test_groups_of_other_sizes_are_normalised_each_on_its_own():
    """Ragged groups (a partial batch may hand several sizes through one call) and a group of one (no spread: 0)."""
    values = [0.0, 1.0, 1.0, 4.0, 2.0, 7.0]
    got = normalize_then_sum([(1.0, values)], [3, 2, 1])
    first = torch.tensor(values[:3], dtype=torch.float64)
    second = torch.tensor(values[3:5], dtype=torch.float64)
    want = [*((first - first.mean()) / (first.std() + 1e-4)).tolist(),
            *((second - second.mean()) / (second.std() + 1e-4)).tolist(), 0.0]
    assert got == pytest.approx(want, abs=1e-12)
    # two rewards of one weight that cancel (complementary 0/1 scores): a flat sum, exactly 0 as under `sum`
    # (rounding left 1e-16 in 59 of the 120 such splits of groups of 2-16, which filter_groups then kept)
    for size in range(2, 17):
        for ones in range(1, size):
            first = [1.0] * ones + [0.0] * (size - ones)
            assert normalize_then_sum([(1.0, first), (1.0, [1.0 - x for x in first])], [size]) == [0.0] * size
    with pytest.raises(ValueError, match="a reward has 5 scores for 6 responses"):
        normalize_then_sum([(1.0, values[:5])], [3, 2, 1])


class Length(Reward):
    """A second reward with a wide spread: the response's length in characters."""

    def score(self, responses, golds):
        return RewardResult([float(len(r)) for r in responses])


def test_a_hand_worked_pair_keeps_the_verifier_apart_from_a_wide_reward():
    """One group of two: right and long (exact 1, 17 characters), wrong and short (0, 9 characters), weights 2 and
    1. Summed first, the scores are 19 and 9, whose spread is mostly length; normalised first, the verifier gives
    ±0.5 / (√0.5 + 1e-4) and the length ±4 / (√32 + 1e-4), each reward's spread counting the same before its
    weight. The components stay as scored."""
    reward = WeightedRewards([("exact", get_reward("exact"), 2.0), ("length", Length(), 1.0)])
    texts, golds = ["\\boxed{7} so 7 it", "\\boxed{3}"], ["7", "7"]
    assert [len(t) for t in texts] == [17, 9]
    got = score_responses(reward, texts, golds, [5, 1], RewardConfig(aggregation="normalize_then_sum"), 16,
                          group_sizes=[2])
    z, length_z = 0.5 / (math.sqrt(0.5) + 1e-4), 4 / (math.sqrt(32) + 1e-4)
    assert got.scores == pytest.approx([2 * z + length_z, -2 * z - length_z], abs=1e-12)
    assert got.components == {"exact": [1.0, 0.0], "length": [17.0, 9.0]}  # as scored, for the logs and accuracy
    assert score_responses(reward, texts, golds, [5, 1], RewardConfig(), 16).scores == [19.0, 9.0]
    with pytest.raises(ValueError, match="pass group_sizes"):
        score_responses(reward, texts, golds, [5, 1], RewardConfig(aggregation="normalize_then_sum"), 16)


@pytest.mark.parametrize("factor", [1.0, 0.3])
def test_the_overlong_penalty_is_normalised_as_a_reward_weighted_by_its_factor(factor):
    """A single verifier and DAPO's penalty: lengths 6, 8 of a cap 8 with a buffer of 4 (−0.5 and −1 per unit of
    reward.overlong_penalty). Normalised, the factor would cancel: it weighs the normalised penalty instead, as
    TRL's reward_weights entry weighs its soft overlong punishment. `summed` is the plain sum, for the logs."""
    cfg = RewardConfig(aggregation="normalize_then_sum", overlong_buffer=4, overlong_penalty=factor)
    got = score_responses(get_reward("exact"), ["\\boxed{1}", "\\boxed{2}"], ["1", "1"], [6, 8], cfg, 8,
                          group_sizes=[2])
    z = 0.5 / (math.sqrt(0.5) + 1e-4)
    penalty_z = 0.25 / (math.sqrt(0.125) + 1e-4)  # −0.5 and −1: mean −0.75, unbiased std √0.125
    assert got.scores == pytest.approx([z + factor * penalty_z, -z - factor * penalty_z], abs=1e-12)
    assert got.components == {"exact": [1.0, 0.0], "overlong": [-0.5 * factor, -1.0 * factor]}
    assert got.summed == pytest.approx([1.0 - 0.5 * factor, -1.0 * factor], abs=1e-15)
    assert reward_metrics(got, "exact") == pytest.approx(
        {"reward_mean": (1.0 - 1.5 * factor) / 2, "reward_std": (1.0 + 0.5 * factor) / 2, "accuracy": 0.5,
         "rewards/exact/mean": 0.5, "rewards/overlong/mean": -0.75 * factor})


def test_a_training_trains_the_normalised_sums_of_its_own_responses(tmp_path, monkeypatch):
    """One CPU iteration of the embedded task with the overlong penalty: the rewards the estimator gets are TRL's
    GDPO sums of the exact-match scores and penalties of the responses the learner trains on, and accuracy is
    still the exact-match share."""
    learner_batch_module = importlib.import_module("kv4rl.learner_batch")
    loop_module = importlib.import_module("kv4rl.loop")
    seen = {}
    original, real_scorer, real_batch_reward = (learner_batch_module.compute_advantages, loop_module.groups_scorer,
                                                loop_module.batch_reward)

    def spy(rewards, group_size, cfg, **kwargs):
        seen.update(rewards=rewards.clone(), group_size=group_size)
        return original(rewards, group_size, cfg, **kwargs)

    def scorer_spy(cfg, formatter, reward_fn):
        seen["tokenizer"] = formatter.tokenizer
        return real_scorer(cfg, formatter, reward_fn)

    def batch_reward_spy(groups, score):
        seen["groups"] = list(groups)
        return real_batch_reward(groups, score)

    monkeypatch.setattr(learner_batch_module, "compute_advantages", spy)
    monkeypatch.setattr(loop_module, "groups_scorer", scorer_spy)
    monkeypatch.setattr(loop_module, "batch_reward", batch_reward_spy)
    cfg = load_config(None, ["reward.aggregation=normalize_then_sum", "advantage.std_scope=batch",
                             "reward.overlong_buffer=13", "trainer.iterations=1", "device=cpu", f"out_dir={tmp_path}",
                             "name=gdpo", "rollout.quota_groups=8", "rollout.group_size=4"])
    train(cfg, show_progress=False)
    (row,) = [json.loads(line) for line in (tmp_path / "gdpo" / "metrics.jsonl").read_text().splitlines()]
    groups = seen["groups"]
    completions = [c for g in groups for c in g.completions]
    assert seen["group_size"] == 4 and len(completions) == 32
    texts = [seen["tokenizer"].decode(c.token_ids, skip_special_tokens=True) for c in completions]
    correct = torch.tensor(get_reward("exact").score(texts, [g.problem.answer for g in groups for _ in g.completions])
                           .scores, dtype=torch.float64)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
    penalties = torch.clamp(-(lengths - (cfg.rollout.max_new_tokens - 13)) / 13, min=-1.0, max=0.0)
    assert bool((penalties < 0).any()) and 0 < float(correct.mean()) < 1  # both rewards carry a signal here
    want, _ = trl_gdpo(torch.stack([correct, penalties], dim=1), torch.ones(2, dtype=torch.float64), 4, batch_eps=1e-6)
    torch.testing.assert_close(seen["rewards"].double(), want, rtol=0, atol=1e-6)
    assert row["accuracy"] == pytest.approx(float(correct.mean()))
    assert row["rewards/overlong/mean"] == pytest.approx(float(penalties.mean()))
    # what is logged is the plain sum (the normalised one has mean 0 in every group), as TRL logs it
    plain = correct + penalties
    assert row["reward_mean"] == pytest.approx(float(plain.mean()))
    assert row["reward_std"] == pytest.approx(float(plain.std(correction=0)))
    assert float(seen["rewards"].double().mean()) == pytest.approx(0.0, abs=1e-9)


def test_a_rescaling_or_remax_is_refused_and_a_group_std_warns(caplog):
    with pytest.raises(ConfigError, match=r"undoes reward.scale=2.0; leave them at their defaults"):
        load_config(None, ["reward.aggregation=normalize_then_sum", "reward.scale=2"])
    with pytest.raises(ConfigError, match="advantage.estimator=remax: ReMax's baseline is the score of one greedy"):
        load_config(None, ["reward.aggregation=normalize_then_sum", "advantage.estimator=remax"])
    with caplog.at_level(logging.WARNING, logger="kv4rl.config"):
        load_config(None, ["reward.aggregation=normalize_then_sum"])
    assert "with advantage.std_scope=group divides each group's summed score" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv4rl.config"):
        load_config(None, ["reward.aggregation=normalize_then_sum", "advantage.estimator=grpo_passk"])
    assert "with advantage.estimator=grpo_passk divides each group's summed score" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv4rl.config"):
        load_config(None, ["reward.aggregation=normalize_then_sum", "advantage.std_scope=batch"])
    assert "GDPO" not in caplog.text
