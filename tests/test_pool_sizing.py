"""KV pool sizing (`kv4rl.engine.memory`): real allocation bytes, the memory arithmetic, the profile step."""

import pytest
import torch

from kv4rl.bench.random_model import random_decoder
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config
from kv4rl.engine.llm import Engine
from kv4rl.engine.memory import KVFootprint, kv_footprint, pool_blocks, profile_batch


@pytest.mark.parametrize("name", sorted(KV_FORMATS))
def test_footprint_counts_what_a_real_allocation_holds(name):
    fmt = kv_format_from_config(KVConfig(group_size=32, n_sink=2, n_recent=4), name)
    layers, heads, head_dim, block_size = 3, 2, 64, 8
    fp = kv_footprint(fmt, layers, heads, head_dim, block_size)
    for blocks, seqs in ((1, 1), (5, 3), (7, 0)):
        real = sum(t.numel() * t.element_size()
                   for _ in range(layers)
                   for t in fmt.allocate(blocks * block_size, heads, head_dim, "cpu", num_seq_slots=seqs).values())
        assert fp.total_bytes(blocks, seqs) == real


def test_footprint_matches_hand_counted_bytes():
    # kv4, 8 KV heads, head_dim 128, group 128: INT4 pages (64 code bytes + fp16 scale + fp16 zero) for K and V,
    # INT8 rows (128 codes + fp32 scale) for n_sink + n_recent = 144 positions of each running sequence
    fmt = kv_format_from_config(KVConfig(format="kv4"))
    fp = kv_footprint(fmt, num_layers=36, num_kv_heads=8, head_dim=128, block_size=16)
    assert fp.block_bytes == 16 * (64 + 2 + 2) * 2 * 8 * 36
    assert fp.seq_bytes == (128 + 4) * 2 * 8 * 144 * 36
    assert fp.const_bytes == 0
    assert fp.bytes_per_token(8192) == pytest.approx((64 + 4) * 2 * 8 * 36 + (128 + 4) * 2 * 8 * 144 * 36 / 8192)


FP = KVFootprint(block_size=16, block_bytes=1000, seq_bytes=50, const_bytes=8)


def test_pool_blocks_from_memory_arithmetic():
    # 0.5 x 100000 - 10000 in use - 5000 activations = 35000; minus 8 fixed and 4 x 50 per-sequence = 34792
    kw = {"total_bytes": 100_000, "fraction": 0.5, "used_bytes": 10_000, "activation_bytes": 5_000,
          "footprint": FP, "max_num_seqs": 4}
    assert pool_blocks(**kw, max_model_len=160) == 34
    # 4 sequences of 100 tokens can never use more than 4 x 7 blocks
    assert pool_blocks(**kw, max_model_len=100) == 28


def test_pool_blocks_refuses_a_pool_without_one_longest_sequence():
    with pytest.raises(ValueError, match=r"engine\.gpu_memory_fraction=0\.2.*max_model_len=160"):
        pool_blocks(total_bytes=100_000, fraction=0.2, used_bytes=10_000, activation_bytes=5_000,
                    footprint=FP, max_num_seqs=4, max_model_len=160)  # 4 blocks left, 10 needed


@pytest.mark.parametrize("budget,max_len,seqs,lengths", [
    (16384, 40960, 256, [40959]),  # an over-budget prompt runs alone
    (16384, 384, 256, [383] * 42 + [16384 - 42 * 383]),
    (1000, 64, 2, [63, 63]),  # no more sequences than slots
    (100, 64, 4, [63, 37]),
])
def test_profile_batch_is_the_largest_schedulable_step(budget, max_len, seqs, lengths):
    batch = profile_batch(budget, max_len, seqs, block_size=16)
    assert [len(s) for s in batch] == lengths
    for s in batch:
        assert s.num_new_tokens == len(s) and s.seq_slot == 0
        assert s.block_table == [0] * -(-len(s) // 16)


def test_chunked_profile_batch_caps_the_new_tokens_at_the_budget():
    """With chunked prefill no step computes more than the budget; each row is a prompt's last chunk over
    a cached prefix as long as allowed."""
    batch = profile_batch(1000, 40960, 256, block_size=16, chunked=True)
    assert [(len(s), s.num_new_tokens) for s in batch] == [(40959, 1000)]
    batch = profile_batch(100, 64, 4, block_size=16, chunked=True)
    assert [(len(s), s.num_new_tokens) for s in batch] == [(63, 63), (63, 37)]
    assert all(s.block_table == [0] * 4 for s in batch)


def test_gpu_memory_fraction_is_validated():
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="engine.gpu_memory_fraction"):
            EngineConfig(gpu_memory_fraction=bad).validate()
    EngineConfig(gpu_memory_fraction=1.0).validate()


@pytest.mark.parametrize("name", ["fp32", "kv4", "nvfp4"])
def test_profile_step_runs_on_a_one_block_cache(name):
    model = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32)
    cfg = EngineConfig(kv=KVConfig(format=name, group_size=32, n_sink=2, n_recent=4), max_model_len=40,
                       max_num_batched_tokens=100)
    engine = Engine.from_model(model, cfg, max_num_seqs=3)
    assert engine.pool_tokens == 3 * 48 and "max_num_seqs x max_model_len" in engine.summary
    engine.runner.profile.step(3)  # 39 + 39 + 22 tokens, all on cache block 0 and sequence slot 0


def test_memory_scope_counts_the_device_or_only_this_process(monkeypatch):
    """`device`: total - free (other processes' memory included); `process`: torch's reserved bytes plus
    the context allowance, whatever other processes hold (hand-worked numbers, CUDA calls stubbed)."""
    from kv4rl.engine import memory

    gib = memory.GIB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 140 * gib))  # 100 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)  # this process: 3 GiB
    assert memory.in_use_bytes(torch.device("cuda")) == (140 * gib, 100 * gib)
    assert memory.in_use_bytes(torch.device("cuda"), "process") == (140 * gib, 3 * gib + memory.CONTEXT_ALLOWANCE)
    with pytest.raises(ValueError, match="gpu_memory_scope"):
        from kv4rl.config import load_config

        load_config(None, ["engine.gpu_memory_scope=node"])
