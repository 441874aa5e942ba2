"""Edges of the objectives, metrics and formats that the main tests left open, each worked by hand: a
mutation of the code (a one-sided clip, a float32 credit, a NaN on an empty micro-batch, a metric's wrong
tokens or wrong std) passed every other test."""

import math

import pytest
import torch

from kv4rl.algo import AlgoConfig, LossInputs, entropy_from_logits, future_kl_credit, get_loss
from kv4rl.algo.advantages import compute_advantages, grpo_advantages
from kv4rl.algo.aggregation import aggregate
from kv4rl.algo.config import AdvantageConfig
from kv4rl.eval.runner import ProblemResult, summarize_results
from kv4rl.quant.hadamard import hadamard_matrix, rotate


def test_future_cost_clip_holds_a_negative_credit_at_minus_the_clip():
    """Window 1: F = c = [-0.5, 0], clipped to [-0.2, 0]; g = A - beta clip(F) = [1.2, 1.0]; with the batch's
    token count given as 1 the gradient of -sum(g log pi) / 1 is -g = [-1.2, -1.0] (-1.5 unclipped)."""
    behavior = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    c = torch.tensor([[-0.5, 0.0]], dtype=torch.float64)
    logprobs = (behavior + c).requires_grad_()
    inp = LossInputs(logprobs=logprobs, behavior_logprobs=behavior, advantages=torch.ones(1, 2, dtype=torch.float64),
                     mask=torch.ones(1, 2), num_tokens=1.0)
    cfg = AlgoConfig(loss="future_kl", beta=1.0, is_mode="none", future_cost_clip=0.2, horizon=1)
    loss, metrics = get_loss("future_kl")(inp, cfg)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.2, -1.0]], dtype=torch.float64))
    assert metrics["future_clip_frac"] == pytest.approx(0.5)


def test_the_credit_of_float32_log_ratios_is_summed_in_float64():
    """4,096 tokens of c = 1 after c0 = 1e-3, window 1: F0 = c0 exactly; a float32 reverse cumulative sum
    minus its shifted copy loses it to 4096's rounding (0.0009765625)."""
    c = torch.ones(1, 4096)
    c[0, 0] = 1e-3
    credit = future_kl_credit(c, torch.ones(1, 4096), horizon=1)
    assert credit.dtype == torch.float32
    assert credit[0, 0].item() == pytest.approx(1e-3, rel=1e-6)
    assert torch.equal(credit[0, 1:], torch.ones(4095))


def test_token_mean_of_an_all_padding_input_is_zero_not_nan():
    """The docstring's denominator is 'valid tokens here, at least 1' (plug-in losses call it so)."""
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "token_mean").item() == 0.0
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "seq_mean").item() == 0.0


