"""PPO-clip against hand-worked gradients, aggregation, micro-batching, reference KL, registry, config."""

import math

import pytest
import torch

from kv4rl.algo import (
    LOSSES,
    AlgoConfig,
    LossInputs,
    aggregate,
    batch_denominators,
    combine_metrics,
    get_loss,
    register_loss,
)


def _one_row(ratios, advantages, old=None):
    """Inputs for one response whose tokens have the given ratios π/μ and advantages."""
    behavior = torch.linspace(-2.0, -0.5, len(ratios), dtype=torch.float64)[None]
    logprobs = (behavior + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()
    return LossInputs(
        logprobs=logprobs,
        behavior_logprobs=behavior,
        advantages=torch.tensor([advantages], dtype=torch.float64),
        mask=torch.ones(1, len(ratios)),
        old_logprobs=old,
    )


def _coefficients(inp, cfg):
    """Per-token coefficient of ∇log π in the surrogate (loss = −Σ surrogate with num_tokens=1)."""
    inp.num_tokens = 1.0
    loss, metrics = get_loss(cfg.loss)(inp, cfg)
    (grad,) = torch.autograd.grad(loss, inp.logprobs)
    return (-grad[0]).tolist(), loss.item(), metrics


def test_ppo_clip_by_hand_with_asymmetric_eps():
    cases = [  # (ratio, advantage, coefficient, surrogate)
        (1.1, 1.0, 1.1, 1.1),
        (1.5, 1.0, 0.0, 1.28),  # clipped above 1 + eps_high
        (1.5, -1.0, -1.5, -1.5),  # a negative advantage is never clipped above
        (0.5, -1.0, 0.0, -0.8),  # clipped below 1 − eps_low
        (0.5, 2.0, 1.0, 1.0),
        (1.25, 1.0, 1.25, 1.25),  # inside only because eps_high = 0.28 > 0.2
        (0.79, -1.0, 0.0, -0.8),
        (0.81, -1.0, -0.81, -0.81),
    ]
    inp = _one_row([c[0] for c in cases], [c[1] for c in cases])
    cfg = AlgoConfig(loss="ppo_clip", eps_low=0.2, eps_high=0.28)
    coef, loss, metrics = _coefficients(inp, cfg)
    assert coef == pytest.approx([c[2] for c in cases], abs=1e-12)
    assert loss == pytest.approx(-sum(c[3] for c in cases), abs=1e-12)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 8)
    assert metrics["clip_frac_low"] == pytest.approx(2 / 8)
    assert metrics["clip_frac"] == pytest.approx(3 / 8)
    assert metrics["ratio_mean"] == pytest.approx(sum(c[0] for c in cases) / 8)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_ppo_clip_default_token_mean_divides_by_valid_tokens():
    inp = _one_row([1.1, 0.9, 3.0], [1.0, -2.0, 5.0])
    inp.mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = get_loss("ppo_clip")(inp, AlgoConfig(loss="ppo_clip"))
    loss.backward()
    torch.testing.assert_close(
        inp.logprobs.grad, torch.tensor([[-1.1 / 2, 0.9 * 2 / 2, 0.0]], dtype=torch.float64)
    )
    assert loss.item() == pytest.approx(-(1.1 - 1.8) / 2)


def test_dual_clip_bounds_negative_advantages():
    inp = _one_row([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0])
    cfg = AlgoConfig(loss="ppo_clip", eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    coef, loss, metrics = _coefficients(inp, cfg)
    assert coef == pytest.approx([0.0, -2.0, 0.0], abs=1e-12)
    assert loss == pytest.approx(-(-3.0 - 2.0 + 1.2), abs=1e-12)
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3)


def test_the_a2_case():
    """ρ = 1.5 > 1 + ε with A = ±σ: the clipped token gets 0, the other −ρσ (docs/simulations.md)."""
    inp = _one_row([1.5, 1.5], [1.0, -1.0])
    coef, _, metrics = _coefficients(inp, AlgoConfig(loss="ppo_clip", eps_low=0.2, eps_high=0.2))
    assert coef == pytest.approx([0.0, -1.5], abs=1e-12)
    assert sum(coef) / 2 == pytest.approx(-1.5 / 2)
    assert metrics["clip_frac"] == 0.5


