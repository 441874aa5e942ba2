"""`trainer.mask_truncated` (TRL's mask_truncated_completions): a response cut at `rollout.max_new_tokens` keeps
its place in its group's advantages and trains no token. Checked against the same step on the batch without
those rows, an all-masked batch that must leave weights and optimizer alone, and a short run's token count."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.config import load_config
from kv4rl.loop import train
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner

PROMPTS = ([3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16])
RESPONSES = ([20, 21, 22, 23], [24, 25], [26, 27, 28, 29, 30, 31], [32], [33, 34, 35])
ADVANTAGES = [1.0, -0.5, 0.75, -1.25, 0.3]
MASKED = [False, True, False, False, True]


def _batch(rows, masked=None):
    return build_batch([list(PROMPTS[i]) for i in rows], [list(RESPONSES[i]) for i in rows],
                       [[-1.0 - 0.1 * j for j in range(len(RESPONSES[i]))] for i in rows],
                       [[0] * len(RESPONSES[i]) for i in rows], [ADVANTAGES[i] for i in rows], pad_id=0,
                       masked=None if masked is None else [masked[i] for i in rows])


def _learner(path, agg):
    torch.manual_seed(0)
    return Learner(path, None, algo=AlgoConfig(loss_agg=agg), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999),
                   grad_clip=1e9, micro_batch_size=2, updates_per_batch=1, temperature=1.0,
                   device=torch.device("cpu"), max_new_tokens=8)


def test_a_masked_row_keeps_its_tokens_and_trains_none():
    plain, masked = _batch(range(5)), _batch(range(5), MASKED)
    assert torch.equal(masked.input_ids, plain.input_ids) and torch.equal(masked.behavior_logprobs, plain.behavior_logprobs)
    for i, off in enumerate(MASKED):
        want = torch.zeros_like(plain.response_mask[i]) if off else plain.response_mask[i]
        assert torch.equal(masked.response_mask[i], want)
    assert masked.num_tokens == sum(len(r) for r, off in zip(RESPONSES, MASKED) if not off)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "token_sum_norm"])
def test_masked_rows_step_as_the_batch_without_them(tiny_qwen3, agg):
    """Every denominator counts only trained rows and tokens, so the step equals one on the other three rows."""
    path, _ = tiny_qwen3
    with_masked, without = _learner(path, agg), _learner(path, agg)
    a = with_masked.step(_batch(range(5), MASKED))
    b = without.step(_batch([i for i in range(5) if not MASKED[i]]))
    grads_a, grads_b = with_masked.named_grads(), without.named_grads()
    assert grads_a.keys() == grads_b.keys() and sum(float(g.abs().sum()) for g in grads_b.values()) > 0
    for name, grad in grads_b.items():
        torch.testing.assert_close(grads_a[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for key in ("loss", "grad_norm", "num_tokens", "entropy", "mismatch_abs_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert a["empty_steps"] == 0


def test_a_batch_with_nothing_to_train_takes_no_step(tiny_qwen3, caplog):
    """AdamW on a zero gradient would still decay the weights (weight_decay 0.1 here) and start its moments."""
    path, _ = tiny_qwen3
    learner = _learner(path, "token_mean")
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        metrics = learner.step(_batch(range(5), [True] * 5), iteration=3)
    assert metrics["empty_steps"] == 1 and metrics["skipped_steps"] == 0 and metrics["num_tokens"] == 0
    after = learner.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not learner.optimizer.state
    assert [m for m in caplog.messages if "had no token to train" in m] == [
        "iteration 3: 1 of 1 optimizer steps had no token to train, so none was taken: every response of their "
        "mini-batches was masked (trainer.mask_truncated masks responses cut at rollout.max_new_tokens, "
        "trainer.mask_zero_advantage those of zero advantage; algo.behavior_rs with algo.old_logprob=recompute the "
        "tokens sampled too far from π_old)"]


def test_a_run_trains_only_the_tokens_of_responses_that_ended(tmp_path):
    """A cut response has exactly rollout.max_new_tokens tokens (sync rollout), so the trained tokens are every
    response's minus those: responses x (mean length - truncated share x max_new_tokens)."""
    common = [f"out_dir={tmp_path}", "device=cpu", "rollout.quota_groups=4", "rollout.group_size=4",
              "rollout.max_new_tokens=3", "trainer.iterations=2"]
    train(load_config(None, [*common, "name=masked", "trainer.mask_truncated=true"]), show_progress=False)
    train(load_config(None, [*common, "name=plain"]), show_progress=False)
    masked, plain = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                     for name in ("masked", "plain"))
    assert all(0 < row["truncated_frac"] < 1 for row in masked)
    # the first batch is sampled by the same weights in both runs; later ones by weights trained differently
    assert masked[0]["response_len_mean"] == plain[0]["response_len_mean"]
    assert masked[0]["num_tokens"] < plain[0]["num_tokens"]
    for row in plain:
        assert row["num_tokens"] == pytest.approx(16 * row["response_len_mean"])
    for row in masked:
        assert row["num_tokens"] == pytest.approx(16 * (row["response_len_mean"] - 3 * row["truncated_frac"]))


