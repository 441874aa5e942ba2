"""`algo.behavior_rs` (verl's rollout_rs): the rules as verl parses its options and thresholds, the kept tokens
against a per-token float64 reference written from verl's definitions (and a hand-worked case), and the learner's
step with rejection against the same step on a batch whose rejected tokens were masked by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.algo.rejection import REJECTION_OPTIONS, rejection_keep, rejection_rules
from kv4rl.config import load_config
from kv4rl.config_loader import ConfigError
from kv4rl.loop import train
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner


def _reference_keep(log_r: list[list[float]], lengths: list[int], option: str, spec: str) -> list[list[bool]]:
    """verl's compute_rollout_rejection_mask written out per token: log r held to ±20; k1 = −log r within
    [log lower, log upper] (one number u: [1/u, u]); k2 = ½ log² r and k3 = e^{log r} − 1 − log r at most the bound;
    per token, or the sum / mean / max of the response's tokens."""
    level, estimator = option.rsplit("_", 1)
    if estimator == "k1":
        lower, upper = (map(float, spec.split("_")) if "_" in spec else (1 / float(spec), float(spec)))
        lo, hi = math.log(lower), math.log(upper)
    else:
        lo, hi = -math.inf, float(spec)
    out = []
    for row, n in zip(log_r, lengths):
        values = []
        for x in row[:n]:
            x = min(max(x, -20.0), 20.0)
            values.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator])
        if level == "token":
            keep = [lo <= v <= hi for v in values]
        else:
            stat = {"seq_sum": sum(values), "seq_mean": sum(values) / n, "seq_max": max(values)}[level]
            keep = [lo <= stat <= hi] * n
        out.append(keep + [False] * (len(row) - n))
    return out


SPECS = {"k1": "0.7_1.3", "k2": "0.05", "k3": "0.04"}
SUM_SPECS = {"k1": "0.4_1.2", "k2": "0.3", "k3": "0.25"}  # a response's sum: wider bounds
MAX_SPECS = {"k2": "0.15", "k3": "0.12"}


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_each_option_keeps_what_verls_definition_keeps(option):
    gen = torch.Generator().manual_seed(REJECTION_OPTIONS.index(option))
    lengths = [7, 1, 4, 7, 5, 2]
    valid = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    behavior = old - torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.35
    behavior[0, 3] = old[0, 3] + 30.0  # past verl's ±20 hold
    behavior[~valid] = math.nan  # padding must not reach a statistic
    spec = {"seq_sum": SUM_SPECS, "seq_max": MAX_SPECS}.get(option.rsplit("_", 1)[0], SPECS)[option[-2:]]
    keep, stats = rejection_keep(old, behavior, valid, rejection_rules(option, spec))
    log_r = torch.where(valid, old - behavior, 0.0).tolist()
    want = torch.tensor(_reference_keep(log_r, lengths, option, spec))
    assert torch.equal(keep, want)
    assert 0 < int(want.sum()) < int(valid.sum())  # some kept, some rejected: a real comparison
    rejected = valid & ~want
    assert float(stats["behavior_rs_frac"]) == pytest.approx(float(rejected.sum()) / float(valid.sum()))
    assert float(stats["behavior_rs_seq_frac"]) == pytest.approx(float(rejected.any(1).sum()) / 6)


