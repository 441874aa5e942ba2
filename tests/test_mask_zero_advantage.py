"""`trainer.mask_zero_advantage` (prime-rl's filter_zero_advantages): a response whose advantage is exactly 0 (its
group's scores all equal) trains no token and leaves the loss denominators. Checked on the learner's batch by hand
(with trainer.mask_truncated beside it) and on runs whose every group is flat."""

from __future__ import annotations

import json

import torch

from kv4rl.config import load_config
from kv4rl.learner_batch import learner_batch
from kv4rl.loop import train
from kv4rl.trainer.batch import untrained_rows


def _rows():
    prompts = [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]]
    responses = [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19]]
    return prompts, responses, [[-0.5] * len(r) for r in responses], [[0] * len(r) for r in responses]


def test_a_flat_groups_rows_and_the_cut_ones_train_no_token():
    """Group 0 scores 1, 1 (advantage 0 each); group 1 scores 0, 1. Row 2 was cut. Masked: rows 0, 1 (zero
    advantage) and 2 (cut); row 3 trains its 4 tokens. Without the option rows 0, 1 train."""
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    common = ["rollout.group_size=2", "trainer.mask_truncated=true"]
    for on, trained_rows in ((True, [3]), (False, [0, 1, 3])):
        cfg = load_config(None, [*common, f"trainer.mask_zero_advantage={str(on).lower()}"])
        made = learner_batch(cfg, None, _rows(), scores, 2, [0, 1], 0, 0, [False, False, True, False])
        per_row = made.batch.response_mask.sum(1).tolist()
        assert [i for i, n in enumerate(per_row) if n > 0] == trained_rows
        assert made.batch.num_tokens == sum(len(_rows()[1][i]) for i in trained_rows)
    assert untrained_rows(None, [0.0, 0.5, -0.0], True) == [True, False, True]
    assert untrained_rows([False, True], [0.0, 0.5], False) == [False, True]


def test_a_run_whose_groups_are_all_flat_trains_nothing(tmp_path):
    """Two new tokens: the embedded task's answers need more, so every group scores 0 and is flat."""
    common = [f"out_dir={tmp_path}", "device=cpu", "rollout.quota_groups=4", "rollout.group_size=4",
              "rollout.max_new_tokens=2", "trainer.iterations=1"]
    train(load_config(None, [*common, "name=masked", "trainer.mask_zero_advantage=true"]), show_progress=False)
    train(load_config(None, [*common, "name=plain"]), show_progress=False)
    masked, plain = (json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
                     for name in ("masked", "plain"))
    assert masked["zero_var_group_frac"] == plain["zero_var_group_frac"] == 1.0
    assert masked["num_tokens"] == 0 and masked["empty_steps"] == 1
    assert plain["num_tokens"] == 32 and plain["empty_steps"] == 0


def test_with_grpo_passk_only_each_groups_best_trains():
    """grpo_passk gives every response but its group's best an advantage of 0, so those are masked (as prime-rl's
    pruning masks them): scores 1, 0 | 0.5, 1 train rows 0 and 3."""
    cfg = load_config(None, ["rollout.group_size=2", "advantage.estimator=grpo_passk", "trainer.mask_zero_advantage=true"])
    made = learner_batch(cfg, None, _rows(), torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64), 2, [0, 1], 0, 0,
                         None)
    assert [i for i, n in enumerate(made.batch.response_mask.sum(1).tolist()) if n > 0] == [0, 3]
