"""`advantage.kl_reward_coef` (verl's use_kl_in_reward, TRL's RLOOTrainer's beta): each response's score less
β x the sum of its tokens' KL estimate to the reference, before the advantages. By hand, through the loop's
`reward_kl` (kv4rl.learner_batch) with a real learner, and the update reusing the log-probs it took."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv4rl.algo.advantages import compute_advantages
from kv4rl.algo.config import AdvantageConfig, AlgoConfig
from kv4rl.algo.kl_reward import kl_reward_penalty
from kv4rl.config import ConfigError, load_config
from kv4rl.learner_batch import reward_kl
from tests.test_learner_fsdp import make, ragged_batch


def test_the_penalty_by_hand_and_verls_order():
    """Row 0: log-ratios 0.5 and -0.25 (third token masked): k1 sum 0.25, x beta 0.4 = 0.1; row 1: k1 2.0 on its one
    token -> 0.8. verl's apply_kl_penalty puts -beta x kl on every token and its estimators sum the row: the GRPO
    advantages of the penalised scores."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.75, 9.0], [-2.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    penalty, metrics = kl_reward_penalty(old, ref, mask, 0.4, "k1")
    assert penalty.tolist() == pytest.approx([0.1, 0.8])
    assert metrics["kl_reward/token_mean"] == pytest.approx((0.25 / 2 + 2.0) / 2)  # verl's: row means, then their mean
    assert metrics["kl_reward/penalty_mean"] == pytest.approx(0.45)
    k3, _ = kl_reward_penalty(old, ref, mask, 1.0, "k3")  # e^-δ - 1 + δ summed
    want = sum(torch.expm1(-d) + d for d in torch.tensor([0.5, -0.25, 2.0], dtype=torch.float64))
    assert float(k3.sum()) == pytest.approx(float(want))
    scores = torch.tensor([1.0, 1.0], dtype=torch.float64)
    token_rewards = torch.zeros(2, 3, dtype=torch.float64)
    token_rewards[0, 1], token_rewards[1, 0] = 1.0, 1.0
    token_rewards = token_rewards - 0.4 * (old - ref).double() * mask
    adv, _ = compute_advantages(scores - penalty, 2, AdvantageConfig())
    verl, _ = compute_advantages(token_rewards.sum(-1), 2, AdvantageConfig())
    torch.testing.assert_close(adv, verl, rtol=0, atol=1e-12)
    assert adv[0] > 0 > adv[1]  # the same score: the response further from the reference is pushed down


@pytest.mark.parametrize("old_logprob", ["behavior", "recompute"])
def test_the_loop_takes_the_penalty_from_mu_or_the_recomputed_policy(tiny_qwen3, old_logprob):
    """The learner's policy is the reference at the start, so with recompute every KL is 0; with behavior, mu is
    set 0.1 below the policy's log-probs on every token: k1 = -0.1 per token. The update then reuses the log-probs
    taken (it would fail computing them again)."""
    path, _ = tiny_qwen3
    algo = AlgoConfig(old_logprob=old_logprob)
    learner = make(path, False, ref=path, algo=algo)
    batch = ragged_batch()
    batch.behavior_logprobs = (learner.logprobs(batch) - 0.1) * batch.response_mask
    cfg = SimpleNamespace(algo=algo, advantage=AdvantageConfig(kl_reward_coef=0.5))
    given, kl = reward_kl(cfg, learner, batch)
    penalty = kl_reward_penalty(given.get("old_logprobs", batch.behavior_logprobs), given["ref_logprobs"],
                                batch.response_mask, 0.5, "k1")[0]
    lengths = batch.response_mask.sum(-1).double()
    want = torch.zeros(4, dtype=torch.float64) if old_logprob == "recompute" else -0.05 * lengths
    torch.testing.assert_close(penalty, want, rtol=0, atol=1e-5)
    assert set(given) == ({"ref_logprobs", "old_logprobs"} if old_logprob == "recompute" else {"ref_logprobs"})

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the update took the log-probs again")

    learner._logprobs = no_second_pass
    # the second mini-batch's policy has taken one step: its KL to the reference is small, not 0
    assert 0 <= learner.step(batch, given=given)["kl_ref"] < 1e-2