def test_a_hand_worked_token_k1_and_its_bounds_on_minus_log_r():
    """log r = log π_old − log μ = [0.1, −1.0, 0.5]: −log r = [−0.1, 1.0, −0.5] against [log 0.5, log 2] keeps the
    first and last. With 0.6_1.4 (not symmetric) the bounds act on μ/π_old as verl's do: r = 0.65 (μ/π_old = 1.54)
    is rejected and r = 1.5 (0.67) kept, the opposite of bounds on r. verl holds log r to ±20 first."""
    valid = torch.ones(1, 3, dtype=torch.bool)
    old = torch.tensor([[0.1, -1.0, 0.5]], dtype=torch.float64)
    keep, stats = rejection_keep(old, torch.zeros_like(old), valid, rejection_rules("token_k1", 2.0))
    assert keep.tolist() == [[True, False, True]] and float(stats["behavior_rs_frac"]) == pytest.approx(1 / 3)
    old = torch.log(torch.tensor([[0.65, 1.5, 1.0]], dtype=torch.float64))
    keep, _ = rejection_keep(old, torch.zeros_like(old), valid, rejection_rules("token_k1", "0.6_1.4"))
    assert keep.tolist() == [[False, True, True]]
    # log r = [25, −24] held to [20, −20]: −Σ log r = 0 is kept (held to nothing, −1 would be below log 0.5)
    keep, _ = rejection_keep(torch.tensor([[25.0, -24.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                             rejection_rules("seq_sum_k1", 2.0))
    assert keep.tolist() == [[True, True]]


def test_every_option_must_keep_a_token_and_thresholds_pair_with_options():
    valid = torch.ones(2, 3, dtype=torch.bool)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.3, 0.3, 0.3]], dtype=torch.float64)
    behavior = torch.tensor([[0.0, 0.0, 0.9], [0.0, 0.0, 0.0]], dtype=torch.float64)
    # token_k2 at 0.1 drops row 0's last token (½·0.81), which seq_sum_k1 at 0.5_2.6 keeps (−Σ log r = 0.9 below
    # log 2.6 = 0.956); seq_sum_k1 drops row 1 (−Σ log r = −0.9 < log 0.5 = −0.693)
    rules = rejection_rules("token_k2, seq_sum_k1,token_k2", "0.1,0.5_2.6")
    assert [r.option for r in rules] == ["token_k2", "seq_sum_k1"]
    keep, stats = rejection_keep(old, behavior, valid, rules)
    assert keep.tolist() == [[True, True, False], [False, False, False]]
    assert float(stats["behavior_rs_seq_frac"]) == 1.0


@pytest.mark.parametrize("options,thresholds,message", [
    ("token_k4", 2.0, "unknown option 'token_k4'"),
    ("seq_max_k1", 2.0, "unknown option 'seq_max_k1'"),  # verl has no max of k1 either
    (" , ", 2.0, "names no option"),
    ("token_k1", None, "needs algo.behavior_rs_threshold"),
    ("token_k1,token_k3", "2,3,4", "3 thresholds for 2 options"),
    ("token_k3", "0.5_2", "is not one number (k2 and k3 have no lower bound)"),
    ("token_k1", "2_0.5", "the lower bound 2 must be below the upper 0.5"),
    ("token_k1", 0.8, "the lower bound 1.25 must be below the upper 0.8"),
    ("token_k1", "0_2", "must be positive"),
    ("token_k2", "-1", "must be positive"),
    ("token_k2", "nan", "must be positive"),
    ("token_k1", "1_2_3", "has 3 bounds; k1 takes `lower_upper` or one number"),
    ("token_k1", "inf", "the lower bound 0 must be a positive number below inf"),
    ("token_k1", "a_b", "is not `lower_upper` or one number"),
])
def test_bad_rules_are_refused_by_name(options, thresholds, message):
    with pytest.raises(ValueError, match="algo.behavior_rs") as info:
        rejection_rules(options, thresholds)
    assert message in str(info.value)


def test_the_config_refuses_yaml_numbers_that_drop_an_underscore():
    with pytest.raises(ConfigError, match="'0.5_2' is read by YAML as the number 0.52"):
        load_config(overrides=["algo.behavior_rs=token_k1", "algo.behavior_rs_threshold=0.5_2"])
    with pytest.raises(ConfigError, match="'1_2' is read by YAML as the number 12"):
        load_config(overrides=["algo.behavior_rs=token_k1", "algo.behavior_rs_threshold=1_2"])
    cfg = load_config(overrides=["algo.behavior_rs=token_k1", "algo.behavior_rs_threshold='0.5_2'",
                                 "algo.old_logprob=recompute"])
    assert cfg.algo.behavior_rs_threshold == "0.5_2"


