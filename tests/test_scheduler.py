"""Scheduler + block manager invariants under random lengths and a tiny KV pool (no model needed)."""

import random
from collections import Counter

import pytest

from kv4rl.engine.block_manager import BlockManager, blocks_needed
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.sequence import SamplingParams, Sequence, Status


def drive(num_requests, num_blocks, block_size, max_seqs, seed, prefix_sharing=False, together=False):
    """Simulate the engine loop with scripted lengths; the 'model' emits token 1, EOS is 0.

    Prompts are runs of one token, so with `prefix_sharing` many requests share them."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_seqs, max_num_batched_tokens=64, max_model_len=64, prefix_sharing=prefix_sharing,
                      admit_siblings_together=together)
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
        # invariants: a block's reference count is its number of holders; a block held twice only
        # covers prompt positions below every holder's last prompt token (nobody writes into it)
        owned = Counter(b for s in sched.running for b in s.block_table)
        assert all(blocks.ref_count(b) == n for b, n in owned.items())
        assert len(owned) + blocks.num_free_blocks == num_blocks
        assert blocks.num_shared_blocks == sum(n > 1 for n in owned.values())
        for s in sched.running:
            for i, b in enumerate(s.block_table):
                if owned[b] > 1:
                    assert (i + 1) * block_size <= len(s.prompt_ids) - 1
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


@pytest.mark.parametrize("prefix_sharing", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_every_request_finishes_exactly_once_with_preemption(seed, prefix_sharing):
    seqs, finished, sched, want = drive(num_requests=30, num_blocks=8, block_size=4, max_seqs=8, seed=seed,
                                        prefix_sharing=prefix_sharing)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert len({s.seq_id for s in finished}) == len(finished)
    for s in seqs:
        assert s.status is Status.FINISHED
        # the scripted length is reached exactly: preemption lost and duplicated nothing
        assert len(s.output_ids) == want[s.seq_id]
        assert s.output_ids[-1] == 0 and s.output_ids.count(0) == 1 and s.finish_reason == "stop"
        assert len(s.output_logprobs) == len(s.output_ids) == len(s.output_versions)
    assert sched.blocks.num_free_blocks == 8


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_shared_prompts_with_preemption_keep_the_invariants(seed, together):
    """Many equal prompts and a pool of 28 blocks: forks and preemptions both happen (with the groups
    admitted whole or a slot at a time)."""
    seqs, finished, sched, want = drive(num_requests=40, num_blocks=28, block_size=4, max_seqs=16, seed=seed,
                                        prefix_sharing=True, together=together)
    assert sched.num_forks > 0
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert all(len(s.output_ids) == want[s.seq_id] for s in seqs)
    assert sched.blocks.num_free_blocks == 28 and sched.blocks.num_shared_blocks == 0


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


# ---- reference counts and prefix sharing -----------------------------------------------------------
def test_block_reference_counts():
    blocks = BlockManager(6, 4)
    a, b, c = (Sequence([1] * 9, SamplingParams()) for _ in range(3))
    blocks.grow(a, 9)  # blocks 0, 1, 2
    blocks.share(b, a.block_table[:2])
    blocks.share(c, a.block_table[:1])
    blocks.grow(c, 6)  # c gets block 3 after its shared block 0
    assert b.block_table == [0, 1] and c.block_table == [0, 3]
    assert [blocks.ref_count(i) for i in range(6)] == [3, 2, 1, 1, 0, 0]
    assert blocks.num_free_blocks == 2 and blocks.num_shared_blocks == 2
    blocks.free(a)  # a's private block 2 returns; 0 and 1 stay with b and c
    assert [blocks.ref_count(i) for i in range(6)] == [2, 1, 0, 1, 0, 0]
    assert blocks.num_free_blocks == 3 and blocks.num_shared_blocks == 1
    blocks.free(b)
    assert blocks.num_free_blocks == 4 and blocks.num_shared_blocks == 0
    blocks.free(c)
    assert blocks.num_free_blocks == 6 and all(blocks.ref_count(i) == 0 for i in range(6))
    with pytest.raises(RuntimeError, match="free"):
        blocks.share(a, [5])


def run_batch(sched, batch):
    """What the model does to the scheduler's view: cache every token, sample token 1."""
    for s in batch:
        s.num_cached_tokens = len(s)
        s.append(1, -0.5, 0)