def test_the_settings_are_checked():
    assert load_config(None, ["advantage.kl_reward_coef=0.001"]).advantage.kl_reward_type == "k1"
    with pytest.raises(ConfigError, match="advantage.kl_reward_coef must be >= 0"):
        load_config(None, ["advantage.kl_reward_coef=-1"])
    with pytest.raises(ConfigError, match="each token has its own \\(its return\\): set advantage.baseline_noise=0"):
        load_config(None, ["advantage.kl_reward_coef=0.01", "advantage.estimator=reinforce_plus_plus",
                           "advantage.baseline_noise=0.1"])
    with pytest.raises(ConfigError, match="each token has its own advantage \\(its return\\), so a response has no one "
                                          "sign: set algo.off_policy_mask=null"):
        load_config(None, ["advantage.kl_reward_coef=0.01", "advantage.estimator=reinforce_plus_plus",
                           "algo.off_policy_mask=0.5"])
    with pytest.raises(ConfigError, match="set trainer.ref_kl_every=1"):
        load_config(None, ["advantage.kl_reward_coef=0.01", "trainer.ref_kl_every=0"])
    with pytest.raises(ConfigError, match="advantage.kl_reward_type"):
        load_config(None, ["advantage.kl_reward_type=low_var_kl"])


def test_a_run_trains_on_the_penalised_scores(tmp_path, monkeypatch):
    """Two iterations with the learner's recomputed π_old: the trained reward's mean is the verifier's (accuracy)
    less the mean penalty, and the penalty grows once the policy has moved from the reference."""
    import json

    from kv4rl.loop import train

    monkeypatch.chdir(tmp_path)
    train(load_config(None, ["trainer.iterations=2", "rollout.quota_groups=4", "rollout.group_size=4",
                             "advantage.kl_reward_coef=0.5", "algo.old_logprob=recompute", "device=cpu"]),
          show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny-arith" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward_mean"] + row["kl_reward/penalty_mean"] == pytest.approx(row["accuracy"], abs=1e-9)
    assert rows[0]["kl_reward/token_mean"] == 0.0 < rows[1]["kl_reward/token_mean"]  # π_old is the reference at first


def test_a_loss_without_the_reference_is_refused_at_start():
    """The learner loads the reference only for a loss that reads reference log-probs: a plug-in loss without them
    and a KL reward failed after the first rollout; now the config is refused."""
    from kv4rl.algo.registry import LOSSES, register_loss

    @register_loss("kl_reward_test_pg", inputs={"behavior_logprobs"})
    def _pg(inp, cfg):
        return -(inp.advantages * inp.logprobs).sum(), {}

    try:  # the registry is the process's: the loss leaves it again (other tests list the registered losses)
        load_config(None, ["algo.loss=kl_reward_test_pg"])
        with pytest.raises(ConfigError, match="algo.loss=kl_reward_test_pg does not"):
            load_config(None, ["algo.loss=kl_reward_test_pg", "advantage.kl_reward_coef=0.1"])
    finally:
        del LOSSES["kl_reward_test_pg"]


def test_every_bad_value_is_said_at_once():
    """Value problems of several sections and of the run's own checks, one line each (a run heard of one a time);
    a key or type problem is said first, alone, since the values are read only once the keys parse."""
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["advantage.kl_reward_coef=-1", "trainer.ref_kl_every=-1", "rollout.group_size=0"])
    problems = bad.value.problems  # a fourth follows from group_size 0: no response for the optimizer steps
    assert [p.split(" must")[0] for p in problems] == ["rollout.group_size", "advantage.kl_reward_coef",
                                                       "trainer.updates_per_batch=1 optimizer steps need at least as "
                                                       "many responses in the learner batch (rollout.quota_groups x "
                                                       "rollout.group_size = 0)", "trainer.ref_kl_every"]
    with pytest.raises(ConfigError) as typed:
        load_config(None, ["advantage.estimator=bogus", "rollout.group_size=0"])
    assert len(typed.value.problems) == 1 and "advantage.estimator" in typed.value.problems[0]


