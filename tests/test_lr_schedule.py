"""The learning-rate schedule: a linear warm-up, then constant, linear or cosine towards `lr x min_lr_ratio`,
against transformers' linear and cosine-with-min-lr schedules and hand-worked warm-up values; a run's rows carry the
rate its optimizer stepped with, and a resume continues the same curve."""

import json
import math

import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup

from kv4rl.config import ConfigError, load_config
from kv4rl.loop import train
from kv4rl.run_folder import config_for_resume


def trainer(*overrides):
    return load_config(overrides=list(overrides)).trainer


def test_the_warm_up_climbs_linearly_and_the_default_then_holds_the_rate():
    t = trainer("trainer.lr=0.02", "trainer.warmup_iters=4", "trainer.iterations=10")
    assert [t.learning_rate(i) for i in range(6)] == pytest.approx([0.005, 0.01, 0.015, 0.02, 0.02, 0.02])
    assert t.learning_rate(9) == 0.02 and t.learning_rate(500) == 0.02
    assert trainer("trainer.lr=0.02", "trainer.warmup_iters=0").learning_rate(0) == 0.02


@pytest.mark.parametrize("warmup,iterations,ratio", [(0, 10, 0.0), (3, 20, 0.1), (5, 6, 0.5), (2, 2, 0.0),
                                                     (0, 1, 0.25), (4, 37, 1.0)])
def test_the_cosine_schedule_after_the_warm_up_is_transformers_cosine_with_min_lr(warmup, iterations, ratio):
    """transformers' LambdaLR at step s (s >= warm-up) is the rate of iteration s: both decay over
    [warmup, iterations) and reach lr x min_lr_ratio at `iterations`; past it transformers' cosine climbs
    again and kv4rl's holds the floor (a resume that trains longer without a longer curve)."""
    lr = 3e-4
    t = trainer(f"trainer.lr={lr}", f"trainer.warmup_iters={warmup}", f"trainer.iterations={iterations}",
                "trainer.lr_schedule=cosine", f"trainer.min_lr_ratio={ratio}")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, iterations, min_lr_rate=ratio)
    expected = [sched.lr_lambdas[0](s) * lr for s in range(iterations + 1)]  # lr_lambdas: a pure function too
    got = [t.learning_rate(i) for i in range(iterations + 3)]
    assert got[warmup:iterations + 1] == pytest.approx(expected[warmup:], rel=1e-12, abs=1e-18)
    if warmup < iterations:  # the first iteration after the warm-up runs at the full rate, the end at the floor
        assert got[warmup] == pytest.approx(lr)
        assert got[iterations:] == pytest.approx([lr * ratio] * 3, abs=1e-18)
    # hand-worked midpoint: halfway through the decay, the mean of lr and its floor
    if (iterations - warmup) % 2 == 0 and iterations > warmup:
        assert got[warmup + (iterations - warmup) // 2] == pytest.approx(lr * (1 + ratio) / 2)


@pytest.mark.parametrize("warmup,iterations", [(0, 10), (3, 20), (5, 6), (0, 1)])
def test_the_linear_schedule_after_the_warm_up_is_transformers_linear(warmup, iterations):
    """TRL's default: transformers' linear decay to 0 at `iterations` (min_lr_ratio 0); with a floor, the same
    line lifted to it: lr x (ratio + (1 - ratio) x (1 - progress)), by hand."""
    lr = 1e-3
    t = trainer(f"trainer.lr={lr}", f"trainer.warmup_iters={warmup}", f"trainer.iterations={iterations}",
                "trainer.lr_schedule=linear")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = get_linear_schedule_with_warmup(opt, warmup, iterations)
    expected = [sched.lr_lambdas[0](s) * lr for s in range(iterations + 3)]
    assert [t.learning_rate(i) for i in range(warmup, iterations + 3)] == pytest.approx(expected[warmup:], abs=1e-18)
    floor = trainer(f"trainer.lr={lr}", f"trainer.warmup_iters={warmup}", f"trainer.iterations={iterations}",
                    "trainer.lr_schedule=linear", "trainer.min_lr_ratio=0.25")
    for i in range(warmup, iterations + 2):
        progress = min(1.0, (i - warmup) / max(1, iterations - warmup))
        assert floor.learning_rate(i) == pytest.approx(lr * (0.25 + 0.75 * (1 - progress)))


@pytest.mark.parametrize("override,needle", [
    ("trainer.min_lr_ratio=-0.1", "trainer.min_lr_ratio must be in [0, 1]"),
    ("trainer.min_lr_ratio=1.5", "trainer.min_lr_ratio must be in [0, 1]"),
    ("trainer.lr_schedule=polynomial", "trainer.lr_schedule: 'polynomial' is not one of 'constant' | 'linear' | 'cosine'"),
])
def test_bad_schedule_settings_are_refused_by_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert needle in str(info.value)


def test_a_floor_without_the_cosine_schedule_is_said_to_do_nothing(caplog):
    with caplog.at_level("WARNING"):
        load_config(overrides=["trainer.min_lr_ratio=0.1"])
    assert any("trainer.min_lr_ratio=0.1 belongs to trainer.lr_schedule=linear or cosine" in m for m in caplog.messages)
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(overrides=["trainer.min_lr_ratio=0.1", "trainer.lr_schedule=cosine"])
    assert not [m for m in caplog.messages if "min_lr_ratio" in m]


@pytest.mark.slow
def test_a_runs_rows_carry_the_scheduled_rate_and_a_resume_continues_the_curve(tmp_path, caplog):
    """The optimizer's rate (the row's `lr` is read back from its parameter group) follows the curve, in one
    run and in a run stopped halfway and resumed (same iterations: a cosine run's length is its curve's)."""
    common = ["device=cpu", "rollout.quota_groups=2", "rollout.group_size=2", "trainer.lr=1e-3",
              "trainer.warmup_iters=1", "trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.2",
              "checkpoint.save_every=2", f"out_dir={tmp_path}"]
    full = load_config(overrides=[*common, "name=full", "trainer.iterations=5"])
    train(full, show_progress=False)
    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    # by hand: warm-up 1e-3, then cos over 4 iterations: 1e-3 x (0.2 + 0.8 x (1 + cos(pi k / 4)) / 2)
    expected = [1e-3] + [1e-3 * (0.2 + 0.4 * (1 + math.cos(math.pi * k / 4))) for k in range(4)]
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-12)

    part = load_config(overrides=[*common, "name=part", "trainer.iterations=5"])
    part.trainer.iterations = 2  # cut after two iterations (whose rates are the same under either length)
    train(part, show_progress=False)
    with caplog.at_level("WARNING"):  # a longer cosine run reshapes the curve the first rows followed: said
        resumed = config_for_resume(part.run_dir, ["trainer.iterations=5"])
    assert any("settings changed" in m and "trainer.iterations: 2 -> 5" in m for m in caplog.messages)
    train(resumed, resume=True, show_progress=False)
    again = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in again[2:]] == pytest.approx(expected[2:], rel=1e-12)