@pytest.mark.parametrize("prompt_len,shared,copied", [(4, 0, [0, 1, 2]), (5, 1, []), (7, 1, [0, 1]),
                                                      (8, 1, [0, 1, 2])])
def test_followers_wait_one_step_then_fork_from_the_leader(prompt_len, shared, copied):
    """Block size 4: the follower shares the leader's whole blocks below position P-1, and copies the
    positions before P-1 of the block that holds P-1 (hand-derived for each prompt length)."""
    sched = Scheduler(BlockManager(64, 4), 8, 64, 64, prefix_sharing=True)
    group = [Sequence(list(range(prompt_len)), SamplingParams(max_tokens=8)) for _ in range(3)]
    other = Sequence([9] * 3, SamplingParams(max_tokens=8))
    for s in [*group, other]:
        sched.add(s)
    leader = group[0]
    assert sched.schedule() == [leader, other]  # the followers wait, the request behind them does not
    assert list(sched.waiting) == group[1:]
    run_batch(sched, [leader, other])
    batch = sched.schedule()
    assert batch == [leader, other, *group[1:]] and not sched.waiting
    for f in group[1:]:
        assert f.block_table[:shared] == leader.block_table[:shared]
        assert f.block_table[shared] not in leader.block_table and len(f.block_table) == shared + 1
        assert f.num_cached_tokens == prompt_len - 1 and f.num_new_tokens == 1
        src, dst = leader.block_table[shared] * 4, f.block_table[shared] * 4
        assert f.fork.src_slots == [src + i for i in copied] and f.fork.dst_slots == [dst + i for i in copied]
        assert (f.fork.src_seq_slot, f.fork.dst_seq_slot) == (leader.seq_slot, f.seq_slot)
    assert sched.prefill_tokens_saved == 2 * (prompt_len - 1)
    run_batch(sched, batch)
    for s in list(sched.running):
        sched.finish(s, "stop")
    assert sched.blocks.num_free_blocks == 64 and sched.blocks.num_shared_blocks == 0


@pytest.mark.parametrize("event", ["finish", "abort", "preempt", "new_weights"])
def test_followers_prefill_when_the_leader_no_longer_holds_the_prompt(event):
    sched = Scheduler(BlockManager(64, 4), 8, 64, 64, prefix_sharing=True)
    group = [Sequence([3] * 6, SamplingParams(max_tokens=8)) for _ in range(3)]
    for s in group:
        sched.add(s)
    run_batch(sched, sched.schedule())
    leader = group[0]
    if event == "finish":
        sched.finish(leader, "stop")
    elif event == "abort":
        sched.abort(leader)
    elif event == "preempt":
        sched.preempt_all()
    else:
        sched.forget_prefixes()
    batch = sched.schedule()
    # the first follower prefills its whole prompt and becomes the parent; the second waits for it
    follower = group[1]
    assert follower in batch and group[2] not in batch
    assert follower.num_new_tokens == 6 and follower.fork is None
    run_batch(sched, batch)
    batch = sched.schedule()
    assert group[2] in batch and group[2].fork is not None
    assert group[2].block_table[0] == follower.block_table[0]


def test_sharing_off_never_forks():
    sched = Scheduler(BlockManager(64, 4), 8, 64, 64)
    group = [Sequence([3] * 6, SamplingParams(max_tokens=8)) for _ in range(3)]
    for s in group:
        sched.add(s)
    assert sched.schedule() == group
    assert all(s.fork is None and s.num_new_tokens == 6 for s in group)
    assert len({b for s in group for b in s.block_table}) == 6


