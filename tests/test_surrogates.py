"""`algo.surrogate`: CISPO's and SAPO's objectives in place of PPO's clip (TRL's loss_type cispo / sapo), against
TRL's `_compute_loss` written out in float64 (TRL f2cd577): loss, gradient and metrics, with the sequence-level
ratio and the behaviour importance weights they share with the clip; verl's gpg; prime-rl's DPPO default loss and its
IPO loss (prime-rl 559b447's `default_loss_fn` and `ipo_loss_fn`, written out the same way)."""

from __future__ import annotations

import math

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.config import ConfigError, load_config
from tests.test_off_policy_corrections import trl_is_ratio


def trl_per_token_loss(logp, old, adv, mask, loss_type, level, eps_high=2.0, tau_pos=1.0, tau_neg=1.05):
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=eps_high).detach() * adv * logp
    temperatures = torch.where(adv > 0, tau_pos, tau_neg)
    return -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * adv


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 6, 8
    lengths = torch.tensor([8, 3, 6, 1, 5, 7])
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    sampling = -3 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    old = sampling + 0.2 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    logp = (old + 0.9 * torch.randn(rows, width, generator=gen, dtype=torch.float64)).requires_grad_(True)  # some ρ > 5
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).clone()
    return logp, old, sampling, adv, mask