PROMPTS = ([3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13])
RESPONSES = ([20, 21, 22, 23], [24, 25], [26, 27, 28, 29, 30, 31], [32, 33, 34])
ADVANTAGES = [1.0, -0.5, 0.75, -1.25]


def _batch(behavior=None):
    lp = behavior or [[-1.0] * len(r) for r in RESPONSES]
    return build_batch([list(p) for p in PROMPTS], [list(r) for r in RESPONSES], lp,
                       [[0] * len(r) for r in RESPONSES], ADVANTAGES, pad_id=0)


def _learner(path, agg, **rs):
    torch.manual_seed(0)
    algo = AlgoConfig(loss_agg=agg, old_logprob="recompute", entropy_coeff=0.01, **rs)
    return Learner(path, None, algo=algo, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=2, updates_per_batch=1, temperature=1.0, device=torch.device("cpu"), max_new_tokens=8)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("options,threshold", [("token_k1", 2.0), ("seq_max_k3,token_k2", "0.5,1.0")])
def test_a_step_with_rejection_is_the_step_on_the_batch_with_those_tokens_masked(tiny_qwen3, agg, options, threshold):
    """μ is π_old shifted by hand at a few tokens: the rejected ones leave every term and denominator (the entropy
    bonus's too), so the step equals one without rejection on the batch whose mask drops them."""
    path, _ = tiny_qwen3
    rejecting, plain = _learner(path, agg, behavior_rs=options, behavior_rs_threshold=threshold), _learner(path, agg)
    old = plain.logprobs(_batch())  # π_old: the recomputed log-probs of the unchanged weights
    shift = torch.zeros_like(old)
    shift[0, 3], shift[2, 5], shift[3, 2] = 1.5, -1.2, 0.4  # row 0's 2nd, row 2's 3rd and row 3's 1st token
    batch = _batch()
    behavior = torch.where(batch.response_mask.bool(), old + shift, 0.0)
    batch.behavior_logprobs = behavior.float()
    keep, _ = rejection_keep(old, behavior, batch.response_mask.bool(), rejection_rules(options, threshold))
    dropped = int(batch.response_mask.sum()) - int(keep.sum())
    assert 0 < dropped < batch.num_tokens
    masked = _batch()
    masked.behavior_logprobs = behavior.float()
    masked.response_mask = masked.response_mask * keep

    a, b = rejecting.step(batch), plain.step(masked)
    grads_a, grads_b = rejecting.named_grads(), plain.named_grads()
    for name, grad in grads_b.items():
        torch.testing.assert_close(grads_a[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for key in ("loss", "grad_norm", "num_tokens", "entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert a["behavior_rs_frac"] == pytest.approx(dropped / batch.num_tokens)
    assert a["behavior_rs_seq_frac"] == pytest.approx(float((~keep & batch.response_mask.bool()).any(1).sum()) / 4)
    assert "behavior_rs_frac" not in b
    whole = _learner(path, agg).step(batch)  # no rejection: its mismatch is over every sampled token, as a's
    for key in ("mismatch_k3", "mismatch_abs_mean", "mismatch_absmax"):
        assert a[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-9), key
    assert a["mismatch_absmax"] > b["mismatch_absmax"]  # the kept tokens alone would not show the rejected gaps
    unrejected = _learner(path, agg)
    unrejected.step(batch)  # the same batch, nothing rejected: another gradient, so the comparison can fail
    assert any(not torch.allclose(g, unrejected.named_grads()[n], rtol=1e-4, atol=1e-6) for n, g in grads_a.items())


def test_verls_keys_point_at_these():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["algorithm.rollout_correction.rollout_rs=token_k1",
                               "algorithm.rollout_correction.rollout_rs_threshold=2.0"])
    assert "rollout_rs is algo.behavior_rs" in str(info.value)
    assert "rollout_rs_threshold is algo.behavior_rs_threshold" in str(info.value)


def test_a_responses_importance_weight_reads_its_rejected_tokens_too(tiny_qwen3):
    """verl weighs before it rejects: with algo.behavior_is=sequence_truncate a response's weight is the product of
    π_old/μ over all its sampled tokens, those token_k1 rejects included, on the tokens that stay."""
    path, _ = tiny_qwen3
    learner = _learner(path, "token_mean", behavior_rs="token_k1", behavior_rs_threshold=2.0,
                       behavior_is="sequence_truncate", behavior_is_max=1e9)
    old = _learner(path, "token_mean").logprobs(_batch()).double()
    batch = _batch()
    valid = batch.response_mask.bool()
    shift = torch.zeros_like(old)
    shift[0, 3], shift[0, 4], shift[3, 3] = 1.5, 0.3, -0.2  # row 0's 2nd token rejected (log r = −1.5)
    behavior = torch.where(valid, old + shift, 0.0)
    batch.behavior_logprobs = behavior.float()
    keep, _ = rejection_keep(old, behavior, valid, rejection_rules("token_k1", 2.0))
    assert int(valid.sum()) - int(keep.sum()) == 1
    row_weight = torch.exp(torch.where(valid, old - batch.behavior_logprobs.double(), 0.0).sum(1))  # every token
    want = float((row_weight[:, None] * keep).sum() / keep.sum())
    kept_only = torch.exp(torch.where(keep, old - batch.behavior_logprobs.double(), 0.0).sum(1))
    assert abs(float((kept_only[:, None] * keep).sum() / keep.sum()) - want) > 0.05  # the two readings differ
    assert learner.step(batch)["behavior_is_mean"] == pytest.approx(want, rel=1e-5)


def test_an_upper_bound_may_be_infinite_as_verls():
    valid = torch.ones(1, 3, dtype=torch.bool)
    old = torch.tensor([[3.0, -3.0, 0.0]], dtype=torch.float64)
    keep, _ = rejection_keep(old, torch.zeros_like(old), valid, rejection_rules("token_k1", "2_inf"))
    assert keep.tolist() == [[False, True, False]]  # −log r = −3 and 0 are below log 2; 3 has no upper bound
    keep, _ = rejection_keep(old, torch.zeros_like(old), valid, rejection_rules("token_k3", "inf"))
    assert keep.all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_bypass_mode_drops_from_the_surrogate_the_tokens_whose_policy_strayed_from_mu(agg):
    """verl's bypass mode (algo.old_logprob=behavior): each pass judges π_θ against μ and its rejected tokens leave the
    clipped surrogate, the batch's denominators unchanged (verl's agg_loss with the global token and sequence
    counts, a sequence's mean over its kept tokens). Against that written out in float64, value and gradient."""
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 3, 6, 1]
    valid = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    behavior = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2
    logp = (behavior + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.6).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64)[:, None].expand(4, 6) * valid
    n_tokens, n_seqs = 40.0, 9.0  # the whole batch's, as the learner passes them
    algo = AlgoConfig(loss_agg=agg, behavior_rs="token_k1", behavior_rs_threshold=1.6)
    inp = LossInputs(logprobs=logp, advantages=adv, mask=valid.double(), behavior_logprobs=behavior,
                     num_tokens=n_tokens, num_seqs=n_seqs)
    loss, metrics = get_loss("ppo_clip")(inp, algo)

    want, kept, rejected = torch.zeros((), dtype=torch.float64), 0, 0
    for i, n in enumerate(lengths):
        row, row_kept = torch.zeros((), dtype=torch.float64), 0
        for t in range(n):
            log_r = float(logp[i, t] - behavior[i, t])
            if not math.log(1 / 1.6) <= -log_r <= math.log(1.6):
                rejected += 1
                continue
            ratio = torch.exp(logp[i, t] - behavior[i, t])
            a = float(adv[i, t])
            row = row - torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            row_kept += 1
        kept += row_kept
        want = want + (row if agg == "token_mean" else row / max(row_kept, 1))
    want = want / (n_tokens if agg == "token_mean" else n_seqs)
    assert 0 < rejected < sum(lengths)
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    (got_grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    assert metrics["behavior_rs_frac"] == pytest.approx(rejected / sum(lengths))


def test_bypass_mode_rejection_is_the_losss_and_runs_in_a_training(tmp_path):
    cfg = load_config(overrides=["algo.behavior_rs=token_k1", "algo.behavior_rs_threshold=2"])
    assert cfg.algo.old_logprob == "behavior"  # not refused: the loss judges π_θ against μ
    cfg = load_config(overrides=["algo.behavior_rs=token_k2", "algo.behavior_rs_threshold=0.0005",
                                 "engine.kv.format=int4", "engine.kv.group_size=32", "trainer.iterations=1",
                                 f"out_dir={tmp_path}", "name=run"])
    train(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < row["behavior_rs_frac"] < 1  # INT4 keys and values: μ differs from π_θ, some tokens past the bound


def test_a_sequence_ratio_in_bypass_mode_is_over_the_kept_tokens():
    """GSPO's ratio (algo.ratio_level=sequence) of a response with a rejected token is the exp of its kept tokens'
    mean log-ratio, so the rejected token has no gradient, as in decoupled mode where it left the mask."""
    behavior = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = torch.tensor([[-0.9, -2.5, -1.1, -0.8]], dtype=torch.float64, requires_grad=True)  # the 2nd: log r = −1.5
    valid = torch.ones(1, 4)
    adv = torch.full((1, 4), 0.7, dtype=torch.float64)
    algo = AlgoConfig(ratio_level="sequence", behavior_rs="token_k1", behavior_rs_threshold=2.0, eps_high=10.0)
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=adv, mask=valid,
                                                    behavior_logprobs=behavior), algo)
    kept = [0, 2, 3]
    ratio = torch.exp((logp[0, kept] - behavior[0, kept]).mean())  # unclipped: 1 + eps_high is far above it
    torch.testing.assert_close(loss, -(ratio * 0.7 * 3) / 3, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1] == 0 and (grad[0, kept] != 0).all()
    assert metrics["behavior_rs_frac"] == 0.25