@pytest.mark.parametrize("loss", ["ppo_clip", "future_kl"])
def test_an_empty_micro_batch_reports_zero_metrics(loss):
    """The losses' docstring: an empty micro-batch reports 0 (a NaN would spread through combine_metrics,
    NaN x 0 weight being NaN)."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logprobs=lp, behavior_logprobs=lp.detach() - 0.1, old_logprobs=lp.detach() - 0.1,
                     advantages=torch.ones(1, 2, dtype=torch.float64), mask=torch.zeros(1, 2))
    value, metrics = get_loss(loss)(inp, AlgoConfig(loss=loss))
    assert value.item() == 0.0
    assert metrics and all(v == 0.0 for v in metrics.values()), metrics


def test_dual_clip_frac_counts_negative_advantage_tokens_whose_ratio_passes_c():
    """Ratios [4, 4, 2], A = -1, c = 3: two of three tokens are held by the dual clip."""
    behavior = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.log(torch.tensor([[4.0, 4.0, 2.0]], dtype=torch.float64)).requires_grad_()
    inp = LossInputs(logprobs=lp, behavior_logprobs=behavior, advantages=-torch.ones(1, 3, dtype=torch.float64),
                     mask=torch.ones(1, 3))
    _, metrics = get_loss("ppo_clip")(inp, AlgoConfig(loss="ppo_clip", dual_clip=3.0))
    assert metrics["dual_clip_frac"] == pytest.approx(2 / 3)


def test_entropy_of_logits_with_minus_infinity_is_that_of_the_rest():
    """A masked-out vocabulary entry (-inf logit): 0 x log 0 is 0, so two equal logits give ln 2."""
    got = entropy_from_logits(torch.tensor([[[0.0, 0.0, -math.inf]]]))
    assert got.item() == pytest.approx(math.log(2))


def test_eval_summary_counts_a_sample_correct_only_above_half_and_reports_pass_at_4_for_k_6():
    """A reward of exactly 0.5 is not correct; k = 6 reports pass@1, 2, 4 and 6 ('pass@j for j in 1, 2, 4..k')."""
    results = [ProblemResult(index=0, scores=[1, 0, 0, 0, 0, 0], lengths=[1] * 6, texts=[""] * 6),
               ProblemResult(index=1, scores=[0.5] * 6, lengths=[1] * 6, texts=[""] * 6)]
    out = summarize_results(results, 6, {})
    assert out["mean@6"] == pytest.approx(1 / 12)
    assert out["score_mean"] == pytest.approx((1 + 6 * 0.5) / 12)  # verl's reward/mean@N: the raw scores' mean
    assert {key for key in out if key.startswith("pass@")} == {"pass@1", "pass@2", "pass@4", "pass@6"}
    assert out["pass@4"] == pytest.approx((1 - math.comb(5, 4) / math.comb(6, 4)) / 2)  # Codex estimator


def test_a_bf16_rotation_is_computed_in_float32_and_rounded_once():
    """Rounded once from float32 it equals the float64 rotation rounded to bf16 but for rare ties; a bf16
    product rounds every partial sum (165 of 8,192 entries off at this seed, against 1)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = (x.double() @ hadamard_matrix(128, torch.float64, x.device)).to(torch.bfloat16)
    assert (rotate(x) != exact).sum().item() <= 4


def test_flat_groups_get_exactly_zero_advantage_with_float64_rewards():
    """0.1 three times: the group mean is not exactly 0.1 in float64, so r - mean is ~1e-17, and divided by
    std + 1e-6 ~1e-11; a flat group is set to zero, not left at the rounding."""
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0], dtype=torch.float64), 3)
    assert torch.equal(adv[:3], torch.zeros(3, dtype=torch.float64))


def test_reward_and_advantage_metrics_by_hand():
    """Rewards [1, 1, 0]: reward_std is the population std sqrt(2/9); the advantages (r - 2/3) / (s + 1e-6)
    with s = sqrt(1/3) are [0.577, 0.577, -1.155]: adv_absmax 1.155 (not the max 0.577), adv_std their
    population std."""
    _, metrics = compute_advantages(torch.tensor([1.0, 1.0, 0.0]), 3, AdvantageConfig())
    s = math.sqrt(1 / 3)
    adv = [(r - 2 / 3) / (s + 1e-6) for r in (1.0, 1.0, 0.0)]
    mean = sum(adv) / 3
    assert metrics["reward_std"] == pytest.approx(math.sqrt(2 / 9))
    assert metrics["adv_absmax"] == pytest.approx(abs(adv[2]), rel=1e-6)
    assert metrics["adv_std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in adv) / 3), rel=1e-6)


def test_kv4_bytes_read_counts_int4_pages_past_the_protected_rows_and_int8_rows_within():
    """Against the cache's own tensors: a page row per KV head is its codes, scale and zero (K and V), a
    protected row its INT8 codes and scale; the first n_sink + n_recent positions are read as INT8."""
    from tests.kernel_cases import make_format, random_paged_batch

    fmt = make_format("kv4", 32, n_sink=2, n_recent=5)
    cache, _ = random_paged_batch(fmt, [3, 20], 2, 32, 4, "cpu", torch.Generator().manual_seed(0))
    page = sum(t[0, 0].nbytes for key, t in cache.items() if key.startswith("k_") and "prot" not in key)
    side = sum(t[0, 0].nbytes for key, t in cache.items() if key.startswith("k_prot"))
    assert (page, side) == (16 + 2 + 2, 32 + 4)
    for length in (1, 7, 8, 20, 1000):
        protected = min(length, 2 + 5)
        assert fmt.bytes_read(2, 32, length) == 2 * 2 * ((length - protected) * page + protected * side), length
