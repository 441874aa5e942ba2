"""The engine–learner gap corrections of `ppo_clip`: `algo.behavior_is` (TRL's vllm_importance_sampling_correction,
AReaL's decoupled PPO), each token's surrogate weighed by π_old/μ, truncated or masked; and `algo.off_policy_mask`
(DeepSeek-V3.2, TRL's off_policy_mask_threshold). The loss against TRL's `_compute_loss` written out in float64
(TRL f2cd577), and a learner step's logged weights against the learner's own recomputed log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.off_policy import behavior_importance_weights, off_policy_keep
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.config import load_config
from kv4rl.trainer.learner import Learner
from tests.test_learner_fsdp import ragged_batch

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio: exp of (old − sampling)·mask per token, or of its sum per sequence
    ([B, 1]); clamped to [clip_min, clip_max] (truncate) or set to 0 outside (mask; a null bound is ±inf)."""
    diff = (old - sampling) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_loss(logp, old, sampling, adv, mask, mode, clip_min, clip_max, eps, agg):
    """TRL's per-token clipped surrogate times the IS ratio; `grpo` (mean over rows of each row's token mean) or
    `bnpo` (token mean) aggregation."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) * trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max)
    if agg == "seq_mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.7, 1.4), (0.9, None)])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_the_loss_equals_trls_with_its_importance_sampling_correction(mode, bounds, agg):
    gen = torch.Generator().manual_seed(11)
    rows, width = 6, 9
    lengths = torch.tensor([9, 4, 7, 1, 6, 2])
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    sampling = -3 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    old = sampling + 0.35 * torch.randn(rows, width, generator=gen, dtype=torch.float64)  # engine vs learner
    logp = (old + 0.15 * torch.randn(rows, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).clone()
    low, high = bounds
    cfg = AlgoConfig(loss_agg=agg, old_logprob="recompute", behavior_is=mode, behavior_is_min=low,
                     behavior_is_max=high, eps_low=0.2, eps_high=0.2)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    want = trl_loss(logp, old, sampling, adv, mask, mode, low, high, 0.2, agg)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    ratio = trl_is_ratio(old, sampling, mask, mode, low, high).expand(rows, width)
    assert metrics["behavior_is_mean"] == pytest.approx(float((ratio * mask).sum() / mask.sum()), rel=1e-12)
    assert metrics["behavior_is_max"] == pytest.approx(float(ratio[mask.bool()].max()), rel=1e-12)
    # the weights change the loss: without them it is TRL's without the correction
    plain, _ = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old),
                                    AlgoConfig(loss_agg=agg, old_logprob="recompute"))
    assert abs(plain.item() - loss.item()) > 1e-4


def test_weights_by_hand_and_the_cut_tokens():
    """One row, log-ratios 0.5, -1.0, 2.0 (third masked out): token weights e^.5, e^-1; truncated to [0.5, 1.5]:
    1.5, 0.5; masked outside it: 0, 0 (both cut). Sequence: e^-0.5 for both tokens, inside the bounds."""
    old, behavior = torch.tensor([[0.5, -1.0, 2.0]]), torch.zeros(1, 3)
    valid = torch.tensor([[True, True, False]])
    w, cut = behavior_importance_weights(old, behavior, valid, "token_truncate", None, None)
    assert w[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 0.0]) and not cut.any()
    w, cut = behavior_importance_weights(old, behavior, valid, "token_truncate", 0.5, 1.5)
    assert w[0].tolist() == pytest.approx([1.5, 0.5, 0.0]) and cut.tolist() == [[True, True, False]]
    w, cut = behavior_importance_weights(old, behavior, valid, "token_mask", 0.5, 1.5)
    assert w.tolist() == [[0.0, 0.0, 0.0]] and cut.tolist() == [[True, True, False]]
    w, cut = behavior_importance_weights(old, behavior, valid, "sequence_mask", 0.5, 1.5)
    assert w[0].tolist() == pytest.approx([math.exp(-0.5), math.exp(-0.5), 0.0]) and not cut.any()
    # a response whose log-ratios sum past e^88.7 (float32's end) is held at e^80, so masked, never NaN
    w, _ = behavior_importance_weights(torch.full((1, 3), 40.0), behavior, torch.ones(1, 3, dtype=torch.bool),
                                       "sequence_mask", None, 3.0)
    assert w.tolist() == [[0.0, 0.0, 0.0]]
    # without an upper bound it is kept at e^80, finite (TRL's weight is inf there, and its loss NaN)
    w, _ = behavior_importance_weights(torch.full((1, 3), 40.0), behavior, torch.ones(1, 3, dtype=torch.bool),
                                       "sequence_mask", 0.5, None)
    assert w[0].tolist() == pytest.approx([math.exp(80.0)] * 3)


def test_the_settings_are_checked():
    AlgoConfig(old_logprob="recompute", behavior_is="sequence_mask").validate()
    with pytest.raises(ValueError, match="set algo.old_logprob=recompute"):
        AlgoConfig(behavior_is="token_truncate").validate()
    # under another loss the keys are ppo_clip's, ignored with a warning, not refused with ppo_clip's advice
    other = AlgoConfig(loss="future_kl", behavior_is="token_truncate")
    other.validate()
    assert any("algo.behavior_is='token_truncate' belongs to algo.loss=ppo_clip" in line for line in other.ignored_keys())
    with pytest.raises(ValueError, match="algo.behavior_is"):
        AlgoConfig(old_logprob="recompute", behavior_is="token").validate()
    with pytest.raises(ValueError, match=r"behavior_is_min \(2.0\) must be below algo.behavior_is_max \(2.0\)"):
        AlgoConfig(old_logprob="recompute", behavior_is="token_mask", behavior_is_min=2.0, behavior_is_max=2.0).validate()
    with pytest.raises(ValueError, match="algo.behavior_is_min must be >= 0"):
        AlgoConfig(old_logprob="recompute", behavior_is="token_mask", behavior_is_max=0.0).validate()
    cfg = load_config(None, ["algo.old_logprob=recompute", "algo.behavior_is=token_mask", "algo.behavior_is_max=2"])
    assert cfg.algo.behavior_is_max == 2.0


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_a_learner_step_weighs_by_its_recomputed_logprobs_over_the_engines(tiny_qwen3, mode):
    """π_old is the learner's own log-probs before the step; μ the batch's behaviour log-probs, set 0.3 below
    them on every second response: the logged weights are those of the two, computed here."""
    path, _ = tiny_qwen3
    learner = Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=1,
                      temperature=1.0, device=torch.device("cpu"), fsdp=False, micro_batch_size=2,
                      algo=AlgoConfig(old_logprob="recompute", behavior_is=mode, behavior_is_max=1.2),
                      max_new_tokens=6)
    batch = ragged_batch(3)
    old = learner.logprobs(batch).double()
    shift = torch.tensor([0.3 if i % 2 else -0.1 for i in range(len(old))], dtype=torch.float64)[:, None]
    batch.behavior_logprobs = ((old - shift) * batch.response_mask).to(batch.behavior_logprobs.dtype)
    mask = batch.response_mask.bool()
    w, _ = behavior_importance_weights(old, batch.behavior_logprobs, mask, mode, None, 1.2)
    metrics = learner.step(batch)
    assert metrics["behavior_is_mean"] == pytest.approx(float(w[mask].mean()), rel=1e-5)
    assert metrics["behavior_is_max"] == pytest.approx(float(w[mask].max()), rel=1e-5)
    assert 0 < metrics["behavior_is_cut_frac"] < 1


def trl_off_policy_mask(adv, logp, sampling, mask, threshold):
    """TRL's get_off_policy_mask: keep a row if A >= 0 or the mean of (sampling − current) log-probs is <= δ."""
    kl = sampling - logp.detach()
    avg = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv[:, :1] >= 0) | (avg <= threshold)).to(mask.dtype)


