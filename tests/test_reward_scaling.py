"""`reward.bias`, `reward.scale`, `reward.clip` (AReaL's reward_bias, reward_scaling, reward_clip): each trained score
becomes clip((r + bias) · scale, ±clip), after the overlong penalty, while `accuracy` still reads the verifier's own
score. By hand, on a run of the embedded task (0/1 scores), and the values refused."""

from __future__ import annotations

import json

import pytest

from kv4rl.config import ConfigError, load_config
from kv4rl.loop import train
from kv4rl.reward_config import RewardConfig
from kv4rl.rewards import RewardResult
from kv4rl.rewards.combined import rescaled, reward_metrics


def test_scores_by_hand_and_the_verifier_kept_for_accuracy():
    raw = RewardResult([1.0, 0.0, 1.0, 0.25], {"no_answer": 1})
    out = rescaled(raw, "exact", bias=-0.5, scale=3.0, clip=1.2)
    assert out.scores == [1.2, -1.2, 1.2, -0.75]  # (1 − 0.5)·3 = 1.5 → 1.2; (0 − .5)·3 = −1.5 → −1.2; (.25 − .5)·3
    assert out.components == {"exact": [1.0, 0.0, 1.0, 0.25]} and out.stats == {"no_answer": 1}
    assert reward_metrics(out, "exact")["accuracy"] == 0.5
    assert rescaled(raw, "exact", 1.0, 0.5, None).scores == [1.0, 0.5, 1.0, 0.625]


def test_a_run_trains_on_the_rescaled_scores(tmp_path):
    """bias −0.5, scale 2, clip 0.8 turn 0/1 into ∓0.8: the logged reward_mean is 0.8 · (2 · accuracy − 1)."""
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=run", "device=cpu", "trainer.iterations=1",
                             "reward.bias=-0.5", "reward.scale=2", "reward.clip=0.8"])
    train(cfg, show_progress=False)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < row["accuracy"] < 1
    assert row["reward_mean"] == pytest.approx(0.8 * (2 * row["accuracy"] - 1), abs=1e-9)


@pytest.mark.parametrize("override,message", [
    ("reward.scale=0", "reward.scale a finite one other than 0"),
    ("reward.clip=0", "reward.clip must be a finite number > 0"),
    ("reward.clip=-1", "reward.clip must be a finite number > 0"),
])
def test_bad_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    assert RewardConfig().scale == 1.0 and RewardConfig().clip is None