def test_reinforce_pps_token_returns_reach_the_learner_batch(tiny_qwen3):
    """`advantage.estimator=reinforce_plus_plus` with a KL reward: `learner_batch` with a real learner puts on every
    response token verl's return advantage (tests.test_advantages' written-out formula over the tokens' k1 of the
    engine's μ against the reference), a truncated row's tokens among them though it trains none; the logged
    advantage statistics are over tokens and the trained reward is the score less the penalty."""
    from kv4rl.learner_batch import learner_batch
    from kv4rl.trainer.batch import build_batch
    from tests.test_advantages import _verl_reinforce_pp_returns

    path, _ = tiny_qwen3
    learner = make(path, False, ref=path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    behavior = [(-1.0 - torch.rand(len(r), generator=g)).tolist() for r in responses]
    rows = (prompts, responses, behavior, [[0] * len(r) for r in responses])
    cfg = load_config(None, ["advantage.estimator=reinforce_plus_plus", "advantage.kl_reward_coef=0.2"])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    made = learner_batch(cfg, learner, rows, scores, 2, [0, 1], 0, pad_id=0, truncated=[False, False, True, False])
    plain = build_batch(*rows, [0.0] * 4, pad_id=0)
    ref = learner.logprobs(plain, reference=True).double()
    kl = (plain.behavior_logprobs.double() - ref) * plain.response_mask.double()
    want = _verl_reinforce_pp_returns(scores, kl, plain.response_mask.double(), 0.2)
    torch.testing.assert_close(made.batch.advantages.double(), want, rtol=1e-5, atol=1e-6)
    assert made.batch.response_mask[2].sum() == 0 and made.batch.advantages[2].abs().sum() > 0  # truncated: trains none
    torch.testing.assert_close(made.rewards, scores - 0.2 * kl.sum(-1), rtol=1e-9, atol=1e-9)
    tokens = want[plain.response_mask.bool()]
    assert made.metrics["adv_mean"] == pytest.approx(float(tokens.mean()), abs=1e-6)
    assert made.metrics["adv_std"] == pytest.approx(float(tokens.std(correction=0)), rel=1e-5)
    assert set(made.given) == {"ref_logprobs"}


def test_a_reinforce_pp_run_with_a_kl_reward_trains(tmp_path, monkeypatch):
    """verl's REINFORCE++ example (adv_estimator=reinforce_plus_plus, use_kl_in_reward) was refused; it trains."""
    import json

    from kv4rl.loop import train

    monkeypatch.chdir(tmp_path)
    train(load_config(None, ["trainer.iterations=2", "rollout.quota_groups=4", "rollout.group_size=4",
                             "advantage.estimator=reinforce_plus_plus", "advantage.kl_reward_coef=0.5",
                             "device=cpu"]), show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny-arith" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["reward_mean"] + row["kl_reward/penalty_mean"] == pytest.approx(row["accuracy"], abs=1e-9)
        assert abs(row["adv_mean"]) < 1e-9 and row["adv_std"] == pytest.approx(1.0, rel=0.05)  # whitened tokens


def test_a_built_batch_given_its_advantages_equals_the_batch_built_with_them():
    """`with_advantages` (the KL reward's batch, built before the advantages) against `build_batch` of the same rows:
    per response and per token, with a masked (truncated) row."""
    from kv4rl.trainer.batch import build_batch, with_advantages

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 2, 5)]
    rows = (prompts, responses, [(-torch.rand(len(r), generator=g)).tolist() for r in responses],
            [[1] * len(r) for r in responses])
    masked = [False, True, False]
    per_response = torch.tensor([0.7, -1.3, 0.25], dtype=torch.float64)
    token = [torch.randn(len(r), generator=g) for r in responses]
    whole = build_batch(*rows, [0.0] * 3, pad_id=0)
    for given, listed in ((per_response, per_response.tolist()), (None, token)):
        if given is None:  # per token, in the batch's [B, L-1] layout
            given = torch.zeros_like(whole.advantages, dtype=torch.float64)
            for i, (p, r) in enumerate(zip(prompts, responses)):
                given[i, len(p) - 1: len(p) + len(r) - 1] = token[i].double()
        want, got = build_batch(*rows, listed, pad_id=0, masked=masked), with_advantages(whole, given, masked)
        for field in ("input_ids", "attention_mask", "response_mask", "behavior_logprobs", "advantages", "versions"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