@pytest.mark.parametrize("surrogate", ["clip", "cispo"])
@pytest.mark.parametrize("is_mode", ["none", "token_truncate"])
def test_the_off_policy_mask_equals_trls(surrogate, is_mode):
    """TRL multiplies each row's per-token loss by the mask, then by the IS ratio; the threshold sits between the
    rows' gaps so that some rows of negative advantage are dropped and some kept."""
    gen = torch.Generator().manual_seed(5)
    rows, width = 8, 7
    lengths = torch.tensor([7, 3, 6, 1, 5, 7, 2, 4])
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    sampling = -3 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    old = sampling + 0.2 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -0.5, -2.0, 0.0, -1.0, 0.7, -0.3], dtype=torch.float64)[:, None].expand(rows, width)
    gaps = ((sampling - logp.detach()) * mask).sum(1) / mask.sum(1)
    threshold = float(gaps[adv[:, 0] < 0].median())
    keys = {"old_logprob": "recompute", "behavior_is": is_mode, "off_policy_mask": threshold, "surrogate": surrogate}
    if surrogate == "clip":
        keys.update(eps_low=0.2, eps_high=0.28)
    cfg = AlgoConfig(**keys)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    coef_1 = torch.exp(logp - old)
    if surrogate == "clip":
        per_token = -torch.min(coef_1 * adv, torch.clamp(coef_1, 0.8, 1.28) * adv)
    else:
        per_token = -torch.clamp(coef_1, max=5.0).detach() * adv * logp
    keep = trl_off_policy_mask(adv, logp, sampling, mask, threshold)
    per_token = per_token * keep
    if is_mode != "none":
        per_token = per_token * trl_is_ratio(old, sampling, mask, is_mode, None, 3.0)
    want = (per_token * mask).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, logp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    dropped = (1 - keep).expand(rows, width) * mask
    assert 0 < metrics["off_policy_masked_frac"] == pytest.approx(float(dropped.sum() / mask.sum()), rel=1e-12)


