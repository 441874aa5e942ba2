"""`algo.entropy_target`: the entropy bonus's coefficient under Skywork-OR1's adaptive control (TRL's
use_adaptive_entropy), against TRL's update written out (TRL f2cd577, `GRPOTrainer._compute_loss`), and a learner's
steps against learners whose fixed coefficient is the one the control applied."""

from __future__ import annotations

import math

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.config import ConfigError, load_config
from kv4rl.trainer.entropy_control import EntropyControl
from kv4rl.trainer.learner import Learner
from tests.test_learner_fsdp import ragged_batch


def trl_control(coef, target, delta, low, high, entropies):
    """TRL's adaptive entropy: the coefficient each step applies (0 until a step measured an entropy at or below the
    target), and its update from that step's entropy."""
    applied, last = [], math.inf
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, high) if entropy <= target else max(coef - delta, low)
        last = entropy
    return applied, coef


def test_the_coefficient_moves_as_trls():
    entropies = [0.3, 0.25, 0.6, 0.1, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.2]
    control = EntropyControl(0.01, target=0.25, delta=0.004, low=0.002, high=0.02)
    applied = []
    for entropy in entropies:
        applied.append(control.applied())
        control.observe(entropy * 7, 7.0)  # one pass of 7 tokens
        control.step_end(None, 1)
    want, final = trl_control(0.01, 0.25, 0.004, 0.002, 0.02, entropies)
    assert applied == pytest.approx(want) and control.coef == pytest.approx(final)
    assert 0.0 in applied and 0.02 in applied and any(0 < a < 0.02 for a in applied)  # gated, capped, between
    fixed = EntropyControl(0.05)
    fixed.observe(3.0, 1.0)
    assert fixed.applied() == 0.05 and fixed.step_end(None, 1) == {"entropy_coeff": 0.05} and fixed.coef == 0.05


def _learner(path, **algo):
    torch.manual_seed(0)
    return Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=1,
                   temperature=1.0, device=torch.device("cpu"), fsdp=False, micro_batch_size=2, max_new_tokens=6,
                   algo=AlgoConfig(**algo))


def test_a_learner_applies_the_controlled_coefficient_and_resumes_it(tiny_qwen3):
    """Step 1 applies no bonus (no entropy measured yet): the gradient of entropy_coeff=0. Its entropy (the logged
    token mean) is below the target, so step 2 applies 0.01 + 0.005, the gradient of a learner with that fixed
    coefficient from the same weights; a checkpoint's state brings the coefficient back."""
    path, _ = tiny_qwen3
    batch = ragged_batch(3)
    adaptive = _learner(path, entropy_coeff=0.01, entropy_target=100.0)
    fixed = _learner(path, entropy_coeff=0.0)
    first, plain = adaptive.step(batch), fixed.step(batch)
    for name, grad in fixed.named_grads().items():
        torch.testing.assert_close(adaptive.named_grads()[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    assert first["entropy_control_entropy"] == pytest.approx(first["entropy"], rel=1e-6)
    assert first["entropy_coeff"] == pytest.approx(0.015) and "entropy_coeff" not in plain
    fixed.entropy.coef = 0.015  # from here the same weights and the coefficient the control applies
    adaptive.step(batch), fixed.step(batch)
    for name, grad in fixed.named_grads().items():
        torch.testing.assert_close(adaptive.named_grads()[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    without = _learner(path, entropy_coeff=0.0)
    without.step(batch)
    without.entropy.coef = 0.0
    without.step(batch)
    assert any(not torch.allclose(g, without.named_grads()[n], atol=1e-7) for n, g in adaptive.named_grads().items())
    state = adaptive.checkpoint_state()
    assert state["entropy_control"] == {"coef": pytest.approx(0.02), "last": pytest.approx(adaptive.entropy.last),
                                       "start": 0.01}
    resumed = _learner(path, entropy_coeff=0.01, entropy_target=100.0)
    resumed.load_checkpoint_state(state)
    assert resumed.entropy.coef == pytest.approx(0.02) and resumed.entropy.applied() == pytest.approx(0.02)
    # a resume that sets another algo.entropy_coeff (config.yaml records it, the warning says so) starts from it,
    # the last step's entropy kept; a checkpoint from before "start" was saved goes on where it was
    reset = _learner(path, entropy_coeff=0.3, entropy_target=100.0)
    reset.load_checkpoint_state(state)
    assert reset.entropy.coef == 0.3 and reset.entropy.applied() == 0.3 and reset.entropy.last == adaptive.entropy.last
    older = _learner(path, entropy_coeff=0.3, entropy_target=100.0)
    older.load_checkpoint_state({**state, "entropy_control": {"coef": 0.02, "last": adaptive.entropy.last}})
    assert older.entropy.coef == 0.02
    falling = _learner(path, entropy_coeff=0.01, entropy_target=1e-3)  # far above the target: down, never applied
    out = falling.step(batch)
    assert out["entropy_coeff"] == pytest.approx(0.005) and falling.entropy.applied() == 0.0


def test_the_settings_are_checked_and_trls_names_point_here():
    load_config(None, ["algo.entropy_target=0.5", "algo.entropy_coeff=0.001"])
    with pytest.raises(ConfigError, match="algo.entropy_target must be > 0"):
        load_config(None, ["algo.entropy_target=0"])
    with pytest.raises(ConfigError, match="algo.entropy_coeff_min <= algo.entropy_coeff_max"):
        load_config(None, ["algo.entropy_target=0.5", "algo.entropy_coeff_min=0.5", "algo.entropy_coeff_max=0.1"])
    assert AlgoConfig(entropy_coeff_delta=0.01).ignored_keys()[0].startswith("algo.entropy_coeff_delta, _min and _max")
    for trl, ours in (("use_adaptive_entropy=true", "algo.entropy_target"), ("entropy_coef_delta=0.01",
                                                                            "algo.entropy_coeff_delta")):
        with pytest.raises(ConfigError, match=ours):
            load_config(None, [trl])


def test_a_batch_of_several_steps_logs_its_last_steps_coefficient(tiny_qwen3):
    """Four optimizer steps a batch (two mini-batches, two epochs), each below the target: the coefficient rises
    by the delta four times and the row logs the last, what the next step applies (the mean of the four was
    logged)."""
    path, _ = tiny_qwen3
    torch.manual_seed(0)
    learner = Learner(path, None, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9, updates_per_batch=2,
                      epochs_per_batch=2, temperature=1.0, device=torch.device("cpu"), fsdp=False, micro_batch_size=1,
                      max_new_tokens=6, algo=AlgoConfig(entropy_coeff=0.01, entropy_target=100.0))
    out = learner.step(ragged_batch(4))
    assert out["entropy_coeff"] == pytest.approx(0.03) == learner.entropy.coef
    assert out["entropy_control_entropy"] == learner.entropy.last