def test_recompute_uses_the_learners_old_logprobs():
    behavior = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -0.5]], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(
        logprobs=logprobs,
        behavior_logprobs=behavior,
        advantages=torch.ones(1, 2, dtype=torch.float64),
        mask=torch.ones(1, 2),
        old_logprobs=old,
        num_tokens=1.0,
    )
    cfg = AlgoConfig(loss="ppo_clip", old_logprob="recompute")
    loss, metrics = get_loss("ppo_clip")(inp, cfg)
    loss.backward()
    r0, r1 = math.exp(0.5), math.exp(-0.5)  # 1.65 is clipped (A > 0), 0.61 is not
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -r1])
    assert metrics["ratio_mean"] == pytest.approx((r0 + r1) / 2)
    inp.old_logprobs = None
    with pytest.raises(ValueError, match="old_logprobs"):
        get_loss("ppo_clip")(inp, cfg)


def test_aggregate_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(values, mask, "token_mean", num_tokens=7.0).item() == pytest.approx(1.0)
    assert aggregate(values, mask, "seq_mean", num_seqs=5.0).item() == pytest.approx(5.5 / 5)
    assert batch_denominators(mask) == (3.0, 2.0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(values, mask, "sum")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(values, mask, "token_mean", num_tokens=0.0)
    # Dr. GRPO: every response's token sum over one constant length, then the mean over responses
    assert aggregate(values, mask, "token_sum_norm", norm_tokens=5.0).item() == pytest.approx((1 + 2 + 4) / (2 * 5))
    assert aggregate(values, mask, "token_sum_norm", num_seqs=5.0, norm_tokens=4.0).item() == pytest.approx(7 / 20)
    with pytest.raises(ValueError, match="token_sum_norm' needs norm_tokens"):
        aggregate(values, mask, "token_sum_norm")
    with pytest.raises(ValueError, match="norm_tokens must be > 0"):
        aggregate(values, mask, "token_sum_norm", norm_tokens=0.0)
    # verl's seq-mean-token-sum: each response's token sum, averaged over the responses that have a token
    assert aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx((1 + 2 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum", num_seqs=7.0).item() == pytest.approx(1.0)


def test_token_sum_norm_equals_trls_dr_grpo_loss_and_weighs_every_token_alike():
    """TRL's `loss_type: dr_grpo` written out in float64: per-token −min(ρA, clip(ρ)A), summed over the
    batch's response tokens and divided by rows x max_completion_length. A token's gradient does not depend
    on its response's length (under seq_mean a 2-token response's tokens weigh 2.5x a 5-token one's)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 5, 4])
    mask = (torch.arange(6)[None] < lengths[:, None]).double()
    behavior = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 2
    logprobs = (behavior + 0.3 * torch.randn(3, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.5], [-0.5], [0.25]], dtype=torch.float64).expand(3, 6) * mask
    cfg = AlgoConfig(loss="ppo_clip", loss_agg="token_sum_norm", eps_low=0.2, eps_high=0.28)
    max_completion_length = 8
    loss, _ = get_loss("ppo_clip")(LossInputs(logprobs=logprobs, behavior_logprobs=behavior, advantages=adv,
                                              mask=mask, norm_tokens=max_completion_length), cfg)
    ratio = torch.exp(logprobs.detach() - behavior)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
    trl = (per_token * mask).sum() / (3 * max_completion_length)
    assert loss.item() == pytest.approx(trl.item(), rel=1e-12)
    # at ρ = 1 (nothing clipped) d loss / d log π = −A / (rows · L) at every response token, whatever its length
    at_one = behavior.clone().requires_grad_()
    loss, _ = get_loss("ppo_clip")(LossInputs(logprobs=at_one, behavior_logprobs=behavior, advantages=adv,
                                              mask=mask, norm_tokens=max_completion_length), cfg)
    (grad,) = torch.autograd.grad(loss, at_one)
    torch.testing.assert_close(grad, -adv / (3 * max_completion_length), rtol=0, atol=1e-15)


def test_sequence_ratio_equals_trls_importance_sampling_level_sequence():
    """TRL's GSPO branch written out in float64: log-ratios averaged over each response's tokens, exp, then the
    clipped surrogate per token with loss_type dapo (token_mean); the loss and the gradient match."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 6, 1])
    mask = (torch.arange(6)[None] < lengths[:, None]).double()
    old = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 2
    logprobs = (old + 0.05 * torch.randn(3, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0], [-0.7], [0.4]], dtype=torch.float64)
    cfg = AlgoConfig(loss="ppo_clip", ratio_level="sequence", eps_low=3e-3, eps_high=4e-3)
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logprobs, behavior_logprobs=old,
                                                    advantages=adv.expand(3, 6) * mask, mask=mask), cfg)
    (grad,) = torch.autograd.grad(loss, logprobs)
    trl_logp = logprobs.detach().clone().requires_grad_()
    seq = (((trl_logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    coef_1 = torch.exp(seq)
    coef_2 = coef_1.clamp(1 - 3e-3, 1 + 4e-3)
    per_token = -torch.minimum(coef_1 * adv, coef_2 * adv)
    trl = (per_token * mask).sum() / mask.sum()
    (trl_grad,) = torch.autograd.grad(trl, trl_logp)
    assert loss.item() == pytest.approx(trl.item(), rel=1e-12)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-12, atol=1e-15)
    assert grad.abs().sum() > 0 and metrics["ratio_max"] == pytest.approx(float(coef_1.max()), rel=1e-12)


def _random_batch(seed, with_ref=True):
    gen = torch.Generator().manual_seed(seed)
    num_rows, length = 6, 7
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = torch.arange(length)[None] < lengths[:, None]
    behavior = -torch.rand(num_rows, length, generator=gen, dtype=torch.float64) * 3
    logprobs = behavior + 0.4 * torch.randn(num_rows, length, generator=gen, dtype=torch.float64)
    ref = behavior + 0.3 * torch.randn(num_rows, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(num_rows, 1, generator=gen, dtype=torch.float64).expand(num_rows, length).clone()
    return {
        "logprobs": logprobs.requires_grad_(),
        "behavior_logprobs": behavior,
        "advantages": adv,
        "mask": mask,
        "ref_logprobs": ref if with_ref else None,
    }


CONFIGS = [
    AlgoConfig(loss="ppo_clip", loss_agg="token_mean", kl_ref_coef=0.1, dual_clip=2.0),
    AlgoConfig(loss="ppo_clip", loss_agg="seq_mean", eps_high=0.28),
    AlgoConfig(loss="future_kl", loss_agg="token_mean", horizon=2, is_mode="token", future_cost_clip=0.5),
    AlgoConfig(loss="future_kl", loss_agg="seq_mean", is_mode="sequence", kl_ref_coef=0.2),
    AlgoConfig(loss="ppo_clip", loss_agg="token_sum_norm", kl_ref_coef=0.1),
    AlgoConfig(loss="future_kl", loss_agg="token_sum_norm", horizon=3),
    AlgoConfig(loss="ppo_clip", loss_agg="seq_mean", ratio_level="sequence", eps_low=0.01, eps_high=0.01),
]
NORM_TOKENS = 9.0  # token_sum_norm's constant length (rollout.max_new_tokens in a run)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss}-{c.loss_agg}")
def test_micro_batches_with_full_denominators_equal_the_full_batch(cfg):
    batch = _random_batch(0)
    loss_fn = get_loss(cfg.loss)
    full_loss, full_metrics = loss_fn(LossInputs(**batch, norm_tokens=NORM_TOKENS), cfg)
    (full_grad,) = torch.autograd.grad(full_loss, batch["logprobs"])

    num_tokens, num_seqs = batch_denominators(batch["mask"])
    total = torch.zeros((), dtype=torch.float64)
    parts = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        micro = {k: (v[rows] if v is not None else None) for k, v in batch.items()}
        loss, metrics = loss_fn(LossInputs(**micro, num_tokens=num_tokens, num_seqs=num_seqs, norm_tokens=NORM_TOKENS),
                                cfg)
        total = total + loss
        parts.append((metrics, float(micro["mask"].sum())))
    (micro_grad,) = torch.autograd.grad(total, batch["logprobs"])
    assert total.item() == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(micro_grad, full_grad, rtol=0, atol=1e-12)
    merged = combine_metrics(parts)
    assert merged.keys() == full_metrics.keys()
    for key in (
        "kl_ref",
        "ratio_mean",
        "ratio_max",
        "clip_frac",
        "is_weight_mean",
        "is_weight_max",
        "log_ratio_absmax",
        "future_credit_mean",
        "future_credit_std",  # was the mean of the micro-batches' stds (-39% at two in one case)
        "future_credit_absmax",
    ):
        if key in full_metrics:
            assert merged[key] == pytest.approx(full_metrics[key], abs=1e-12), key


@pytest.mark.parametrize("name", ["ppo_clip", "future_kl"])
def test_reference_kl_term_by_hand(name):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5, -9.0]], dtype=torch.float64)
    inp = LossInputs(
        logprobs=logprobs,
        behavior_logprobs=logprobs.detach(),
        advantages=torch.zeros(1, 3),
        mask=torch.tensor([[1, 1, 0]]),
        ref_logprobs=ref,
    )
    cfg = AlgoConfig(loss=name, kl_ref_coef=0.5, is_mode="none")
    loss, metrics = get_loss(name)(inp, cfg)
    loss.backward()
    log_rho = [-0.2, 0.5]
    k3 = [math.exp(x) - 1 - x for x in log_rho]
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 2)
    expected_grad = [0.5 * (1 - math.exp(x)) / 2 for x in log_rho] + [0.0]  # d k3 / d log π = 1 − ρ_ref
    assert logprobs.grad[0].tolist() == pytest.approx(expected_grad)


