"""`advantage.estimator=remax` (verl's remax, Li et al. 2023): each group also samples one greedy response, not
trained on, whose score is the group's baseline. The advantages against verl's `compute_remax_outcome_advantage`
written out in float64 (verl b178a3c), the collector's greedy response against the engine's own greedy generation
(synchronous and partial rollout), and a CPU training's advantages against its rewards and baselines."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from kv4rl.algo.advantages import compute_advantages
from kv4rl.algo.config import AdvantageConfig
from kv4rl.config import ConfigError, load_config
from kv4rl.data.source import ProblemSource
from kv4rl.engine.sequence import SamplingParams
from kv4rl.loop import train
from kv4rl.rewards.base import extract_boxed
from kv4rl.rewards.math import ExactReward
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig
from tests.test_rollout import IdsFormatter, make_engine


def verl_remax(token_level_rewards, reward_baselines, response_mask):
    """verl's compute_remax_outcome_advantage: the reverse cumulative sum of the token rewards, less the baseline."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask


def test_the_advantages_equal_verls_remax():
    """verl puts a response's score on its last token; every token's return is then the score, less the greedy
    response's score of its prompt. Three groups of four, lengths 1-7."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(12, generator=gen, dtype=torch.float64).round(decimals=1)
    baselines = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    lengths = torch.randint(1, 8, (12,), generator=gen)
    mask = (torch.arange(7)[None] < lengths[:, None]).double()
    token_rewards = torch.zeros(12, 7, dtype=torch.float64)
    token_rewards[torch.arange(12), lengths - 1] = scores
    want = verl_remax(token_rewards, baselines.repeat_interleave(4), mask)
    adv, metrics = compute_advantages(scores, 4, AdvantageConfig(estimator="remax"), baselines=baselines,
                                      lengths=lengths.double())
    torch.testing.assert_close(adv[:, None].expand(12, 7) * mask, want, rtol=0, atol=1e-15)
    assert metrics["remax/baseline_reward_mean"] == pytest.approx(0.5)
    assert metrics["adv_mean"] == pytest.approx(float(scores.mean()) - 0.5)
    with pytest.raises(ValueError, match="needs one greedy response's score per group \\(3\\), got None"):
        compute_advantages(scores, 4, AdvantageConfig(estimator="remax"))


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_each_group_brings_the_engines_greedy_response_to_its_prompt(tiny_qwen3, mode):
    """Groups of three sampled responses and one greedy (scripted lengths, so partial groups interleave): every
    delivered group has its three, and a baseline equal to a separate engine's greedy generation of its prompt."""
    path, _ = tiny_qwen3
    length = lambda g, j: 2 + (3 * g + 5 * j) % 7  # noqa: E731
    cfg = RolloutConfig(mode=mode, quota_groups=2, group_size=3, max_slots=6)
    col = Collector(make_engine(path, 6, num_blocks=80), ProblemSource(None, None, seed=0), IdsFormatter(), cfg,
                    seed=0, max_tokens_fn=length, greedy_baseline=True)
    reference = make_engine(path, 4)
    delivered = []
    for _ in range(3):
        for g in col.collect():
            delivered.append(g.index)
            assert len(g.completions) == 3 and g.baseline is not None
            assert [len(c.token_ids) for c in g.completions] == [length(g.index, j) for j in range(3)]
            (greedy,) = reference.generate([g.prompt_ids], SamplingParams(temperature=0.0, max_tokens=length(g.index, 3),
                                                                          ignore_eos=True))
            assert g.baseline.token_ids == greedy.token_ids
            assert any(c.token_ids != g.baseline.token_ids for c in g.completions)  # the others are sampled
    assert len(delivered) == len(set(delivered)) == 6
    plain = Collector(make_engine(path, 6, num_blocks=80), ProblemSource(None, None, seed=0), IdsFormatter(), cfg,
                      seed=0, max_tokens_fn=length)
    assert all(g.baseline is None for g in plain.collect())


def test_a_training_takes_each_groups_greedy_score_off_its_rewards(tmp_path, monkeypatch):
    """One CPU iteration of the embedded task: the logged advantages are the rewards less their group's greedy
    score (their mean is the rewards' less the baselines', every group having as many responses), and the learner
    trains the sampled responses only (its tokens are theirs)."""
    import kv4rl.learner_batch as learner_batch_module

    seen = {}
    original = learner_batch_module.compute_advantages

    def spy(rewards, group_size, cfg, **kwargs):
        seen.update(rewards=rewards.clone(), baselines=kwargs["baselines"].clone(), group_size=group_size)
        out = original(rewards, group_size, cfg, **kwargs)
        seen["adv"] = out[0].clone()
        return out

    monkeypatch.setattr(learner_batch_module, "compute_advantages", spy)
    loop_module = importlib.import_module("kv4rl.loop")
    real_scorer, real_baselines = loop_module.groups_scorer, loop_module.baseline_scores

    def scorer_spy(cfg, formatter, reward_fn):
        seen["tokenizer"] = formatter.tokenizer
        return real_scorer(cfg, formatter, reward_fn)

    def baselines_spy(groups, score):
        seen["groups"] = list(groups)
        return real_baselines(groups, score)

    monkeypatch.setattr(loop_module, "groups_scorer", scorer_spy)
    monkeypatch.setattr(loop_module, "baseline_scores", baselines_spy)
    cfg = load_config(None, ["advantage.estimator=remax", "trainer.iterations=1", "device=cpu", f"out_dir={tmp_path}",
                             "name=remax", "rollout.quota_groups=8", "rollout.group_size=4"])
    train(cfg, show_progress=False)
    (row,) = [json.loads(line) for line in (tmp_path / "remax" / "metrics.jsonl").read_text().splitlines()]
    assert len(seen["baselines"]) == 8 and seen["group_size"] == 4
    want = seen["rewards"] - seen["baselines"].repeat_interleave(4)
    torch.testing.assert_close(seen["adv"], want, rtol=0, atol=0)
    assert row["remax/baseline_reward_mean"] == pytest.approx(float(seen["baselines"].mean()))
    assert row["adv_mean"] == pytest.approx(row["reward_mean"] - row["remax/baseline_reward_mean"])
    assert row["num_tokens"] == pytest.approx(row["response_len_mean"] * 32)
    # each baseline is the exact-match score of its group's greedy response (the engine reports log-prob 0 for a
    # greedy token), decoded here
    texts = [seen["tokenizer"].decode(g.baseline.token_ids, skip_special_tokens=True) for g in seen["groups"]]
    want = ExactReward().score(texts, [g.problem.answer for g in seen["groups"]]).scores
    assert seen["baselines"].tolist() == want and 0 < sum(want) < 8
    # the greedy responses' own counts are logged apart from the trained ones' (a baseline that timed out to 0
    # showed nowhere)
    assert row["reward_baseline_no_answer"] == sum(extract_boxed(t) is None for t in texts) > 0
    assert all(set(g.baseline.logprobs) == {0.0} for g in seen["groups"])


def test_a_kl_in_the_reward_is_refused_and_verls_name_loads():
    with pytest.raises(ConfigError, match="advantage.estimator=remax with advantage.kl_reward_coef > 0"):
        load_config(None, ["advantage.estimator=remax", "advantage.kl_reward_coef=0.01"])
    assert load_config(None, ["advantage.estimator=remax"]).advantage.estimator == "remax"