@pytest.mark.parametrize("surrogate", ["cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("is_mode", ["none", "token_truncate", "sequence_mask"])
def test_the_surrogate_equals_trls_loss_type(surrogate, level, is_mode):
    """Token-mean aggregation (TRL's cispo divides by the batch's tokens; its sapo is a mean of row means, checked
    with seq_mean below)."""
    logp, old, sampling, adv, mask = batch(3)
    keys = {"surrogate": surrogate, "ratio_level": level, "old_logprob": "recompute", "behavior_is": is_mode,
            "cispo_max": 2.0, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}
    for agg in ("token_mean", "seq_mean"):
        cfg = AlgoConfig(loss_agg=agg, **keys)
        cfg.validate()
        loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                        behavior_logprobs=sampling), cfg)
        (grad,) = torch.autograd.grad(loss, logp)
        per_token = trl_per_token_loss(logp, old, adv, mask, surrogate, level)
        if is_mode != "none":
            per_token = per_token * trl_is_ratio(old, sampling, mask, is_mode, None, 3.0)
        want = (per_token * mask).sum() / mask.sum() if agg == "token_mean" else \
            ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
        (want_grad,) = torch.autograd.grad(want, logp)
        assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
        assert "clip_frac" not in metrics
    if surrogate == "cispo":  # TRL's cispo_clip_ratio: ρ above the cap with A > 0 (over tokens here; at sequence
        # level TRL counts responses, README says so)
        ratio = torch.exp(logp - old).detach() if level == "token" else torch.exp(
            ((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).detach().expand_as(mask)
        capped = ((ratio > 2.0) & (adv > 0)).double()
        assert metrics["cispo_clip_frac"] == pytest.approx(float((capped * mask).sum() / mask.sum()), rel=1e-12)
        assert metrics["cispo_clip_frac"] > 0 or level == "sequence"  # a response's mean log-ratio stays below ln 2


def test_sapos_two_temperatures_and_cispos_cap_by_hand():
    """One token each: SAPO at ρ = e^0.5, A = 1 (τ = 1): loss −4σ(e^0.5 − 1), gradient −4σ'(·)·ρ; at A = −1 (τ =
    1.05): loss (4/1.05)σ(1.05(ρ − 1)). CISPO at ρ = e^2 > 5: weight 5, loss −5·A·log π, gradient −5A."""
    logp = torch.tensor([[0.5 - 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    rho = torch.exp(torch.tensor(0.5, dtype=torch.float64))
    for a, tau in ((1.0, 1.0), (-1.0, 1.05)):
        inp = LossInputs(logprobs=logp, advantages=torch.tensor([[a]], dtype=torch.float64), mask=torch.ones(1, 1),
                         behavior_logprobs=old)
        loss, _ = get_loss("ppo_clip")(inp, AlgoConfig(surrogate="sapo"))
        (grad,) = torch.autograd.grad(loss, logp)
        s = torch.sigmoid(tau * (rho - 1))
        assert loss.item() == pytest.approx(float(-s * 4 / tau * a))
        assert grad.item() == pytest.approx(float(-a * 4 * s * (1 - s) * rho))
    logp = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logprobs=logp, advantages=torch.tensor([[0.5]], dtype=torch.float64), mask=torch.ones(1, 1),
                     behavior_logprobs=torch.tensor([[-1.0]], dtype=torch.float64))
    loss, metrics = get_loss("ppo_clip")(inp, AlgoConfig(surrogate="cispo"))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-5.0 * 0.5 * 1.0) and grad.item() == pytest.approx(-5.0 * 0.5)
    assert metrics["cispo_clip_frac"] == 1.0


def test_the_settings_are_checked_and_unread_ones_said():
    with pytest.raises(ValueError, match="algo.surrogate"):
        AlgoConfig(surrogate="gspo").validate()
    with pytest.raises(ValueError, match="algo.cispo_max must be > 0"):
        AlgoConfig(surrogate="cispo", cispo_max=0.0).validate()
    with pytest.raises(ValueError, match="algo.dual_clip bounds the clipped surrogate"):
        AlgoConfig(surrogate="sapo", dual_clip=3.0).validate()
    AlgoConfig(loss="future_kl", surrogate="sapo", dual_clip=3.0).validate()  # ppo_clip's keys, ignored there
    assert AlgoConfig(surrogate="cispo", eps_high=0.28).ignored_keys() == [
        "algo.eps_high=0.28 is read by algo.surrogate=clip only; algo.surrogate=cispo ignores it (its cap is "
        "algo.cispo_max)"]
    assert load_config(None, ["algo.surrogate=cispo", "algo.cispo_max=4"]).algo.cispo_max == 4.0
    with pytest.raises(ConfigError, match=r"use algo.loss_agg=token_mean \(TRL's cispo divides so; its objective is "
                                          r"algo.surrogate=cispo"):
        load_config(None, ["algo.loss_agg=cispo"])


@pytest.mark.parametrize("surrogate", ["clip", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_unbiased_reference_kl_equals_trls_bias_corrected_kl(surrogate, level):
    """TRL's `use_bias_correction_kl` written out in float64: its k3 per token times coef_1, the ratio π_θ/π_old with
    its gradient (per response at sequence level), beta times that added per token before the token mean."""
    logp, old, sampling, adv, mask = batch(5)
    ref = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    beta = 0.04
    cfg = AlgoConfig(loss_agg="token_mean", surrogate=surrogate, ratio_level=level, old_logprob="recompute",
                     kl_ref_coef=beta, kl_ref_unbiased=True, cispo_max=2.0)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    ref_logprobs=ref), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    if surrogate == "clip":
        per_token = -torch.min(coef_1 * adv, torch.clamp(coef_1, 0.8, 1.2) * adv)
    else:
        per_token = trl_per_token_loss(logp, old, adv, mask, "cispo", level)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    want = ((per_token + beta * per_token_kl * coef_1) * mask).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, logp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    # the logged kl_ref stays the plain k3 mean, and without the key the penalty is TRL's uncorrected one
    assert metrics["kl_ref"] == pytest.approx(float((per_token_kl.detach() * mask).sum() / mask.sum()), rel=1e-12)
    plain, _ = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                               ref_logprobs=ref), AlgoConfig(loss_agg="token_mean", surrogate=surrogate,
                                                                             ratio_level=level, old_logprob="recompute",
                                                                             kl_ref_coef=beta, cispo_max=2.0))
    want_plain = ((per_token + beta * per_token_kl) * mask).sum() / mask.sum()
    assert plain.item() == pytest.approx(want_plain.item(), rel=1e-12)


def test_a_capped_unbiased_penalty_adds_the_cap_and_no_gradient():
    """`algo.kl_ref_clamp` caps the ratio-weighted term: a token past it adds the cap and no gradient, as the README
    says of the cap (weighting after the cap gave that token β·cap·ρ of gradient). By hand: log π = −1, π_old −1.2,
    π_ref −6: k3 = e^−5 − 1 + 5 ≈ 4.0067, ρ = e^0.2, capped at 1; a second token under the cap keeps ρ·k3."""
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-6.0, -1.1]], dtype=torch.float64)
    cfg = AlgoConfig(loss_agg="token_mean", old_logprob="recompute", kl_ref_coef=1.0, kl_ref_unbiased=True,
                     kl_ref_clamp=1.0)
    inp = LossInputs(logprobs=logp, advantages=torch.zeros(1, 2, dtype=torch.float64), mask=torch.ones(1, 2),
                     old_logprobs=old, ref_logprobs=ref)
    loss, _ = get_loss("ppo_clip")(inp, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    d = torch.tensor(-0.1, dtype=torch.float64)  # the second token's log π_ref − log π
    k3 = torch.exp(d) - d - 1
    assert loss.item() == pytest.approx((1.0 + float(k3)) / 2, rel=1e-12)
    assert grad[0, 0].item() == 0.0
    # d/dlogπ of ρ·k3 with ρ = 1 there: k3 + (1 − e^d)
    assert grad[0, 1].item() == pytest.approx(float(k3 + 1 - torch.exp(d)) / 2, rel=1e-10)


def verl_gpg_loss(logp, adv, mask, is_weights=None):
    """verl's compute_policy_loss_gpg (b178a3c) written out: −log π · A per token, times the rollout-correction
    weights where given, token-mean over the batch."""
    per_token = -logp * adv
    if is_weights is not None:
        per_token = per_token * is_weights
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("is_mode", ["none", "token_truncate"])
def test_the_plain_policy_gradient_equals_verls_gpg_loss(is_mode):
    """`algo.surrogate=pg` (verl's loss_mode gpg): no ratio, so no clip; the loss and its gradient −A/N per token
    are verl's, whatever π_old is (PPO-clip's differ once π_θ has moved: a later mini-batch)."""
    logp, old, sampling, adv, mask = batch(7)
    cfg = AlgoConfig(loss_agg="token_mean", surrogate="pg", old_logprob="recompute", behavior_is=is_mode)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    weights = trl_is_ratio(old, sampling, mask, is_mode, None, 3.0) if is_mode != "none" else None
    want = verl_gpg_loss(logp, adv, mask, weights)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert "clip_frac" not in metrics
    clipped, _ = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                 behavior_logprobs=sampling), AlgoConfig(loss_agg="token_mean",
                                                                                         old_logprob="recompute"))
    assert abs(clipped.item() - loss.item()) > 1e-3
    assert AlgoConfig(surrogate="pg", ratio_level="sequence").ignored_keys() == [
        "algo.ratio_level=sequence is read by the ratio, which algo.surrogate=pg does not take (−A · log π)"]


