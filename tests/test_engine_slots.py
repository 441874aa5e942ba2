"""How many decode slots a run's engine takes."""


def test_a_sync_run_on_the_cpu_takes_only_the_slots_its_batch_runs():
    """On the CPU the pool holds every slot at max_model_len: a sync batch of 2 groups x 4 (per rank) never
    runs more than 8 at once, so 256 slots held 32x the memory it used. Partial rollout and CUDA keep them."""
    import torch

    from kv4rl.config import load_config
    from kv4rl.rollout.build import engine_slots

    cfg = load_config(overrides=["rollout.quota_groups=2", "rollout.group_size=4", "rollout.max_slots=256"])
    assert engine_slots(cfg, torch.device("cpu"), world=1) == 8
    assert engine_slots(cfg, torch.device("cpu"), world=2) == 4  # each rank runs half the groups
    assert engine_slots(cfg, torch.device("cuda"), world=1) == 256
    partial = load_config(overrides=["rollout.quota_groups=2", "rollout.group_size=4", "rollout.max_slots=256",
                                     "rollout.mode=partial"])
    assert engine_slots(partial, torch.device("cpu"), world=1) == 256
    small = load_config(overrides=["rollout.quota_groups=2", "rollout.group_size=4", "rollout.max_slots=6"])
    assert engine_slots(small, torch.device("cpu"), world=1) == 6
