"""`advantage.kl_reward_control=adaptive` (verl's kl_ctrl.type: adaptive, Ziegler et al. 2019): β of the KL in the
reward moves after each batch by clip(KL / target − 1, ±0.2) · responses / horizon. By hand, through
`learner_batch` with a real learner, and over a run's logged rows, stopped and resumed."""

from __future__ import annotations

import json

import pytest
import torch

from kv4rl.algo.kl_reward import KLRewardCoef
from kv4rl.config import ConfigError, load_config
from tests.test_learner_fsdp import make


def _verl_step(value: float, kl: float, target: float, horizon: float, n: int) -> float:
    """verl's AdaptiveKLController.update written out: error clipped to ±0.2, then value · (1 + error · n / horizon)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return value * (1.0 + error * n / horizon)


def test_the_adaptive_update_by_hand():
    coef = KLRewardCoef(0.001, "adaptive", target=0.1, horizon=10000)
    coef.update(0.15, 256)  # KL / target − 1 = 0.5, held at 0.2: x (1 + 0.2 x 256 / 10000) = x 1.00512
    assert coef.value == pytest.approx(0.001 * 1.00512, rel=1e-14)
    coef.update(0.09, 256)  # −0.1: x (1 − 0.1 x 0.0256)
    assert coef.value == pytest.approx(0.001 * 1.00512 * 0.99744, rel=1e-14)
    coef.update(0.0, 1000)  # −1 held at −0.2: x 0.98
    assert coef.value == pytest.approx(0.001 * 1.00512 * 0.99744 * 0.98, rel=1e-14)
    fixed = KLRewardCoef(0.001)
    fixed.update(5.0, 256)
    assert fixed.value == 0.001


def test_a_checkpointed_coefficient_is_restored_only_into_an_adaptive_run():
    saved = KLRewardCoef(0.5, "adaptive")
    saved.update(1.0, 100)
    again = KLRewardCoef(0.5, "adaptive")
    again.load_state_dict(saved.state_dict())
    assert again.value == saved.value != 0.5
    fixed = KLRewardCoef(0.5)  # the config's β, when a resume turns the controller off
    fixed.load_state_dict(saved.state_dict())
    assert fixed.value == 0.5
    restarted = KLRewardCoef(0.5, "adaptive")  # a fixed run resumed as adaptive starts from the config's β
    restarted.load_state_dict(KLRewardCoef(0.3).state_dict())
    assert restarted.value == 0.5
    # kl_reward_coef changed at the resume: the run said "config.yaml takes them" and went on with the old β
    changed = KLRewardCoef(0.05, "adaptive")
    said = changed.load_state_dict(saved.state_dict())
    assert changed.value == 0.05 and said == ("advantage.kl_reward_coef changed at the resume (0.5 -> 0.05): the "
                                              f"adaptive β starts again from 0.05, not from the checkpoint's "
                                              f"{saved.value:.6g}")
    assert again.load_state_dict(saved.state_dict()) is None


def test_the_settings_are_checked():
    for overrides, said in [(["advantage.kl_reward_control=adaptive"], "starts from advantage.kl_reward_coef"),
                            (["advantage.kl_reward_control=adaptive", "advantage.kl_reward_coef=0.1",
                              "advantage.kl_reward_target=0"], "advantage.kl_reward_target must be > 0"),
                            (["advantage.kl_reward_control=adaptive", "advantage.kl_reward_coef=0.1",
                              "advantage.kl_reward_horizon=-5"], "advantage.kl_reward_horizon must be > 0"),
                            (["advantage.kl_reward_control=pid"], "advantage.kl_reward_control"),
                            (["advantage.kl_reward_target=-3"], "advantage.kl_reward_target must be > 0"),
                            # 8 responses over a horizon of 1: β x (1 - 0.2 x 8) went negative (0.1 -> -0.06)
                            (["advantage.kl_reward_control=adaptive", "advantage.kl_reward_coef=0.1",
                              "rollout.quota_groups=2", "rollout.group_size=4", "advantage.kl_reward_horizon=1"],
                             r"advantage.kl_reward_horizon=1 must exceed a fifth of the batch's 8 responses")]:
        with pytest.raises(ConfigError, match=said):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="advantage.kl_reward_control"):  # verl's key, pasted
        load_config(None, ["algorithm.kl_ctrl.type=adaptive"])


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_the_batch_is_penalised_with_beta_before_its_update(tiny_qwen3, estimator):
    """`learner_batch` with a real learner: the penalty is the β held before the batch (logged as
    `kl_reward/coef`), and β then moves by the batch's mean of each response's mean k1 (written out here from the
    learner's reference log-probs and the engine's μ) over its 4 responses."""
    from kv4rl.learner_batch import learner_batch
    from kv4rl.trainer.batch import build_batch

    path, _ = tiny_qwen3
    learner = make(path, False, ref=path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    behavior = [(-1.0 - torch.rand(len(r), generator=g)).tolist() for r in responses]
    rows = (prompts, responses, behavior, [[0] * len(r) for r in responses])
    cfg = load_config(None, [f"advantage.estimator={estimator}", "advantage.kl_reward_coef=0.2",
                             "advantage.kl_reward_control=adaptive", "advantage.kl_reward_target=0.05",
                             "advantage.kl_reward_horizon=10", "rollout.quota_groups=2", "rollout.group_size=2"])
    coef = KLRewardCoef.from_config(cfg.advantage)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    made = learner_batch(cfg, learner, rows, scores, 2, [0, 1], 0, pad_id=0, truncated=None, kl_coef=coef)
    plain = build_batch(*rows, [0.0] * 4, pad_id=0)
    ref = learner.logprobs(plain, reference=True).double()
    mask = plain.response_mask.double()
    kl = (plain.behavior_logprobs.double() - ref) * mask
    torch.testing.assert_close(made.rewards, scores - 0.2 * kl.sum(-1), rtol=1e-9, atol=1e-9)
    assert made.metrics["kl_reward/coef"] == 0.2
    mean_kl = sum(float(kl[i].sum() / mask[i].sum()) for i in range(4)) / 4
    assert abs(mean_kl / 0.05 - 1) > 0.01  # the update moves β
    beta = _verl_step(0.2, mean_kl, 0.05, 10, 4)
    assert coef.value == pytest.approx(beta, rel=1e-9)
    again = learner_batch(cfg, learner, rows, scores, 2, [0, 1], 1, pad_id=0, truncated=None, kl_coef=coef)
    torch.testing.assert_close(again.rewards, scores - beta * kl.sum(-1), rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_a_runs_coefficient_follows_its_rows_and_resumes(tmp_path, caplog):
    """Four iterations: each row's `kl_reward/coef` is the last row's moved by that row's logged mean KL over the
    batch's 8 responses; a run stopped after two and resumed logs the same four values (the checkpoint keeps β)."""
    from kv4rl.loop import train
    from kv4rl.run_folder import config_for_resume

    common = ["device=cpu", "rollout.quota_groups=2", "rollout.group_size=4", "trainer.lr=3e-3",
              "advantage.kl_reward_coef=0.5", "advantage.kl_reward_control=adaptive",
              "advantage.kl_reward_target=0.001", "advantage.kl_reward_horizon=20", "algo.old_logprob=recompute",
              "checkpoint.save_every=2", f"out_dir={tmp_path}"]
    full = load_config(overrides=[*common, "name=full", "trainer.iterations=4"])
    train(full, show_progress=False)
    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    coefs = [r["kl_reward/coef"] for r in rows]
    assert coefs[0] == 0.5
    for before, after in zip(rows, coefs[1:]):
        assert after == pytest.approx(_verl_step(before["kl_reward/coef"], before["kl_reward/token_mean"],
                                                 0.001, 20, 8), rel=1e-9)
    assert len(set(coefs)) > 1  # the policy moved from the reference, so β did

    part = load_config(overrides=[*common, "name=part", "trainer.iterations=2"])
    train(part, show_progress=False)
    train(config_for_resume(part.run_dir, ["trainer.iterations=4"]), resume=True, show_progress=False)
    resumed = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_reward/coef"] for r in resumed] == pytest.approx(coefs, rel=1e-12)

    # kl_reward_coef changed at the resume: β starts again from it, and the run says so
    other = load_config(overrides=[*common, "name=other", "trainer.iterations=2"])
    train(other, show_progress=False)
    with caplog.at_level("WARNING"):
        train(config_for_resume(other.run_dir, ["trainer.iterations=3", "advantage.kl_reward_coef=0.25"]),
              resume=True, show_progress=False)
    assert any("adaptive β starts again from 0.25" in m for m in caplog.messages)
    third = [json.loads(line) for line in (other.run_dir / "metrics.jsonl").read_text().splitlines()][2]
    assert third["kl_reward/coef"] == 0.25