def prime_rl_default_loss(trainer, inference, adv, mask, low=0.2, high=0.2, kl_tau=1e-3):
    """prime-rl's default_loss_fn over its rl token count (compute_loss divides the summed loss by rl_scale)."""
    log_ratio = trainer - inference
    ratio = torch.exp(log_ratio)
    probs_diff = torch.exp(trainer) - torch.exp(inference)
    invalid = torch.where(adv > 0, probs_diff > high, probs_diff < -low)
    keep = mask.bool() & ~invalid
    per_token = -(keep * adv * ratio) + kl_tau * (mask * log_ratio ** 2)
    return per_token.sum() / mask.sum()


@pytest.mark.parametrize("old_logprob", ["behavior", "recompute"])
def test_dppo_equals_prime_rls_default_loss(old_logprob):
    """`algo.surrogate=dppo`: A·ρ on the tokens inside the trust region on p_θ − p_old (per advantage sign) less
    dppo_kl_coef·(log ρ)² on every token, over the batch's tokens; π_old is μ (prime-rl's inference log-probs) or
    the recomputed one. Loss, gradient and the masked shares against prime-rl's, with non-default bounds."""
    logp, old, sampling, adv, mask = batch(12)
    pi_old = old if old_logprob == "recompute" else sampling
    cfg = AlgoConfig(loss_agg="token_mean", surrogate="dppo", old_logprob=old_logprob, dppo_mask_low=0.1,
                     dppo_mask_high=0.15, dppo_kl_coef=0.05)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    want = prime_rl_default_loss(logp, pi_old, adv, mask, low=0.1, high=0.15, kl_tau=0.05)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    gap = torch.exp(logp.detach()) - torch.exp(pi_old)
    high, low = (adv > 0) & (gap > 0.15) & mask.bool(), (adv < 0) & (gap < -0.1) & mask.bool()
    assert 0 < int(high.sum()) and 0 < int(low.sum())  # both sides of the trust region are exercised
    n = float(mask.sum())
    assert metrics["dppo_masked_frac_high"] == pytest.approx(int(high.sum()) / n)
    assert metrics["dppo_masked_frac_low"] == pytest.approx(int(low.sum()) / n)
    assert metrics["dppo_masked_frac"] == pytest.approx(int((high | low).sum()) / n)


