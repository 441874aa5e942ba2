"""`algo.behavior_is_normalize` (verl's rollout_is_batch_normalize): the behaviour weights divided by their mean over
the whole learner batch, over its tokens (`token_*`) or its responses (`sequence_*`), taken before any token is
rejected. Checked against verl's `compute_rollout_correction_weights` written out in float64 (verl b178a3c): the
loss of a batch split into micro-batches, a learner step's logged factor and its gradient (1/factor times the
unnormalised one), and the settings."""

from __future__ import annotations

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.config import ConfigError, load_config
from kv4rl.trainer.behavior_is_norm import batch_mean_weight
from kv4rl.trainer.learner import Learner
from tests.test_learner_fsdp import ragged_batch
from tests.test_surrogates import batch


def verl_weights(log_ratio, mask, level, threshold, normalize):
    """verl's compute_rollout_correction_weights (its rollout_is token / sequence, truncated at the threshold) and
    its batch normalisation: the token weights' mean over valid tokens, or the responses' weights' mean."""
    if level == "token":
        w = torch.exp(log_ratio.clamp(-20.0, 20.0))
    else:
        w = torch.exp((log_ratio * mask).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(log_ratio)
    w = (w * mask).clamp(max=threshold)
    if not normalize:
        return w, 1.0
    if level == "token":
        mean = (w * mask).sum() / mask.sum()
    else:
        rows = (mask.sum(-1) > 0).double()
        mean = ((w * mask).sum(-1) / mask.sum(-1).clamp(min=1) * rows).sum() / rows.sum()
    return (w / mean if mean > 1e-8 else w), float(mean)


def ppo_clip_token_mean(logp, old, adv, mask, w, eps=0.2):
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return -(surrogate * w * mask).sum() / mask.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_loss_over_micro_batches_equals_verls_normalised_weights(level):
    """Rows 0-2 and 3-5 as two micro-batches, each with the whole batch's mean weight: their summed losses and
    gradients equal verl's over the batch, and the weights' mean is 1 where verl's is (token level: over tokens)."""
    logp, old, sampling, adv, mask = batch(21)
    cfg = AlgoConfig(loss_agg="token_mean", old_logprob="recompute", behavior_is=f"{level}_truncate",
                     behavior_is_max=2.0, behavior_is_normalize=True)
    cfg.validate()
    whole = type("Batch", (), {"response_mask": mask, "behavior_logprobs": sampling})()
    norm = batch_mean_weight(whole, old, cfg.section("ppo_clip"), None, 1)
    w, mean = verl_weights(old - sampling, mask, level, 2.0, normalize=True)
    assert 0.3 < mean < 1.5 and abs(mean - 1) > 0.05 and float(norm[0, 0]) == pytest.approx(mean, rel=1e-12)
    loss = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 3), slice(3, 6)):
        part, metrics = get_loss("ppo_clip")(LossInputs(
            logprobs=logp[rows], advantages=adv[rows], mask=mask[rows].bool(), old_logprobs=old[rows],
            behavior_logprobs=sampling[rows], behavior_is_norm=norm[rows], num_tokens=float(mask.sum())), cfg)
        loss = loss + part
        assert metrics["behavior_is_norm_factor"] == pytest.approx(mean, rel=1e-12)
    want = ppo_clip_token_mean(logp, old, adv, mask, w)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(want, logp)[0],
                               rtol=1e-10, atol=1e-14)
    unnormalised, _ = verl_weights(old - sampling, mask, level, 2.0, normalize=False)
    assert abs(ppo_clip_token_mean(logp, old, adv, mask, unnormalised).item() - want.item()) > 1e-3
    if level == "token":
        assert float((w * mask).sum() / mask.sum()) == pytest.approx(1.0, rel=1e-12)


def test_a_batch_whose_weights_are_all_masked_is_left_unscaled():
    """verl leaves the weights as they are when their mean is <= 1e-8 (here every weight is outside the mask's
    bounds, so all are 0): the factor is 1, not a division by zero."""
    _, old, sampling, _, mask = batch(22)
    holder = type("Batch", (), {"response_mask": mask, "behavior_logprobs": sampling - 5.0})()
    s = AlgoConfig(old_logprob="recompute", behavior_is="token_mask", behavior_is_max=2.0,
                   behavior_is_normalize=True).section("ppo_clip")
    assert float(batch_mean_weight(holder, old, s, None, 1).unique()) == 1.0


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_a_learner_step_divides_its_gradient_by_verls_factor(tiny_qwen3, mode):
    """Two micro-batches of a ragged batch whose μ sits below π_old on every second response: the logged factor is
    verl's over the whole batch, and the gradient is the unnormalised step's divided by it."""
    path, _ = tiny_qwen3

    def learner(normalize):
        torch.manual_seed(0)
        return Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=1,
                       temperature=1.0, device=torch.device("cpu"), fsdp=False, micro_batch_size=2, max_new_tokens=6,
                       algo=AlgoConfig(old_logprob="recompute", behavior_is=mode, behavior_is_max=5.0,
                                       behavior_is_normalize=normalize))

    normalised, plain = learner(True), learner(False)
    data = ragged_batch(3)
    old = plain.logprobs(data).double()
    shift = torch.tensor([0.3 if i % 2 else -0.1 for i in range(len(old))], dtype=torch.float64)[:, None]
    data.behavior_logprobs = ((old - shift) * data.response_mask).to(data.behavior_logprobs.dtype)
    mask = data.response_mask.double()
    _, factor = verl_weights(old - data.behavior_logprobs.double(), mask, mode.split("_")[0], 5.0, normalize=True)
    assert abs(factor - 1) > 0.05
    got, base = normalised.step(data), plain.step(data)
    assert got["behavior_is_norm_factor"] == pytest.approx(factor, rel=1e-5)
    assert "behavior_is_norm_factor" not in base
    assert got["grad_norm"] == pytest.approx(base["grad_norm"] / factor, rel=1e-4)
    plain_grads = plain.named_grads()
    for name, grad in normalised.named_grads().items():
        torch.testing.assert_close(grad * factor, plain_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_the_setting_needs_weights_and_verls_key_points_here():
    with pytest.raises(ConfigError, match="algo.behavior_is=none weighs nothing: set algo.behavior_is"):
        load_config(None, ["algo.behavior_is_normalize=true"])
    cfg = load_config(None, ["algo.old_logprob=recompute", "algo.behavior_is=token_truncate",
                             "algo.behavior_is_normalize=true"])
    assert "behavior_is_norm" in get_loss("ppo_clip").inputs(cfg.algo)
    assert "behavior_is_norm" not in get_loss("ppo_clip").inputs(AlgoConfig(old_logprob="recompute",
                                                                            behavior_is="token_truncate"))
    with pytest.raises(ConfigError, match="rollout_is_batch_normalize is algo.behavior_is_normalize"):
        load_config(None, ["algorithm.rollout_correction.rollout_is_batch_normalize=true"])
