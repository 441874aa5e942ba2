"""`algo.entropy_coeff` (verl's entropy_coeff): the learner's loss minus that many times the policy's entropy,
aggregated as the loss. The torch head's entropy gradient against float64 autograd, and a learner step against
verl's formula written out in float64 on the same model (`pg_loss - entropy_coeff * agg_loss(entropy)`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import token_logprobs_and_entropy
from kv4rl.config import load_config
from kv4rl.trainer.learner import Learner
from tests.test_learner_fsdp import ragged_batch


def plain_logprobs_and_entropy(logits, ids, temperature):
    """The textbook formulas on a float64 autograd graph."""
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1), ent


@pytest.mark.parametrize("use", ["both", "entropy", "logprobs"])
def test_logprobs_and_entropy_match_float64_autograd(use, gen):
    logits = 2.5 * torch.randn(3, 5, 37, generator=gen, dtype=torch.float64)
    logits[0, 1, 4] = logits[2, 3, 36] = float("-inf")  # a masked vocabulary entry: p = 0, no NaN anywhere
    ids = torch.randint(0, 37, (3, 5), generator=gen)
    ids[0, 1] = ids[2, 3] = 0  # never the masked entries themselves (their log-prob is -inf)
    w_logp, w_ent = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen,
                                                                                       dtype=torch.float64)

    def weighted(logp, ent):
        return {"both": (logp * w_logp).sum() + (ent * w_ent).sum(), "entropy": (ent * w_ent).sum(),
                "logprobs": (logp * w_logp).sum()}[use]

    ours = logits.clone().requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(ours, ids, 0.7, chunk_tokens=2)  # chunks cut rows apart
    weighted(logp, ent).backward()
    # autograd's 0 * -inf makes NaN in the reference itself: there the masked entry is -1e4, whose p is 0 in float64
    ref = logits.nan_to_num(neginf=-1e4).requires_grad_(True)
    ref_logp, ref_ent = plain_logprobs_and_entropy(ref, ids, 0.7)
    weighted(ref_logp, ref_ent).backward()
    torch.testing.assert_close(logp.detach(), ref_logp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=0, atol=1e-12)
    assert torch.isfinite(ours.grad).all()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-12)


def verl_agg_loss(loss_mat, mask, mode, norm_tokens):
    """verl's agg_loss (core_algos.py) for the four modes, with the full batch's denominators."""
    if mode == "token_mean":
        return (loss_mat * mask).sum() / mask.sum()
    rows = mask.sum(-1) > 0
    if mode == "seq_mean":  # verl's seq-mean-token-mean
        return ((loss_mat * mask).sum(-1)[rows] / mask.sum(-1)[rows]).mean()
    if mode == "seq_mean_token_sum":  # verl's seq-mean-token-sum
        return (loss_mat * mask).sum(-1)[rows].mean()
    return (loss_mat * mask).sum() / (rows.sum() * norm_tokens)  # seq-mean-token-sum-norm


def verl_step(path, batch, coeff, mode, norm_tokens, eps=0.2):
    """verl's dp_actor update on one mini-batch: PPO-clip pg_loss minus entropy_coeff x the aggregated entropy;
    (loss, gradient by parameter name)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp, ent = plain_logprobs_and_entropy(logits, batch.input_ids[:, 1:], 1.0)
    mask, adv = batch.response_mask.double(), batch.advantages.double()
    ratio = torch.exp(logp - batch.behavior_logprobs.double())
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    loss = verl_agg_loss(pg, mask, mode, norm_tokens) - coeff * verl_agg_loss(ent, mask, mode, norm_tokens)
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "token_sum_norm", "seq_mean_token_sum"])
@pytest.mark.parametrize("layout", [{"micro_batch_size": 1}, {"micro_batch_size": 4}, {"max_tokens_per_micro_batch": 9}])
@pytest.mark.parametrize("coeff", [0.3, -0.3])  # a bonus, or entropy minimisation
def test_a_step_takes_verls_loss_with_the_entropy_bonus(tiny_qwen3, agg, layout, coeff):
    path, _ = tiny_qwen3
    kw = {"micro_batch_size": 2, **layout}
    learner = Learner(path, None, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=1,
                      temperature=1.0, device=torch.device("cpu"), fsdp=False,
                      algo=AlgoConfig(loss_agg=agg, entropy_coeff=coeff), max_new_tokens=6, **kw)
    batch = ragged_batch(3)
    batch.behavior_logprobs = (learner.logprobs(batch) - 0.05) * batch.response_mask  # ratios ~1.05: inside the clip
    want_loss, want = verl_step(path, batch, coeff, agg, 6)
    _, without_bonus = verl_step(path, batch, 0.0, agg, 6)
    metrics = learner.step(batch)  # grad_clip 1e9: the gradients stay as the loss made them
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    tol = 1e-5 * max(g.abs().max().item() for g in want.values())
    bonus_part = max((want[n] - without_bonus[n]).abs().max().item() for n in want)
    assert bonus_part > 100 * tol  # a step without the bonus would fail below
    for name, param in learner.model.named_parameters():
        torch.testing.assert_close(param.grad.double(), want[name], rtol=0, atol=tol, msg=name)


def test_the_coefficient_is_checked_and_has_its_config_key():
    assert AlgoConfig().entropy_coeff == 0.0  # off unless asked for, as in verl's recent defaults
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="algo.entropy_coeff must be a finite number"):
            AlgoConfig(entropy_coeff=bad).validate()
    AlgoConfig(entropy_coeff=-0.01).validate()  # entropy minimisation, as verl allows
    cfg = load_config(None, ["algo.entropy_coeff=0.001"])
    assert cfg.algo.entropy_coeff == 0.001