def test_dppo_by_hand_and_its_settings_refused_or_warned():
    """Two tokens, A = +1 and −1, p_old = 0.5 each: p_θ = 0.8 (+0.3 > 0.2) drops the first, p_θ = 0.4 (−0.1) keeps
    the second: loss = −(−1 · 0.8) + kl·[(log 1.6)² + (log 0.8)²], over 2 tokens."""
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logp = torch.log(torch.tensor([[0.8, 0.4]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cfg = AlgoConfig(surrogate="dppo", dppo_kl_coef=0.1)
    loss, _ = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=torch.ones(1, 2),
                                              behavior_logprobs=old), cfg)
    want = (-(-1.0 * 0.4 / 0.5) + 0.1 * (math.log(1.6) ** 2 + math.log(0.8) ** 2)) / 2
    assert loss.item() == pytest.approx(float(want), rel=1e-12)
    with pytest.raises(ConfigError, match="algo.surrogate=dppo masks each token .* set algo.ratio_level=token"):
        load_config(None, ["algo.surrogate=dppo", "algo.ratio_level=sequence"])
    with pytest.raises(ConfigError, match="algo.dppo_mask_low must be >= 0"):
        load_config(None, ["algo.surrogate=dppo", "algo.dppo_mask_low=-0.1"])
    assert AlgoConfig(dppo_kl_coef=0.01).ignored_keys() == [
        "algo.dppo_kl_coef=0.01 is read by algo.surrogate=dppo only; algo.surrogate=clip ignores it"]


def prime_rl_ipo_loss(trainer, inference, adv, mask, threshold=0.1, kl_tau=1e-3):
    """prime-rl's ipo_loss_fn over its rl token count (adv_tau = 1)."""
    log_ratio = trainer - inference
    keep = mask.bool() & ~((torch.exp(trainer) - torch.exp(inference)).abs() > threshold)
    per_token = -(keep * adv * torch.exp(log_ratio)) + kl_tau * (mask * log_ratio ** 2)
    return per_token.sum() / mask.sum()


@pytest.mark.parametrize("old_logprob", ["behavior", "recompute"])
def test_ipo_equals_prime_rls_ipo_loss(old_logprob):
    """`algo.surrogate=ipo`: A·ρ on the tokens whose probability moved by at most ipo_threshold either way (whatever
    the advantage's sign), less ipo_kl_coef·(log ρ)² on every token: loss, gradient and the masked share against
    prime-rl's ipo_loss_fn, with non-default settings."""
    logp, old, sampling, adv, mask = batch(13)
    pi_old = old if old_logprob == "recompute" else sampling
    cfg = AlgoConfig(loss_agg="token_mean", surrogate="ipo", old_logprob=old_logprob, ipo_threshold=0.12,
                     ipo_kl_coef=0.04)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    want = prime_rl_ipo_loss(logp, pi_old, adv, mask, threshold=0.12, kl_tau=0.04)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    gap = (torch.exp(logp.detach()) - torch.exp(pi_old)) * mask
    # both directions of both signs are dropped, which DPPO's one-sided region would keep half of
    for sign in (adv > 0, adv < 0):
        assert int((sign & (gap > 0.12)).sum()) > 0 and int((sign & (gap < -0.12)).sum()) > 0
    assert metrics["ipo_masked_frac"] == pytest.approx(int((gap.abs() > 0.12).sum()) / float(mask.sum()))


def test_ipo_by_hand_and_its_settings_refused_or_warned():
    """Two tokens of A = +1, p_old = 0.5: p_θ = 0.3 (−0.2 past 0.1) is dropped by IPO, though DPPO (which masks only
    a rise for A > 0) keeps it; p_θ = 0.55 (+0.05) is kept: loss = −(0.55/0.5) + kl·[(log 0.6)² + (log 1.1)²], over
    2 tokens."""
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logp = torch.log(torch.tensor([[0.3, 0.55]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    inputs = LossInputs(logprobs=logp, advantages=adv, mask=torch.ones(1, 2), behavior_logprobs=old)
    loss, metrics = get_loss("ppo_clip")(inputs, AlgoConfig(surrogate="ipo", ipo_kl_coef=0.1))
    kl = 0.1 * (math.log(0.6) ** 2 + math.log(1.1) ** 2)
    assert loss.item() == pytest.approx((-(0.55 / 0.5) + kl) / 2, rel=1e-12)
    assert metrics["ipo_masked_frac"] == 0.5
    dppo, _ = get_loss("ppo_clip")(inputs, AlgoConfig(surrogate="dppo", dppo_kl_coef=0.1))
    assert dppo.item() == pytest.approx((-(0.3 / 0.5) - (0.55 / 0.5) + kl) / 2, rel=1e-12)
    with pytest.raises(ConfigError, match="algo.surrogate=ipo masks each token .* set algo.ratio_level=token"):
        load_config(None, ["algo.surrogate=ipo", "algo.ratio_level=sequence"])
    with pytest.raises(ConfigError, match="algo.ipo_threshold must be >= 0"):
        load_config(None, ["algo.surrogate=ipo", "algo.ipo_threshold=-0.1"])
    assert AlgoConfig(surrogate="dppo", ipo_threshold=0.2).ignored_keys() == [
        "algo.ipo_threshold=0.2 is read by algo.surrogate=ipo only; algo.surrogate=dppo ignores it"]


def trl_vespo_loss(logp, old, adv, mask, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """TRL's get_gamma_weights and its vespo branch of _compute_loss (normalised by the batch's tokens, as dapo)."""
    lower = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(logp - old, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    adv_seq = adv[:, :1]
    k = torch.where(adv_seq >= 0, k_pos, k_neg)
    lam = torch.where(adv_seq >= 0, lam_pos, lam_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
    per_token = -phi * adv * logp
    return (per_token * mask).sum() / mask.sum(), phi


def test_vespo_equals_trls():
    """`algo.surrogate=vespo` (TRL's loss_type vespo): −sg(φ(w)) · A · log π with the response's Gamma weight of
    w = Π ρ_t, k and λ by the advantage's sign, over the batch's tokens. Loss, gradient and the weight's mean against
    TRL's written out in float64, with non-default k and λ; φ(1) = 1, so an unmoved policy gives pg's loss."""
    logp, old, sampling, adv, mask = batch(5)
    logp = (old + 0.15 * (logp.detach() - old)).requires_grad_(True)  # w near 1: φ neither 0 nor saturated
    cfg = AlgoConfig(loss_agg="token_mean", surrogate="vespo", old_logprob="recompute", vespo_k_pos=1.5,
                     vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    cfg.validate()
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old,
                                                    behavior_logprobs=sampling), cfg)
    want, phi = trl_vespo_loss(logp, old, adv, mask, 1.5, 2.5, 2.5, 1.5)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert 0.05 < float(phi.min()) and float(phi.max()) < 5 and float(phi.std()) > 0.1  # weights that matter
    assert metrics["vespo_weight_mean"] == pytest.approx(float((phi * mask).sum() / mask.sum()), rel=1e-12)
    unmoved = old.clone().requires_grad_(True)
    at_one, _ = get_loss("ppo_clip")(LossInputs(logprobs=unmoved, advantages=adv, mask=mask.bool(), old_logprobs=old),
                                     cfg)
    plain, _ = get_loss("ppo_clip")(LossInputs(logprobs=unmoved, advantages=adv, mask=mask.bool(), old_logprobs=old),
                                    AlgoConfig(surrogate="pg", old_logprob="recompute"))
    assert at_one.item() == pytest.approx(plain.item(), rel=1e-12)
    tiny = AlgoConfig(loss_agg="token_mean", surrogate="vespo", old_logprob="recompute", vespo_lambda_pos=1e-5,
                      vespo_lambda_neg=1e-6)  # TRL holds λ at 1e-4 at least
    tiny.validate()
    moved = (old + 2.0 * (logp.detach() - old)).requires_grad_(True)
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=moved, advantages=adv, mask=mask.bool(), old_logprobs=old),
                                         tiny)
    want, phi = trl_vespo_loss(moved, old, adv, mask, 2.0, 1e-5, 3.0, 1e-6)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert metrics["vespo_weight_mean"] == pytest.approx(float((phi * mask).sum() / mask.sum()), rel=1e-10)
    with pytest.raises(ConfigError, match="set algo.ratio_level=token"):
        load_config(None, ["algo.surrogate=vespo", "algo.ratio_level=sequence"])
    with pytest.raises(ConfigError, match="set algo.behavior_is=none"):
        load_config(None, ["algo.surrogate=vespo", "algo.old_logprob=recompute", "algo.behavior_is=token_truncate"])


def test_luspo_is_the_sequence_ratio_over_token_sums():
    """TRL's loss_type luspo: GSPO's per-sequence clipped loss (B, 1) times each response's length, averaged over
    the responses, which is `algo.ratio_level=sequence` with `algo.loss_agg=seq_mean_token_sum`."""
    logp, old, sampling, adv, mask = batch(9)
    cfg = AlgoConfig(loss_agg="seq_mean_token_sum", ratio_level="sequence", old_logprob="recompute", eps_low=3e-4,
                     eps_high=4e-4)
    loss, _ = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=mask.bool(), old_logprobs=old), cfg)
    log_w = (((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # TRL's sequence level
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - 3e-4, 1 + 4e-4)
    per_seq = -torch.min(coef_1 * adv[:, :1], coef_2 * adv[:, :1])
    want = (per_seq * mask.sum(1, keepdim=True)).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
