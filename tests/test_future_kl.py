"""Future-KL credit: the window sum against loops, and the loss against the exact gradient of
J(θ) = E_π[R] − β·KL(π‖μ) computed by enumerating every sequence of a tabular policy."""

import itertools
import math

import pytest
import torch

from kv4rl.algo import AlgoConfig, LossInputs, future_kl_credit, get_loss

V, T = 3, 3
SEQUENCES = list(itertools.product(range(V), repeat=T))
PREFIXES = [p for n in range(T) for p in itertools.product(range(V), repeat=n)]
PREFIX_INDEX = {p: i for i, p in enumerate(PREFIXES)}


def _credit_loop(c, mask, horizon):
    rows, cols = c.shape
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for t in range(cols):
            if not mask[i, t]:
                continue
            end = cols if horizon is None else min(t + horizon, cols)
            out[i, t] = sum(float(c[i, k]) for k in range(t, end) if mask[i, k])
    return out


def _ragged_mask():
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[0, :9] = True  # full row
    mask[1, :4] = True  # right padding
    mask[2, 3:] = True  # left padding
    mask[3, [0, 1, 4, 5, 6]] = True  # a hole in the middle
    return mask  # row 4: empty


@pytest.mark.parametrize("horizon", [1, 2, 3, 5, 9, 12, None])
def test_credit_matches_loop(horizon):
    gen = torch.Generator().manual_seed(horizon or 0)
    mask = _ragged_mask()
    c = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    c[~mask] = float("nan")  # padding must never be summed
    got = future_kl_credit(c, mask, horizon)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _credit_loop(c, mask, horizon), rtol=0, atol=1e-12)