@pytest.mark.parametrize("name", ["ppo_clip", "future_kl"])
def test_the_ref_kl_clamp_caps_each_tokens_k3_as_verls_low_var_kl(name):
    """algo.kl_ref_clamp: each token's k3 at most the cap, and no gradient past it (verl's low_var_kl clamps at
    10). Hand-worked: log rho = 2 gives k3 = e^2 - 3 = 4.389 (gradient 1 - e^2), log rho = 3 gives 16.09 -> 10.
    The logged kl_ref stays the true k3."""
    logprobs = torch.tensor([[-3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    inp = LossInputs(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=torch.zeros(1, 2),
                     mask=torch.ones(1, 2, dtype=torch.bool), ref_logprobs=ref)
    loss, metrics = get_loss(name)(inp, AlgoConfig(loss=name, kl_ref_coef=1.0, kl_ref_clamp=10.0, is_mode="none"))
    loss.backward()
    assert loss.item() == pytest.approx((math.exp(2) - 3 + 10.0) / 2)
    assert logprobs.grad[0].tolist() == pytest.approx([(1 - math.exp(2)) / 2, 0.0])
    assert metrics["kl_ref"] == pytest.approx((math.exp(2) - 3 + math.exp(3) - 4) / 2)
    with pytest.raises(ValueError, match="algo.kl_ref_clamp must be > 0"):
        AlgoConfig(kl_ref_clamp=0.0).validate()


@pytest.mark.parametrize("name", ["ppo_clip", "future_kl"])
def test_a_token_far_below_the_reference_leaves_the_ref_kl_term_finite(name):
    """k3 = expm1(log ρ) − log ρ overflowed float32 past log ρ = 88.7: one such token made the loss inf and the
    step was skipped. Held at 80 as the PPO ratio is; below that the term is exact."""
    ref = torch.tensor([[-1.0, -1.0]])
    for gap, held in ((50.0, False), (100.0, True)):
        logprobs = torch.tensor([[-1.0 - gap, -1.0]], requires_grad=True)
        inp = LossInputs(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=torch.zeros(1, 2),
                         mask=torch.ones(1, 2, dtype=torch.bool), ref_logprobs=ref)
        loss, metrics = get_loss(name)(inp, AlgoConfig(loss=name, kl_ref_coef=0.1, is_mode="none"))
        loss.backward()
        log_rho = 80.0 if held else gap
        k3 = math.expm1(log_rho) - log_rho  # the second token's term is 0
        assert math.isfinite(loss.item()) and loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-5)
        assert metrics["kl_ref"] == pytest.approx(k3 / 2, rel=1e-5)
        grad = 0.0 if held else 0.1 * (1 - math.exp(gap)) / 2
        assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 0].item() == pytest.approx(grad, rel=1e-5)
    n = 6300  # each at the limit: their float32 sum (6300 x 5.5e34) overflowed before the mean was taken
    logprobs = torch.full((1, n), -101.0, requires_grad=True)
    inp = LossInputs(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=torch.zeros(1, n),
                     mask=torch.ones(1, n, dtype=torch.bool), ref_logprobs=torch.full((1, n), -1.0))
    loss, metrics = get_loss(name)(inp, AlgoConfig(loss=name, kl_ref_coef=0.1, is_mode="none"))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.1 * (math.expm1(80.0) - 80.0), rel=1e-5)
    assert metrics["kl_ref"] == pytest.approx(math.expm1(80.0) - 80.0, rel=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss}-{c.loss_agg}")