def test_the_off_policy_mask_by_hand():
    """Row 0: A < 0, gap (0.5 + 1.5) / 2 = 1 > 0.8: dropped. Row 1: the same gap, A = 0: kept. Row 2: A < 0, gap 0.5:
    kept. A padded position never counts."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -2.0, 0.0], [-1.0, -1.0, 0.0]])
    behavior = torch.tensor([[-0.5, -0.5, 9.0], [-0.5, -0.5, 9.0], [-0.5, -0.5, 9.0]])
    adv = torch.tensor([[-1.0] * 3, [0.0] * 3, [-1.0] * 3])
    valid = torch.tensor([[True, True, False]] * 3)
    kept = off_policy_keep(logp, behavior, adv, valid, 0.8)
    assert kept.tolist() == [[False, False, False], [True, True, False], [True, True, False]]
    with pytest.raises(ValueError, match="algo.off_policy_mask must be >= 0"):
        AlgoConfig(off_policy_mask=-0.1).validate()
    assert load_config(None, ["algo.off_policy_mask=0.5"]).algo.off_policy_mask == 0.5


def areal_sequence_ratio_weights(prox, behave, mask, action, lower, upper):
    """AReaL's apply_rejection_sampling with metric ratio, level sequence, agg mean (2D padded; 2026-05): each
    response's weight is exp of its tokens' mean log-ratio; `mask` zeroes a response whose weight is outside
    [lower, upper] (its loss_mask entries, the loss's count taken before), `clamp` clamps the weight."""
    log_ratio = torch.where(mask.bool(), prox - behave, 0.0)
    seq_log_mean = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    weight = torch.exp(seq_log_mean).expand_as(log_ratio)
    out = (weight > upper) | (lower is not None and weight < lower)
    if action == "mask":
        return torch.where(out | ~mask.bool(), 0.0, weight)
    return torch.where(mask.bool(), weight.clamp(min=lower if lower is not None else 0.0, max=upper), 0.0)


@pytest.mark.parametrize("action", ["mask", "clamp"])
def test_the_geometric_sequence_weights_equal_areals(action):
    """`sequence_geo_mask` / `sequence_geo_truncate`: AReaL's sequence-level ratio rejection, whose weight is the
    geometric mean of a response's ratios (the product for `sequence_*`)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 2, 5, 1, 4])
    mask = torch.arange(6)[None] < lengths[:, None]
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 2
    sampling = old - 0.6 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mode = "sequence_geo_mask" if action == "mask" else "sequence_geo_truncate"
    weights, cut = behavior_importance_weights(old, sampling, mask, mode, 0.8, 1.25)
    want = areal_sequence_ratio_weights(old, sampling, mask.double(), action, 0.8, 1.25)
    torch.testing.assert_close(weights, want, rtol=1e-12, atol=0)
    assert 0 < int(cut.any(-1).sum()) < 5  # some responses inside the bounds, some outside
    product, _ = behavior_importance_weights(old, sampling, mask, "sequence_truncate", 0.8, 1.25)
    assert not torch.allclose(product, weights)