def test_the_mismatch_is_measured_on_the_first_mini_batch_with_tokens(tiny_qwen3):
    """Two updates, the first mini-batch all masked: no step is taken before the second, so the engine-vs-learner
    mismatch comes from it, as from a learner given those rows alone (it went missing from the row)."""
    path, _ = tiny_qwen3

    def learner(updates):
        torch.manual_seed(0)
        return Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                       micro_batch_size=4, updates_per_batch=updates, temperature=1.0, device=torch.device("cpu"))

    got = learner(2).step(_batch(range(4), [True, True, False, False]))
    alone = learner(1).step(_batch([2, 3]))
    assert got["empty_steps"] == 1
    for key in ("mismatch_k3", "mismatch_abs_mean", "mismatch_absmax"):
        assert got[key] == pytest.approx(alone[key], rel=1e-6), key


def test_masked_rows_are_attributed_from_their_sampled_tokens():
    """The mismatch attribution finds a response by its sampling versions: a masked row's tokens, versions and
    recorded log-probs are all still there (it took the empty mask's first column and failed)."""
    from kv4rl.telemetry.attribution import batch_responses

    plain, masked = batch_responses(_batch(range(5))), batch_responses(_batch(range(5), MASKED))
    assert len(masked) == len(plain) == 5
    for a, b in zip(masked, plain, strict=True):
        assert a[:4] == b[:4] and torch.equal(a[4], b[4])
    assert [r[2] for r in plain] == [list(r) for r in RESPONSES]


def test_a_resume_that_changes_max_new_tokens_says_token_sum_norms_scale_changes(tmp_path, caplog):
    from kv4rl.run_folder import config_for_resume
    from tests.small_runs import new_run

    run = new_run(tmp_path, "sumnorm", "trainer.iterations=1", "algo.loss_agg=token_sum_norm", "rollout.max_new_tokens=12")
    with caplog.at_level("WARNING"):
        config_for_resume(run, ["rollout.max_new_tokens=16"])
    (said,) = [m for m in caplog.messages if "settings changed" in m]
    assert said.endswith("(algo.loss_agg=token_sum_norm divides by rollout.max_new_tokens, so the loss's scale "
                         "changes with it; algo.loss_norm_tokens=12 keeps the old one)")
    caplog.clear()
    with caplog.at_level("WARNING"):
        config_for_resume(run, ["rollout.max_new_tokens=16", "algo.loss_norm_tokens=12"])
    (said,) = [m for m in caplog.messages if "settings changed" in m]
    assert "scale" not in said


def test_batch_std_without_normalize_std_is_said_to_change_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(None, ["advantage.std_scope=batch", "advantage.normalize_std=false"])
    assert [m for m in caplog.messages if "std_scope" in m] == [
        "advantage.std_scope=batch picks the std that advantage.normalize_std divides by; with "
        "advantage.normalize_std=false nothing is divided and it changes nothing"]
