"""Scheduler + block manager invariants under random lengths and a tiny KV pool (no model needed)."""

import random

import pytest

from kv4rl.engine.block_manager import BlockManager, blocks_needed
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.sequence import SamplingParams, Sequence, Status


def drive(num_requests, num_blocks, block_size, max_seqs, seed):
    """Simulate the engine loop with scripted lengths; the 'model' emits token 1, EOS is 0."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_seqs, max_num_batched_tokens=64, max_model_len=64)
    want = {}
    seqs = []
    for _ in range(num_requests):
        seq = Sequence([7] * rng.randint(1, 12), SamplingParams(max_tokens=rng.randint(1, 20)))
        want[seq.seq_id] = rng.randint(1, seq.params.max_tokens)  # length at which it emits EOS
        sched.add(seq)
        seqs.append(seq)
    finished = []
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch, "empty batch with work pending"
        # invariants: blocks are disjoint and cover each sequence's positions
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + blocks.num_free_blocks == num_blocks
        assert sum(s.num_new_tokens for s in batch) <= 64 or len(batch) == 1
        for s in batch:
            assert len(s.block_table) >= blocks_needed(len(s), block_size)
            s.num_cached_tokens = len(s)
            n_out = len(s.output_ids) + 1
            s.append(0 if n_out == want[s.seq_id] else 1, -0.5, 0)
            reason = sched.stop_reason(s, frozenset({0}))
            if reason:
                sched.finish(s, reason)
                finished.append(s)
        steps += 1
        assert steps < 10_000
    return seqs, finished, sched, want


@pytest.mark.parametrize("seed", range(20))
def test_every_request_finishes_exactly_once_with_preemption(seed):
    seqs, finished, sched, want = drive(num_requests=30, num_blocks=8, block_size=4, max_seqs=8, seed=seed)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert len({s.seq_id for s in finished}) == len(finished)
    for s in seqs:
        assert s.status is Status.FINISHED
        # the scripted length is reached exactly: preemption lost and duplicated nothing
        assert len(s.output_ids) == want[s.seq_id]
        assert s.output_ids[-1] == 0 and s.output_ids.count(0) == 1 and s.finish_reason == "stop"
        assert len(s.output_logprobs) == len(s.output_ids) == len(s.output_versions)
    assert sched.blocks.num_free_blocks == 8


def test_tiny_pool_forces_preemption_and_recovers():
    _, finished, sched, _ = drive(num_requests=12, num_blocks=16, block_size=2, max_seqs=12, seed=3)
    assert sched.num_preemptions > 0
    assert len(finished) == 12


def test_request_larger_than_pool_is_refused_at_once():
    sched = Scheduler(BlockManager(2, 4), 4, 64, 64)
    with pytest.raises(ValueError, match="KV pool too small"):
        sched.add(Sequence([1] * 5, SamplingParams(max_tokens=10)))


def test_prompt_longer_than_model_len_is_refused():
    sched = Scheduler(BlockManager(100, 4), 4, 64, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence([1] * 8, SamplingParams(max_tokens=1)))