def test_openrlhfs_seq_mask_tis_is_seq_mean_k1_at_the_reciprocal_bounds():
    """README's recipe: OpenRLHF keeps a response while exp(mean log r) is in [low, high]; seq_mean_k1 bounds
    −mean log r by [log lower, log upper], so lower = 1/high and upper = 1/low keep the same responses."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(200, 5, generator=gen, dtype=torch.float64)
    behavior = old + torch.randn(200, 5, generator=gen, dtype=torch.float64) * 1.2
    valid = torch.ones(200, 5, dtype=torch.bool)
    low, high = 0.7, 1.6
    keep, _ = rejection_keep(old, behavior, valid, rejection_rules("seq_mean_k1", f"{1 / high}_{1 / low}"))
    geometric = [math.exp(sum(row) / 5) for row in (old - behavior).tolist()]
    want = torch.tensor([[low <= g <= high] * 5 for g in geometric])
    assert torch.equal(keep, want) and 20 < int(want[:, 0].sum()) < 180


def test_vespos_response_weight_in_bypass_mode_reads_the_kept_tokens():
    """μ = −1 everywhere; π_θ equals it but at one token (log π = 2), which token_k1 rejects: the response's weight is
    over the three kept tokens (w = 1, φ(1) = 1), not 0 from the rejected one's ratio e^3. Loss: −(3 · 1 · −1) / 4."""
    behavior = torch.full((1, 4), -1.0, dtype=torch.float64)
    logp = torch.tensor([[-1.0, 2.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    algo = AlgoConfig(surrogate="vespo", behavior_rs="token_k1", behavior_rs_threshold=2.0)
    loss, metrics = get_loss("ppo_clip")(LossInputs(logprobs=logp, advantages=torch.ones(1, 4, dtype=torch.float64),
                                                    mask=torch.ones(1, 4), behavior_logprobs=behavior,
                                                    num_tokens=4.0), algo)  # the batch's count, as the learner's
    assert loss.item() == pytest.approx(0.75, rel=1e-12) and metrics["vespo_weight_mean"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == [[-0.25, 0.0, -0.25, -0.25]]