def test_garbage_in_padding_never_reaches_loss_or_gradient(cfg):
    clean = _random_batch(1)
    dirty = {k: (v.detach().clone() if v is not None else None) for k, v in clean.items()}
    pad = ~clean["mask"]
    dirty["logprobs"][pad] = float("-inf")
    dirty["behavior_logprobs"][pad] = float("nan")
    dirty["advantages"][pad] = float("nan")
    dirty["ref_logprobs"][pad] = float("inf")
    dirty["logprobs"].requires_grad_()
    losses, grads = [], []
    for batch in (clean, dirty):
        loss, metrics = get_loss(cfg.loss)(LossInputs(**batch, norm_tokens=NORM_TOKENS), cfg)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, batch["logprobs"])[0])
        assert all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(losses[1]) and losses[1].item() == pytest.approx(losses[0].item(), abs=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)


def test_combine_metrics_rule():
    merged = combine_metrics(
        [({"a": 1.0, "r_max": 2.0, "c_absmax": 1.0}, 1.0), ({"a": 4.0, "r_max": 1.0, "c_absmax": 3.0}, 3.0)]
    )
    assert merged == {"a": pytest.approx(3.25), "r_max": 2.0, "c_absmax": 3.0}


def test_registry():
    assert set(LOSSES) >= {"ppo_clip", "future_kl"}
    with pytest.raises(ValueError, match="ppo_clip"):
        get_loss("reinforce")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo_clip")(lambda inp, cfg: None)


