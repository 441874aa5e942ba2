"""Learner: micro-batching and gradient checkpointing do not change the update."""

import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner


def make_learner(path, micro, ckpt, updates=1, epochs=1, old_logprob="behavior"):
    return Learner(path, None, algo=AlgoConfig(old_logprob=old_logprob), lr=1e-3, weight_decay=0.0,
                   betas=(0.9, 0.999), grad_clip=1e9, micro_batch_size=micro, updates_per_batch=updates,
                   temperature=1.0, device=torch.device("cpu"), grad_checkpointing=ckpt, epochs_per_batch=epochs)


def batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in (4, 2, 5, 3)]
    logps = [[-1.0] * len(r) for r in responses]
    return build_batch(prompts, responses, logps, [[0] * len(r) for r in responses], [1.0, -0.5, 0.3, -0.8], pad_id=0)


def test_micro_batching_and_checkpointing_leave_the_update_unchanged(tiny_qwen3):
    path, _ = tiny_qwen3
    b = batch()
    results = []
    for micro, ckpt in [(4, False), (1, False), (2, True)]:
        learner = make_learner(path, micro, ckpt)
        metrics = learner.step(b)  # gradients stay on the parameters after the step
        results.append((learner.named_grads(), metrics))
    ref, ref_metrics = results[0]
    assert sum(float(g.abs().sum()) for g in ref.values()) > 0
    for grads, metrics in results[1:]:
        for k in ref:
            assert torch.allclose(grads[k], ref[k], atol=1e-6, rtol=1e-4), k
        assert abs(metrics["grad_norm"] - ref_metrics["grad_norm"]) < 1e-4 * ref_metrics["grad_norm"]
    assert ref_metrics["num_tokens"] == 14


def test_each_update_of_a_batch_is_one_optimizer_step_whatever_the_rows(tiny_qwen3):
    """4 rows in 3 updates: 3 AdamW steps (over rows [0, 1], [2], [3]); `chunk` split them 2 + 2, two steps."""
    import pytest

    path, _ = tiny_qwen3
    b = batch()
    learner = make_learner(path, 4, False, updates=3)
    learner.step(b)
    assert int(next(iter(learner.optimizer.state.values()))["step"]) == 3
    with pytest.raises(ValueError, match="updates_per_batch=5 optimizer steps need at least as many rows"):
        make_learner(path, 4, False, updates=5).step(b)


def test_epochs_pass_over_the_batch_again_with_the_old_policy_fixed(tiny_qwen3, monkeypatch):
    """trainer.epochs_per_batch (verl's ppo_epochs). Reference: one epoch a step, stepped twice on the same
    batch (the behaviour log-probs are the old policy in both), takes the same AdamW steps on the same rows."""
    path, _ = tiny_qwen3
    b = batch()
    two_epochs = make_learner(path, 4, False, updates=2, epochs=2)
    metrics = two_epochs.step(b)
    one_epoch = make_learner(path, 4, False, updates=2)
    one_epoch.step(b)
    one_epoch.step(b)
    assert int(next(iter(two_epochs.optimizer.state.values()))["step"]) == 4
    for name, weight in one_epoch.state_dict().items():
        assert torch.equal(two_epochs.state_dict()[name], weight), name
    assert metrics["num_tokens"] == 14 and metrics["skipped_steps"] == 0
    # recomputed old log-probs: one forward over the batch before its first step, not one per epoch
    forwards = []
    real = Learner._logprobs
    monkeypatch.setattr(Learner, "_logprobs", lambda self, *a, **k: (forwards.append(1), real(self, *a, **k))[1])
    make_learner(path, 4, False, updates=2, epochs=3, old_logprob="recompute").step(b)
    assert len(forwards) == 1