def test_credit_float32_and_float_mask():
    c = torch.tensor([[0.5, -0.25, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = future_kl_credit(c, mask, 2)
    assert got.dtype == torch.float32
    assert got.tolist() == [[0.25, 0.75, 1.0, 0.0]]


@pytest.mark.parametrize("horizon", [0, -1, 2.5, True])
def test_credit_rejects_bad_horizon(horizon):
    with pytest.raises(ValueError, match="horizon"):
        future_kl_credit(torch.zeros(1, 3), torch.ones(1, 3), horizon)


# ---- exact gradient by enumeration -------------------------------------------------------------


def _all_logprobs(table):
    """[27, T] log-probabilities of every sequence under the prefix-indexed logit table."""
    log_p = torch.log_softmax(table, dim=-1)
    rows = torch.tensor([[PREFIX_INDEX[seq[:t]] for t in range(T)] for seq in SEQUENCES])
    return log_p[rows, torch.tensor(SEQUENCES)]


def _tabular_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(len(PREFIXES), V, generator=gen, dtype=torch.float64).requires_grad_()
    mu_table = torch.randn(len(PREFIXES), V, generator=gen, dtype=torch.float64)
    rewards = torch.randn(len(SEQUENCES), generator=gen, dtype=torch.float64)
    return theta, mu_table, rewards


def _exact_objective_grad(theta, mu_table, rewards, beta):
    logp = _all_logprobs(theta).sum(dim=-1)
    log_mu = _all_logprobs(mu_table).sum(dim=-1)
    objective = (logp.exp() * (rewards - beta * (logp - log_mu))).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def _expected_loss_grad(theta, mu_table, rewards, cfg):
    """Σ_y μ(y)·Π_t ρ_t(y)·∇L(y): the expected gradient of the loss on sequences sampled from μ.

    Each sequence's loss is differentiated w.r.t. its own token log-probs; one chain-rule pass
    then carries the weighted sum back to θ.
    """
    loss_fn = get_loss(cfg.loss)
    logp_all = _all_logprobs(theta)
    log_mu_all = _all_logprobs(mu_table)
    logp_leaf = logp_all.detach().requires_grad_()
    weighted = torch.zeros((), dtype=torch.float64)
    for i, reward in enumerate(rewards):
        weight = log_mu_all[i].sum().exp() * (logp_leaf[i].detach() - log_mu_all[i]).sum().exp()
        inputs = LossInputs(
            logprobs=logp_leaf[i : i + 1],
            behavior_logprobs=log_mu_all[i : i + 1],
            advantages=torch.full((1, T), float(reward), dtype=torch.float64),
            mask=torch.ones(1, T, dtype=torch.bool),
            num_tokens=1.0,  # token_mean over 1 "token": the per-sequence sum Σ_t of the method
        )
        loss, _ = loss_fn(inputs, cfg)
        weighted = weighted + weight * loss
    (grad_logp,) = torch.autograd.grad(weighted, logp_leaf)
    (grad,) = torch.autograd.grad(logp_all, theta, grad_outputs=grad_logp)
    return grad


@pytest.mark.parametrize("seed", [0, 1])
def test_future_kl_is_the_exact_gradient_of_the_kl_regularised_objective(seed):
    beta = 0.7
    theta, mu_table, rewards = _tabular_problem(seed)
    exact = _exact_objective_grad(theta, mu_table, rewards, beta)
    assert exact.abs().max() > 0.05
    cfg = AlgoConfig(loss="future_kl", beta=beta, horizon="full", is_mode="none")
    estimate = _expected_loss_grad(theta, mu_table, rewards, cfg)
    torch.testing.assert_close(estimate, -exact, rtol=0, atol=1e-10)

    for horizon in (3, 5):  # a window covering the whole response is the full tail
        windowed = _expected_loss_grad(
            theta, mu_table, rewards, AlgoConfig(loss="future_kl", beta=beta, horizon=horizon, is_mode="none")
        )
        torch.testing.assert_close(windowed, estimate, rtol=0, atol=1e-12)
    per_token = _expected_loss_grad(
        theta, mu_table, rewards, AlgoConfig(loss="future_kl", beta=beta, horizon=1, is_mode="none")
    )
    assert (per_token - estimate).abs().max() > 1e-3


def test_without_kl_cost_it_is_the_policy_gradient():
    theta, mu_table, rewards = _tabular_problem(2)
    exact = _exact_objective_grad(theta, mu_table, rewards, beta=0.0)
    cfg = AlgoConfig(loss="future_kl", beta=0.0, is_mode="none")
    torch.testing.assert_close(_expected_loss_grad(theta, mu_table, rewards, cfg), -exact, rtol=0, atol=1e-10)


# ---- hand-worked tokens ------------------------------------------------------------------------


def _hand_inputs():
    behavior = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    c = torch.tensor([[0.1, -0.2, 0.3, 0.0]], dtype=torch.float64)
    logprobs = (behavior + c).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = torch.ones(1, 4, dtype=torch.float64)
    return LossInputs(logprobs=logprobs, behavior_logprobs=behavior, advantages=adv, mask=mask)


def test_token_is_window_and_future_cost_clip_by_hand():
    inp = _hand_inputs()
    cfg = AlgoConfig(loss="future_kl", beta=0.5, horizon=2, is_mode="token", is_cap=1.1, future_cost_clip=0.2)
    loss, metrics = get_loss("future_kl")(inp, cfg)
    loss.backward()
    credit = [0.1 - 0.2, -0.2 + 0.3, 0.3]
    clipped = [-0.1, 0.1, 0.2]
    weights = [1.1, math.exp(-0.2), 1.1]  # exp(0.1) and exp(0.3) exceed the cap
    coef = [w * (1 - 0.5 * f) for w, f in zip(weights, clipped)]
    expected_grad = [-g / 3 for g in coef] + [0.0]
    torch.testing.assert_close(inp.logprobs.grad[0], torch.tensor(expected_grad, dtype=torch.float64))
    lp = inp.logprobs.detach()[0, :3].tolist()
    assert loss.item() == pytest.approx(-sum(g * x for g, x in zip(coef, lp)) / 3, abs=1e-12)
    mean = sum(credit) / 3
    assert metrics["future_credit_mean"] == pytest.approx(mean)
    assert metrics["future_credit_std"] == pytest.approx(math.sqrt(sum((f - mean) ** 2 for f in credit) / 3))
    assert metrics["future_credit_absmax"] == pytest.approx(0.3)
    assert metrics["future_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["is_weight_mean"] == pytest.approx(sum(weights) / 3)
    assert metrics["is_weight_max"] == pytest.approx(1.1)
    assert metrics["is_capped_frac"] == pytest.approx(2 / 3)
    assert metrics["log_ratio_mean"] == pytest.approx(0.2 / 3)
    assert metrics["log_ratio_absmax"] == pytest.approx(0.3)


@pytest.mark.parametrize("cap, capped", [(1.5, False), (1.05, True)])
def test_sequence_is_uses_the_geometric_mean_ratio(cap, capped):
    inp = _hand_inputs()
    cfg = AlgoConfig(loss="future_kl", beta=0.0, is_mode="sequence", is_cap=cap)
    loss, metrics = get_loss("future_kl")(inp, cfg)
    loss.backward()
    weight = min(math.exp(0.2 / 3), cap)  # exp(mean of valid c) = exp(0.0667) = 1.069
    torch.testing.assert_close(
        inp.logprobs.grad[0], torch.tensor([-weight / 3] * 3 + [0.0], dtype=torch.float64)
    )
    assert metrics["is_weight_mean"] == pytest.approx(weight)
    assert metrics["is_capped_frac"] == (1.0 if capped else 0.0)
