"""`advantage.estimator=optimal_token_baseline` (verl's): a baseline per token from the group's returns weighed by
each path's accumulated variance proxy. Against verl's `compute_optimal_token_baseline_advantage` written out in
float64 (verl b178a3c, without IS weights or the zero tail), Σπ² against the softmax itself, and a CPU training."""

from __future__ import annotations

import importlib
import json
from collections import defaultdict

import pytest
import torch

from kv4rl.algo.token_advantages import optimal_token_baseline
from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import sum_pi_squared
from kv4rl.config import ConfigError, load_config
from kv4rl.loop import train
from kv4rl.trainer.learner import Learner
from tests.test_learner_fsdp import ragged_batch


def verl_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_sq, epsilon=1e-8):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_cumulative = ((1 - 2 * torch.exp(old_log_probs) + sum_pi_sq) * response_mask).cumsum(dim=-1)
    groups = defaultdict(list)
    for i, key in enumerate(index):
        groups[key].append(i)
    baselines = torch.zeros_like(returns)
    for members in groups.values():
        if len(members) == 1:
            continue
        idx = torch.tensor(members)
        num = (returns[idx] * w_cumulative[idx] * response_mask[idx]).sum(dim=0)
        den = (w_cumulative[idx] * response_mask[idx]).sum(dim=0) + epsilon
        baselines[idx] = (num / den).unsqueeze(0).expand(len(members), -1)
    return (returns - baselines) * response_mask


@pytest.mark.parametrize("group_size", [1, 4])
def test_the_advantages_equal_verls(group_size):
    gen = torch.Generator().manual_seed(5)
    rows, width = 12, 9
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    scores = torch.randint(0, 2, (rows,), generator=gen).double() + 0.1 * torch.rand(rows, generator=gen, dtype=torch.float64)
    logits = torch.randn(rows, width, 7, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 7, (rows, width), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] * mask
    spsq = (torch.softmax(logits, -1) ** 2).sum(-1) * mask
    token_rewards = torch.zeros(rows, width, dtype=torch.float64)
    token_rewards[torch.arange(rows), lengths - 1] = scores
    want = verl_otb(token_rewards, mask, [i // group_size for i in range(rows)], logp, spsq)
    got = optimal_token_baseline(scores, logp, spsq, mask, group_size)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if group_size > 1:  # a baseline per step: not one value per response
        assert any(len(set(got[i, : int(lengths[i])].tolist())) > 1 for i in range(rows))


def test_sum_pi_squared_is_the_softmaxs_at_the_temperature(tiny_qwen3, monkeypatch):
    """verl's exp(lse(2x) − 2 lse(x)), and the learner's forward against the model's own logits."""
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    torch.testing.assert_close(sum_pi_squared(logits, 0.7).double(), (torch.softmax(logits / 0.7, -1) ** 2).sum(-1),
                               rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(importlib.import_module("kv4rl.algo.logprobs"), "SUM_PI_SQUARED_CHUNK_FLOATS", 22)
    torch.testing.assert_close(sum_pi_squared(logits, 0.7).double(), (torch.softmax(logits / 0.7, -1) ** 2).sum(-1),
                               rtol=1e-5, atol=1e-7)  # in chunks of 2 positions (11 floats each): the same values
    path, model = tiny_qwen3
    learner = Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0, updates_per_batch=1,
                      temperature=0.8, device=torch.device("cpu"), fsdp=False, micro_batch_size=2, max_new_tokens=6,
                      algo=AlgoConfig())
    batch = ragged_batch(2)
    logp, spsq = learner.logprobs_and_sum_pi_squared(batch)
    with torch.no_grad():
        own = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
    want = (torch.softmax(own / 0.8, -1) ** 2).sum(-1)
    valid = batch.response_mask.bool()
    torch.testing.assert_close(spsq[valid].double(), want[valid], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(logp[valid], learner.logprobs(batch)[valid], rtol=1e-4, atol=1e-5)
    packed = Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0, updates_per_batch=1,
                     temperature=0.8, device=torch.device("cpu"), fsdp=False, micro_batch_size=2, max_new_tokens=6,
                     algo=AlgoConfig(), max_tokens_per_micro_batch=40)  # the update's packed passes: the same values
    packed_logp, packed_spsq = packed.logprobs_and_sum_pi_squared(batch)
    torch.testing.assert_close(packed_spsq[valid], spsq[valid], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(packed_logp[valid], logp[valid], rtol=1e-4, atol=1e-5)


def test_a_training_trains_on_the_token_advantages(tmp_path, monkeypatch):
    """One CPU iteration: the learner's batch holds, on each response token, verl's advantage of the run's scores
    with the log-probs and Σπ² the learner computed (taken here from its call), the scores on each response's last
    token and the groups of 4 by verl's uid."""
    module = importlib.import_module("kv4rl.learner_batch")
    seen = {}
    real = module._optimal_token_baseline
    real_forward = Learner.logprobs_and_sum_pi_squared

    def forward_spy(self, batch):
        out = real_forward(self, batch)
        seen["forward"] = (batch, *out)
        return out

    def spy(cfg, learner, rows, scores, group_size, pad_id, truncated):
        made = real(cfg, learner, rows, scores, group_size, pad_id, truncated)
        seen.update(made=made, scores=scores.clone())
        return made

    monkeypatch.setattr(module, "_optimal_token_baseline", spy)
    monkeypatch.setattr(Learner, "logprobs_and_sum_pi_squared", forward_spy)
    cfg = load_config(None, ["advantage.estimator=optimal_token_baseline", "trainer.iterations=1", "device=cpu",
                             f"out_dir={tmp_path}", "name=otb", "rollout.quota_groups=6", "rollout.group_size=4"])
    train(cfg, show_progress=False)
    (row,) = [json.loads(line) for line in (tmp_path / "otb" / "metrics.jsonl").read_text().splitlines()]
    whole, logp, spsq = seen["forward"]
    valid = whole.response_mask.bool()
    # verl's layout: each response from its first token; the score on its last
    lengths = valid.sum(1)
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).double()
    aligned = lambda full: torch.zeros(mask.shape, dtype=torch.float64).masked_scatter(mask.bool(), full[valid].double())  # noqa: E731
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    rewards[torch.arange(len(lengths)), lengths - 1] = seen["scores"]
    want = verl_otb(rewards, mask, [i // 4 for i in range(len(lengths))], aligned(logp), aligned(spsq))
    got = aligned(seen["made"].batch.advantages)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert row["num_tokens"] == float(valid.sum()) and row["adv_absmax"] > 0
    assert any(len(set(got[i, : int(lengths[i])].tolist())) > 1 for i in range(len(lengths)))


def test_the_settings_it_cannot_take_are_refused():
    for setting, message in (("advantage.kl_reward_coef=0.01", "advantage.kl_reward_coef is not built for it"),
                             ("advantage.whiten=true", "advantage.whiten is not built for it"),
                             ("trainer.mask_zero_advantage=true", "an advantage per token"),
                             ("algo.behavior_is=token_truncate", "set algo.behavior_is=none")):
        overrides = ["advantage.estimator=optimal_token_baseline", setting]
        if "behavior_is" in setting:
            overrides.append("algo.old_logprob=recompute")
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="use rollout.placement=colocated"):
        load_config(None, ["advantage.estimator=optimal_token_baseline", "rollout.placement=split"])
