"""`algo.top_entropy_quantile` (TRL's, "Beyond the 80/20 Rule"): the loss keeps each learner pass's tokens whose
entropy is at least the (1 − ρ) quantile over every rank, the rest count in the denominators only. Against a
hand-worked case, TRL's formula written out in float64, and two gloo ranks against one process."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.entropy_tokens import high_entropy_tokens
from kv4rl.trainer.learner import Learner
from tests.conftest import make_checkpoint
from tests.gloo_ranks import run_on_gloo_ranks
from tests.test_entropy_bonus import plain_logprobs_and_entropy, verl_agg_loss
from tests.test_learner_data_parallel import batch as dp_batch
from tests.test_learner_fsdp import ragged_batch

ENTROPY = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # the padded 5.0s are never kept nor counted


@pytest.mark.parametrize(("rho", "kept"), [
    # valid entropies sorted: 0.1 0.2 0.3 0.5 0.7 0.9; the (1 - rho) quantile interpolates linearly between them
    (0.5, [[0, 1, 1, 0], [1, 0, 0, 0]]),  # position 2.5: 0.3 + 0.5 x 0.2 = 0.4
    (1.0, [[1, 1, 1, 1], [1, 1, 0, 0]]),  # the minimum: every valid token
    (0.0, [[0, 0, 1, 0], [0, 0, 0, 0]]),  # the maximum alone
    (0.2, [[0, 0, 1, 0], [1, 0, 0, 0]]),  # position 4.0: 0.7 itself, and 0.7 >= 0.7 keeps it
])
def test_the_threshold_is_the_quantile_of_the_valid_tokens(rho, kept):
    assert high_entropy_tokens(None, 1, ENTROPY, MASK, rho).int().tolist() == kept
    assert not high_entropy_tokens(None, 1, ENTROPY, torch.zeros_like(MASK), 0.5).any()


def trl_step(path, batch, rho, mode, ref=None, beta=0.0):
    """TRL's compute_loss on one micro-batch: per-token PPO-clip terms times the high-entropy mask (threshold over
    the micro-batch's valid tokens), then beta x the k3 KL to `ref` on every token, aggregated with the full
    completion mask; (loss, gradients by name, the kept tokens)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp, ent = plain_logprobs_and_entropy(logits, batch.input_ids[:, 1:], 1.0)
    mask, adv = batch.response_mask.double(), batch.advantages.double()
    threshold = torch.quantile(ent.detach()[mask.bool()], 1 - rho)
    keep = (ent.detach() >= threshold) & mask.bool()
    ratio = torch.exp(logp - batch.behavior_logprobs.double())
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * keep
    if ref is not None:  # TRL adds the KL after its entropy mask
        with torch.no_grad():
            ref_model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float64)
            ref_logits = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            ref_logp, _ = plain_logprobs_and_entropy(ref_logits, batch.input_ids[:, 1:], 1.0)
        per_token = per_token + beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    loss = verl_agg_loss(per_token, mask, mode, 6)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, keep


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "token_sum_norm"])
def test_a_step_takes_trls_loss_on_the_high_entropy_tokens(tiny_qwen3, agg):
    path, _ = tiny_qwen3
    learner = Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, micro_batch_size=4,
                      updates_per_batch=1, temperature=1.0, device=torch.device("cpu"), fsdp=False, max_new_tokens=6,
                      algo=AlgoConfig(loss_agg=agg, top_entropy_quantile=0.4))
    batch = ragged_batch(5)
    batch.behavior_logprobs = (learner.logprobs(batch) - 0.05) * batch.response_mask
    want_loss, want, keep = trl_step(path, batch, 0.4, agg)
    assert 0 < keep.sum() < batch.response_mask.sum()  # some tokens kept, some left out
    metrics = learner.step(batch)
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    _, every_token, _ = trl_step(path, batch, 1.0, agg)
    tol = 1e-5 * max(g.abs().max().item() for g in want.values())
    assert max((want[n] - every_token[n]).abs().max().item() for n in want) > 100 * tol  # the filter shows
    for name, param in learner.model.named_parameters():
        torch.testing.assert_close(param.grad.double(), want[name], rtol=0, atol=tol, msg=name)


def test_the_reference_kl_counts_on_every_token_as_trls_does(tiny_qwen3, tmp_path):
    """TRL adds beta x KL after multiplying by the entropy mask: a filtered KL pulled ~rho times as hard (QA)."""
    path, _ = tiny_qwen3
    ref = tmp_path / "ref"
    make_checkpoint(ref, seed=7)  # another model: the KL and its gradient are not 0 at the first step
    learner = Learner(path, ref, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, micro_batch_size=4,
                      updates_per_batch=1, temperature=1.0, device=torch.device("cpu"), fsdp=False,
                      algo=AlgoConfig(top_entropy_quantile=0.3, kl_ref_coef=0.5))
    batch = ragged_batch(5)
    batch.behavior_logprobs = (learner.logprobs(batch) - 0.05) * batch.response_mask
    want_loss, want, _ = trl_step(path, batch, 0.3, "token_mean", ref=ref, beta=0.5)
    assert learner.step(batch)["loss"] == pytest.approx(want_loss, rel=1e-5)
    tol = 1e-5 * max(g.abs().max().item() for g in want.values())
    for name, param in learner.model.named_parameters():
        torch.testing.assert_close(param.grad.double(), want[name], rtol=0, atol=tol, msg=name)


def _grads(path, rows, micro_batch_size):
    learner = Learner(path, None, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=1,
                      micro_batch_size=micro_batch_size, temperature=1.0, device=torch.device("cpu"),
                      algo=AlgoConfig(top_entropy_quantile=0.3))
    metrics = learner.step(dp_batch().select(torch.tensor(rows)))
    return {"grads": {k: v.detach().clone() for k, v in learner.named_grads().items()}, "loss": metrics["loss"]}


def _half(rank, path):
    return _grads(path, list(range(rank * 4, rank * 4 + 4)), 4)


def test_two_ranks_take_the_quantile_over_both_ranks_tokens(tmp_path):
    """Each rank's one pass of 4 rows against one process's one pass of all 8: the threshold is over both ranks'
    tokens (each rank's own would keep other tokens, and the gradients would differ)."""
    path = tmp_path / "m"
    make_checkpoint(path)
    single = _grads(path, list(range(8)), 8)
    for got in run_on_gloo_ranks(_half, 2, tmp_path, str(path)):
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-5)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_share_is_checked():
    assert AlgoConfig().top_entropy_quantile == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"algo.top_entropy_quantile must be in \[0, 1\]"):
            AlgoConfig(top_entropy_quantile=bad).validate()