def test_requests_that_stop_after_their_prefill_do_not_hold_back_their_group():
    """A one-token request finishes (and frees its prompt) in its first step: nobody waits for it."""
    sched = Scheduler(BlockManager(64, 4), 8, 64, 64, prefix_sharing=True)
    group = [Sequence([3] * 6, SamplingParams(max_tokens=1)) for _ in range(3)]
    for s in group:
        sched.add(s)
    assert sched.schedule() == group



@pytest.mark.parametrize("together", [False, True])
def test_a_group_queued_behind_busy_slots_forks_one_prefill_when_admitted_together(together):
    """Partial rollout's pattern: 24 slots busy with other prompts, one of them finishing every other
    step, a group of 3 queued behind (a run counts up to 24 / 8 = 3). Admitted a slot at a time, each
    sibling comes a step after the one before decoded past the prompt and prefills it again
    (hand-traced: steps 2, 4, 6; 18 tokens); admitted together, the group waits for 3 free slots
    (step 6), prefills once and forks twice."""
    sched = Scheduler(BlockManager(256, 4), 24, 64, 64, prefix_sharing=True, admit_siblings_together=together)
    runners = [Sequence([10 + i] * 3, SamplingParams(max_tokens=50)) for i in range(24)]
    group = [Sequence(list(range(6)), SamplingParams(max_tokens=50)) for _ in range(3)]
    for s in [*runners, *group]:
        sched.add(s)
    prefilled, admitted_at = 0, {}
    for step in range(9):
        batch = sched.schedule()
        for s in batch:
            if s in group and s.seq_id not in admitted_at:
                admitted_at[s.seq_id] = step
                prefilled += 0 if s.fork is not None else s.num_new_tokens
        run_batch(sched, batch)
        if step in (1, 3, 5):
            sched.finish(runners[step // 2], "stop")
    if together:
        assert [admitted_at[s.seq_id] for s in group] == [6, 7, 7] and prefilled == 6
        assert sched.num_sibling_waits == 4  # steps 2-5 had 1 or 2 free slots for a group of 3
        assert group[1].block_table[0] == group[2].block_table[0] == group[0].block_table[0]
    else:
        assert [admitted_at[s.seq_id] for s in group] == [2, 4, 6] and prefilled == 18
        assert sched.num_sibling_waits == 0


def test_a_group_larger_than_an_eighth_of_the_slots_waits_only_for_that_many():
    """16 slots: a run counts at most 16 / 8 = 2, so a group of 6 behind 15 runners enters as soon as
    2 slots are free (not 6), its siblings fork as slots free, and nothing is held back."""
    sched = Scheduler(BlockManager(256, 4), 16, 64, 64, prefix_sharing=True, admit_siblings_together=True)
    runners = [Sequence([9 + i] * 3, SamplingParams(max_tokens=50)) for i in range(15)]
    group = [Sequence(list(range(6)), SamplingParams(max_tokens=2)) for _ in range(6)]
    for s in [*runners, *group]:
        sched.add(s)
    assert sched.schedule() == runners  # 1 free slot < 2: the group waits
    run_batch(sched, runners)
    sched.finish(runners[0], "stop")
    batch = sched.schedule()
    assert group[0] in batch and group[0].num_new_tokens == 6  # 2 free slots: it prefills
    run_batch(sched, batch)
    for r in runners[1:]:
        sched.finish(r, "stop")
    finished = 0
    for _ in range(20):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch
        run_batch(sched, batch)
        for s in batch:
            if len(s.output_ids) >= 2:
                sched.finish(s, "length")
                finished += 1
    assert finished == 6 and not sched.has_unfinished()
    assert sched.num_forks == 5  # 16 free slots: the first prefills, its 5 siblings fork it