def test_a_restored_optimizer_keeps_its_moments_but_takes_the_configured_settings(tiny_qwen3):
    """torch's load_state_dict brings back the saved weight decay and betas: a resume with new
    trainer.weight_decay / trainer.betas recorded them in config.yaml and ran the old ones. Reference: a
    hand-written AdamW step from the restored moments with the new settings."""
    path, _ = tiny_qwen3
    b = batch()
    old = Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.1, betas=(0.8, 0.95), grad_clip=1e9,
                  micro_batch_size=4, updates_per_batch=1, temperature=1.0, device=torch.device("cpu"))
    old.step(b)
    state = old.checkpoint_state()
    new = Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.5, betas=(0.5, 0.6), grad_clip=1e9,
                  micro_batch_size=4, updates_per_batch=1, temperature=1.0, device=torch.device("cpu"))
    new.model.load_state_dict(old.model.state_dict())
    new.load_checkpoint_state(state)
    group = new.optimizer.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.5, (0.5, 0.6), 1e-8)
    def dense(t):  # FSDP2 holds DTensors, one process or many
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().double()

    name, param = next((n, p) for n, p in new.model.named_parameters() if "layers.0.mlp.up_proj" in n)
    moments = {k: dense(v) for k, v in new.optimizer.state[param].items()}
    assert int(moments["step"]) == 1
    before = dense(param)
    new.step(b)
    grad = dense(dict(new.named_grads())[name])
    m = 0.5 * moments["exp_avg"] + 0.5 * grad
    v = 0.6 * moments["exp_avg_sq"] + 0.4 * grad**2
    want = before * (1 - 1e-3 * 0.5) - 1e-3 * (m / (1 - 0.5**2)) / ((v / (1 - 0.6**2)).sqrt() + 1e-8)
    assert torch.allclose(dense(param), want, atol=1e-6, rtol=1e-5)


def test_a_step_whose_gradient_norm_is_not_finite_leaves_weights_and_moments_unchanged(tiny_qwen3, caplog):
    """An inf advantage makes the gradient NaN: that optimizer step is skipped (the weights and AdamW's state
    equal a copy taken before), counted and warned about, and `grad_norm` is the norm of the step taken; a
    batch whose every step is skipped logs a NaN norm; the next finite batch steps as usual."""
    import copy
    import logging
    import math

    path, _ = tiny_qwen3
    good = batch()
    learner = make_learner(path, 4, False, updates=2)
    learner.step(good)  # AdamW has moments now
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    moments = copy.deepcopy(learner.optimizer.state_dict()["state"])
    bad = batch()
    bad.advantages[1] = float("inf")  # rows [0, 1] are the first update, [2, 3] the second
    with caplog.at_level(logging.WARNING, logger="kv4rl.trainer.learner"):
        metrics = learner.step(bad)
    assert metrics["skipped_steps"] == 1
    assert "iteration 1: skipped 1 of 2 optimizer steps" in caplog.text
    state = learner.optimizer.state_dict()["state"]
    assert [int(state[i]["step"]) for i in sorted(state)] == [3] * len(state)  # 2 + the second update's
    ref = make_learner(path, 4, False, updates=1)  # the second update alone, from the same weights and moments
    ref.model.load_state_dict(weights)
    ref.optimizer.load_state_dict({"state": moments, "param_groups": learner.optimizer.state_dict()["param_groups"]})
    second = batch()
    second = second.select(torch.tensor([2, 3]))
    assert metrics["grad_norm"] == ref.step(second)["grad_norm"]  # the norm of the step taken, not NaN
    for k, v in ref.model.state_dict().items():
        assert torch.equal(learner.model.state_dict()[k], v), k
    assert make_learner(path, 4, False).step(good)["skipped_steps"] == 0
    every = batch()
    every.advantages[:] = float("nan")
    metrics = make_learner(path, 4, False, updates=2).step(every)
    assert metrics["skipped_steps"] == 2 and math.isnan(metrics["grad_norm"])


def test_a_checkpoint_after_only_skipped_steps_resumes_as_the_run_goes_on(tiny_qwen3):
    """Every step of the first batch skipped, then a checkpoint: the resumed learner's next step equals the
    uninterrupted one's bit for bit. With the NaN gradients left on the parameters, torch kept an empty
    AdamW state for the save, and the resume's stand-in step count (1 for 0) moved the next update."""
    import copy

    path, _ = tiny_qwen3
    nan_batch = batch()
    nan_batch.advantages[:] = float("nan")
    on = make_learner(path, 4, False)
    assert on.step(nan_batch)["skipped_steps"] == 1
    state = copy.deepcopy(on.checkpoint_state())  # as saved: on the CPU its tensors are the live ones
    weights = {k: v.clone() for k, v in on.model.state_dict().items()}
    on.step(batch())
    resumed = make_learner(path, 4, False)
    resumed.model.load_state_dict(weights)
    resumed.load_checkpoint_state(state)
    resumed.step(batch())
    for k, v in on.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