def test_shape_mismatch_is_a_value_error():
    inp = _one_row([1.0, 1.0], [1.0, 1.0])
    inp.mask = torch.ones(1, 3)
    with pytest.raises(ValueError, match="mask"):
        get_loss("ppo_clip")(inp, AlgoConfig())


@pytest.mark.parametrize(
    "field, value",
    [
        ("eps_low", 1.0),
        ("eps_low", -0.1),
        ("eps_high", -0.1),
        ("dual_clip", 1.0),
        ("beta", -1.0),
        ("horizon", 0),
        ("horizon", True),
        ("horizon", "all"),
        ("is_cap", 0.0),
        ("future_cost_clip", 0.0),
        ("kl_ref_coef", -0.1),
        ("loss", "pg"),
        ("loss_agg", "sum"),
        ("loss_norm_tokens", 0),
        ("is_mode", "seq"),
        ("old_logprob", "old"),
        ("ratio_level", "seq"),
    ],
)
def test_algo_config_validate_names_the_key(field, value):
    AlgoConfig().validate()
    AlgoConfig(loss="future_kl", horizon=64, dual_clip=3.0, future_cost_clip=1.0).validate()
    with pytest.raises(ValueError, match=f"algo.{field}"):
        AlgoConfig(**{field: value}).validate()


def test_horizon_tokens():
    assert AlgoConfig().horizon_tokens is None
    assert AlgoConfig(horizon=4).horizon_tokens == 4


def test_ppo_clip_stays_finite_where_the_ratio_overflows_float32():
    """A log-ratio of 90 overflows exp in float32: the clipped token's gradient and an A = 0 token's loss were
    NaN. They must equal the float64 values (where e^90 is finite): gradient 0 and loss exact."""
    def run(dtype):
        logprobs = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=dtype, requires_grad=True)
        behaviour = torch.tensor([[-91.0, -91.0, -1.1, -91.0]], dtype=dtype)  # log-ratios 90, 90, 0.1, 90
        inp = LossInputs(logprobs=logprobs, advantages=torch.tensor([[1.0, 0.0, -1.0, -1.0]], dtype=dtype),
                         mask=torch.ones(1, 4, dtype=dtype), num_tokens=4.0, num_seqs=1.0, behavior_logprobs=behaviour)
        loss, _ = get_loss("ppo_clip")(inp, AlgoConfig(loss="ppo_clip", dual_clip=3.0))
        (grad,) = torch.autograd.grad(loss, logprobs)
        return loss.double(), grad.double()

    loss32, grad32 = run(torch.float32)
    loss64, grad64 = run(torch.float64)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()
    assert loss32.item() == pytest.approx(loss64.item(), rel=1e-6)
    torch.testing.assert_close(grad32, grad64, rtol=1e-6, atol=0)
    assert grad64[0, 0] == 0 and grad64[0, 3] == 0  # clipped (A > 0) and dual-clipped (A < 0)


