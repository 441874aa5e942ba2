"""The decode step's block tables from `BlockTableMirror` against converting every table whole, over random
admissions, growth, prefix shares, preemptions (freed and regrown tables, slots reused) and finishes;
and `Sequence`'s O(1) token accessors against `token_ids`."""

import random

import numpy as np

from kv4rl.engine.block_manager import BlockManager
from kv4rl.engine.block_table_mirror import BlockTableMirror
from kv4rl.engine.sequence import SamplingParams, Sequence

BLOCK = 4


def whole(seqs, width):
    """The reference: each table converted in full, zero-padded."""
    out = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, :len(s.block_table)] = s.block_table
    return out


def test_mirror_equals_whole_conversion_through_random_scheduling():
    rng = random.Random(0)
    blocks = BlockManager(num_blocks=64, block_size=BLOCK)
    mirror = BlockTableMirror()
    free_slots, running, waiting = list(range(6)), [], []
    checked = regrown = reused = 0
    for _ in range(600):
        action = rng.random()
        if action < 0.15 and free_slots and len(running) < 6:  # admit: new, or a preempted one (table regrown)
            seq = waiting.pop(0) if waiting and rng.random() < 0.5 else Sequence(
                [rng.randrange(90) for _ in range(rng.randrange(1, 12))], SamplingParams())
            if not blocks.can_grow(seq, len(seq)):
                continue
            slot = free_slots.pop(rng.randrange(len(free_slots)))
            reused += mirror.owner[slot] is not None if slot < len(mirror.owner) else 0
            parent = next((p for p in running if len(p.block_table) > 1), None)
            if parent is not None and rng.random() < 0.3 and not seq.block_table:  # a prefix share
                blocks.share(seq, parent.block_table[:1])
            blocks.grow(seq, max(len(seq), BLOCK * len(seq.block_table)))
            regrown += seq.table_epoch > 0
            seq.seq_slot = slot
            running.append(seq)
        elif action < 0.25 and running:  # preempt or finish: the table is freed, the slot released
            seq = running.pop(rng.randrange(len(running)))
            blocks.free(seq)
            free_slots.append(seq.seq_slot)
            seq.seq_slot = -1
            if rng.random() < 0.6:
                waiting.append(seq)
        elif running:  # a decode step over a random subset, in a random order
            for s in running:
                if blocks.can_grow(s, len(s) + 1):
                    s.append(rng.randrange(90), -1.0, 0)
                    blocks.grow(s, len(s))
            batch = rng.sample(running, rng.randrange(1, len(running) + 1))
            slots = np.array([s.seq_slot for s in batch], dtype=np.int32)
            width = max(-(-len(s) // BLOCK) for s in batch)
            np.testing.assert_array_equal(mirror.gather(batch, slots, width), whole(batch, width))
            checked += 1
    assert checked > 200 and regrown > 5 and reused > 20  # the hard cases happened


def test_sequences_sharing_a_slot_get_their_own_tables():
    """The memory profile runs dummy rows that all claim slot 0."""
    a, b = Sequence([1, 2, 3], SamplingParams()), Sequence([4, 5], SamplingParams())
    a.block_table, b.block_table = [7, 8], [9]
    a.seq_slot = b.seq_slot = 0
    got = BlockTableMirror().gather([a, b], np.array([0, 0], dtype=np.int32), 2)
    np.testing.assert_array_equal(got, [[7, 8], [9, 0]])


def test_token_accessors_equal_token_ids():
    seq = Sequence([10, 11, 12], SamplingParams())
    assert seq.last_token_id == 12
    for extra in range(4):
        tokens = seq.token_ids
        assert seq.last_token_id == tokens[-1]
        for start in range(len(tokens) + 1):
            for stop in range(start, len(tokens) + 1):
                assert seq.token_slice(start, stop) == tokens[start:stop], (extra, start, stop)
        seq.append(20 + extra, -0.5, 0)
