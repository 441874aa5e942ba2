"""The learner's update memory, reserved by an engine that stays awake through the update: the dummy
largest micro-batch against the learner's own planner, the optimizer state still to come counted by
hand, the pool arithmetic with a reserve, and `kv4rl train` asking for it only when its engine does not
sleep (the measurement itself runs on CUDA: tests/gpu/test_update_memory_gpu.py)."""

import pytest
import torch
from torch import nn

from kv4rl.config import load_config
from kv4rl.engine.llm import Engine
from kv4rl.engine.memory import KVFootprint, pool_blocks
from kv4rl.trainer.learner import Learner
from kv4rl.trainer.offloaded_adamw import OffloadedAdamW
from kv4rl.trainer.packing import plan_micro_batches
from kv4rl.trainer.update_memory import largest_micro_batch, optimizer_bytes_to_come, same_device


@pytest.mark.parametrize("budget,max_len,lengths", [
    (100, 30, [30, 30, 30, 10]),
    (20, 30, [30]),  # a row over the budget runs alone
    (61, 30, [30, 30]),  # a 1-token rest cannot be a row (prompt + response)
    (64, 64, [64]),
])
def test_packed_largest_micro_batch_is_one_micro_batch_of_the_budget(budget, max_len, lengths):
    batch = largest_micro_batch(max_len, budget, micro_batch_size=3)
    got = batch.attention_mask.sum(1).tolist()
    assert got == lengths
    assert len(plan_micro_batches(got, budget)) == 1  # the learner runs it as one micro-batch
    assert batch.response_mask.sum().item() == sum(n - 1 for n in lengths)


def test_padded_largest_micro_batch_is_micro_batch_size_rows_of_max_len():
    batch = largest_micro_batch(17, None, micro_batch_size=3)
    assert batch.input_ids.shape == (3, 17) and int(batch.attention_mask.sum()) == 3 * 17
    assert batch.response_mask.shape == (3, 16) and int(batch.response_mask.sum()) == 3 * 16
    with pytest.raises(ValueError, match="max_len must be >= 2"):
        largest_micro_batch(1, 100, 3)


def _tiny():
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))  # 35 + 18 parameters
    model[1].bias.requires_grad_(False)  # frozen: AdamW never makes its state
    return model


def test_adamw_state_to_come_is_two_moments_per_trainable_element_until_the_first_step():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    assert optimizer_bytes_to_come(opt, cpu) == 2 * 4 * (35 + 15)
    assert optimizer_bytes_to_come(opt, torch.device("cuda")) == 0  # nothing of it on another device
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert optimizer_bytes_to_come(opt, cpu) == 0  # allocated now: already in use when the pool is sized
    half = torch.optim.AdamW(nn.Linear(4, 4).to(torch.bfloat16).parameters())
    assert optimizer_bytes_to_come(half, cpu) == 2 * 2 * 20  # moments in the parameters' dtype


def test_a_device_without_an_index_is_the_one_with_it():
    """The learner passes `cuda`, its parameters live on `cuda:0`: AdamW's moments were not counted."""
    d = torch.device
    assert same_device(d("cuda"), d("cuda:0")) and same_device(d("cuda:1"), d("cuda"))
    assert same_device(d("cuda:1"), d("cuda:1")) and not same_device(d("cuda:0"), d("cuda:1"))
    assert not same_device(d("cpu"), d("cuda")) and not same_device(d("cuda:0"), d("meta"))
    opt = torch.optim.AdamW(_tiny().parameters(), lr=0.1)  # CPU parameters: device `cpu`, no index
    assert optimizer_bytes_to_come(opt, d("cpu", 0)) == 2 * 4 * (35 + 15)


@pytest.mark.parametrize("bucket_bytes,slot_elements", [(1000, 50), (80, 10)])  # 50 trainable elements
def test_offloaded_adamw_adds_its_two_staging_slots_and_no_moments(bucket_bytes, slot_elements):
    model = _tiny()
    opt = OffloadedAdamW(model.parameters(), bucket_bytes=bucket_bytes)
    staging = 2 * 2 * slot_elements * 4  # two slots, each both moments of one bucket, fp32
    assert optimizer_bytes_to_come(opt, torch.device("cpu")) == staging
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert optimizer_bytes_to_come(opt, torch.device("cpu")) == staging  # allocated again at every step


FP = KVFootprint(block_size=16, block_bytes=1000, seq_bytes=50, const_bytes=8)


def test_pool_blocks_leave_the_reserve_free():
    # 0.5 x 100000 - 10000 in use - 5000 activations - 20000 reserved = 15000; minus 8 + 4 x 50 = 14792
    kw = {"total_bytes": 100_000, "fraction": 0.5, "used_bytes": 10_000, "activation_bytes": 5_000,
          "footprint": FP, "max_num_seqs": 4, "max_model_len": 160}
    assert pool_blocks(**kw) == 34 and pool_blocks(**kw, reserve_bytes=20_000) == 14
    with pytest.raises(ValueError, match=r"reserved for the learner's update.*sleep_between_rollouts"):
        pool_blocks(**kw, reserve_bytes=25_000)  # 9 blocks left, 10 needed for one sequence of 160 tokens


def test_engine_refuses_a_negative_reserve():
    with pytest.raises(ValueError, match="reserve_bytes must be >= 0"):
        Engine(None, reserve_bytes=-1)


@pytest.mark.parametrize("sleep", [False, True])
def test_train_builds_the_learner_first_and_reserves_its_update_for_an_awake_engine(monkeypatch, tmp_path, sleep):
    from kv4rl.loop import build

    calls = []

    def update_memory_bytes(self, max_len):
        calls.append(max_len)
        return 0  # the CPU engine's pool is every slot at max_model_len whatever the reserve

    monkeypatch.setattr(Learner, "update_memory_bytes", update_memory_bytes)
    cfg = load_config(overrides=["device=cpu", f"out_dir={tmp_path}", "rollout.mode=sync",
                                 f"engine.sleep_between_rollouts={str(sleep).lower()}"])
    s = build(cfg, None, show_progress=False)
    assert calls == ([] if sleep else [s.engine.max_model_len])  # asked with the engine's context