def _verl_kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's kl_penalty_forward (core_algos.py, b178a3c) written out in float64: kl/k1 δ, abs |δ|, mse/k2 δ²/2,
    low_var_kl/k3 e^x − x − 1 with x = clamp(−δ, −20, 20), clamped to [−10, 10]."""
    delta = logp - ref
    if kind == "k1":
        return delta
    if kind == "abs":
        return delta.abs()
    if kind == "k2":
        return 0.5 * delta**2
    x = torch.clamp(-delta, -20, 20)
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("kind", ["k3", "k1", "k2", "abs"])
@pytest.mark.parametrize("name,agg", [("ppo_clip", "token_mean"), ("future_kl", "seq_mean"),
                                      ("ppo_clip", "token_sum_norm")])
def test_each_ref_kl_type_adds_verls_penalty(kind, name, agg):
    """algo.kl_ref_type: the loss with the penalty is the loss without it plus kl_ref_coef x the penalty
    aggregated as the loss, value and gradient, against verl's formulas; the logged kl_ref stays k3's mean."""
    batch = _random_batch(5)
    base_cfg = AlgoConfig(loss=name, loss_agg=agg, is_mode="none") if name == "future_kl" else \
        AlgoConfig(loss=name, loss_agg=agg)
    cfg = AlgoConfig(**{**base_cfg.config_values(), "kl_ref_coef": 0.3, "kl_ref_type": kind})
    cfg.validate()
    extra = {"norm_tokens": 7.0} if agg == "token_sum_norm" else {}
    loss, metrics = get_loss(name)(LossInputs(**batch, **extra), cfg)
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    plain, _ = get_loss(name)(LossInputs(**batch, **extra), base_cfg)
    penalty = _verl_kl_penalty(batch["logprobs"], batch["ref_logprobs"], kind)
    mask = batch["mask"]
    lengths = mask.sum(-1, keepdim=True).double()
    if agg == "token_mean":
        term = (penalty * mask).sum() / mask.sum()
    elif agg == "seq_mean":
        term = ((penalty * mask).sum(-1, keepdim=True) / lengths).sum() / len(lengths)
    else:
        term = (penalty * mask).sum() / (len(lengths) * 7.0)
    want = plain + 0.3 * term
    (want_grad,) = torch.autograd.grad(want, batch["logprobs"])
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    k3 = _verl_kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k3").detach()
    assert metrics["kl_ref"] == pytest.approx(float((k3 * mask).sum() / mask.sum()), rel=1e-12)


def test_the_ref_kl_type_is_checked_and_said_to_need_a_coefficient():
    with pytest.raises(ValueError, match="algo.kl_ref_type"):
        AlgoConfig(kl_ref_type="k4").validate()
    assert any("algo.kl_ref_type=k2" in line for line in AlgoConfig(kl_ref_type="k2").ignored_keys())
    assert not AlgoConfig(kl_ref_type="k2", kl_ref_coef=0.1).ignored_keys()
    # the cap holds every type's term: k2 of δ = 5 is 12.5, capped at 10 with no gradient
    logprobs = torch.tensor([[-6.0, -1.5]], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=torch.zeros(1, 2),
                     mask=torch.ones(1, 2, dtype=torch.bool), ref_logprobs=torch.tensor([[-1.0, -1.0]]))
    loss, _ = get_loss("ppo_clip")(inp, AlgoConfig(kl_ref_coef=1.0, kl_ref_type="k2", kl_ref_clamp=10.0))
    loss.backward()
    assert loss.item() == pytest.approx((10.0 + 0.125) / 2)
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.5 / 2])


def test_a_sequence_ratio_with_a_token_sum_is_said_to_weigh_responses_by_length():
    """TRL's warning: GSPO's ratio on a token-summed loss is not GSPO's per-response objective."""
    from kv4rl.config import load_config

    def said(*overrides):
        return [line for line in load_config(None, list(overrides)).algo.ignored_keys() if "ratio_level" in line]

    for agg in ("token_mean", "token_sum_norm", "seq_mean_token_sum"):
        lines = said("algo.ratio_level=sequence", f"algo.loss_agg={agg}")
        assert lines == [f"algo.ratio_level=sequence gives every token of a response its one ratio, and "
                         f"algo.loss_agg={agg} sums over tokens, so a response weighs by its length instead of "
                         "GSPO's per-response objective; algo.loss_agg=seq_mean is GSPO's (TRL warns alike)"]
    assert said("algo.ratio_level=sequence", "algo.loss_agg=seq_mean") == []
    assert said("algo.loss_agg=token_mean") == []
