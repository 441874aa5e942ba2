"""Packed micro-batches: same log-probs, gradients and update as padded ones; no cross-sequence attention."""

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner
from kv4rl.trainer.packing import pack_rows, plan_micro_batches

PROMPTS = (3, 5, 2, 4, 6)
RESPONSES = (4, 2, 9, 3, 1)  # rows of 7, 7, 11, 7, 7 tokens


def ragged_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in PROMPTS]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in RESPONSES]
    logps = [[-1.0] * len(r) for r in responses]
    return build_batch(prompts, responses, logps, [[0] * len(r) for r in responses],
                       [1.0, -0.5, 0.3, -0.8, 0.6], pad_id=0)


def make_learner(path, max_tokens, micro=8, updates=1, agg="token_mean"):
    return Learner(path, None, algo=AlgoConfig(loss_agg=agg), lr=1e-3, weight_decay=0.0,
                   betas=(0.9, 0.999), grad_clip=1e9, micro_batch_size=micro, updates_per_batch=updates,
                   temperature=1.0, device=torch.device("cpu"), max_tokens_per_micro_batch=max_tokens, max_new_tokens=12)


def test_plan_fills_first_fits_count_of_micro_batches_evenly_and_a_long_row_goes_alone():
    # first fit (sorted 12, 9, 6, 5, 4, 3) needs 4: {12} {9} {6, 4} {5, 3}; evenly: 4 joins 5, 3 joins 6
    assert plan_micro_batches([6, 4, 9, 5, 3, 12], 10) == [[5], [2], [0, 4], [3, 1]]
    assert plan_micro_batches([2, 2, 2], 100) == [[0, 1, 2]]
    # first fit leaves a 5-token remainder ({50, 50} {50, 50} {5}); even filling does not
    assert plan_micro_batches([50, 50, 50, 50, 5], 100) == [[0, 3], [1, 4], [2]]
    # first fit needs 2 ({5, 5} {4, 3, 3}); evenly, 5+4 and 5+3 leave no room for the last 3: three
    # micro-batches filled evenly (8, 5, 7), not a 3-token remainder
    assert plan_micro_batches([5, 5, 4, 3, 3], 10) == [[0, 4], [1], [2, 3]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        plan_micro_batches([1], 0)


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_a_partition_within_budget_as_short_as_first_fit_and_even(seed):
    """Against an independent first fit: no fewer micro-batches (rarely one or two more), every one
    within the budget, and the fullest and emptiest differ by at most the longest row."""
    g = torch.Generator().manual_seed(seed)
    budget = int(torch.randint(20, 200, (1,), generator=g))
    lengths = torch.randint(1, budget + 1, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in mb) for mb in plan]
    assert all(load <= budget for load in loads)
    rooms: list[int] = []  # first fit, longest first, written out again
    for n in sorted(lengths, reverse=True):
        fit = [b for b, r in enumerate(rooms) if r >= n]
        if fit:
            rooms[fit[0]] -= n
        else:
            rooms.append(budget - n)
    assert len(rooms) <= len(plan) <= len(rooms) + 2
    assert max(loads) - min(loads) <= max(lengths)


def test_pack_rows_lays_real_tokens_end_to_end_with_restarting_positions():
    b = ragged_batch()
    packed = pack_rows(b.input_ids[:2], b.attention_mask[:2])
    assert packed.input_ids.tolist() == [b.input_ids[0, :7].tolist() + b.input_ids[1, :7].tolist()]
    assert packed.position_ids.tolist() == [list(range(7)) * 2]
    # row 1's column j predicts its token j+1 from packed position 7 + j
    assert packed.gather[1, :6].tolist() == list(range(7, 13)) and not packed.valid[1, 6:].any()


@pytest.mark.parametrize("agg, updates", [("token_mean", 1), ("seq_mean", 2), ("token_sum_norm", 2)])
def test_packed_and_padded_give_the_same_logprobs_gradients_and_update(tiny_qwen3, agg, updates):
    """The loss gets the mini-batch's token and sequence counts either way; with two updates the
    mini-batches are rows 0-2 and 3-4 in both paths."""
    path, _ = tiny_qwen3
    b = ragged_batch()
    padded = make_learner(path, None, micro=2, updates=updates, agg=agg)
    packed = make_learner(path, 14, updates=updates, agg=agg)  # 14 tokens: rows {2}, {0, 3}, {1, 4}
    assert [r.tolist() for r in packed.micro_batches(b, torch.arange(len(b)))] == [[2], [0, 3], [1, 4]]
    lp_padded, lp_packed = padded._logprobs(padded.model, b), packed._logprobs(packed.model, b)
    torch.testing.assert_close(lp_packed * b.response_mask, lp_padded * b.response_mask, rtol=0, atol=1e-5)
    m_padded, m_packed = padded.step(b), packed.step(b)
    g_padded, g_packed = padded.named_grads(), packed.named_grads()
    assert g_padded.keys() == g_packed.keys() and sum(float(g.abs().sum()) for g in g_padded.values()) > 0
    for name, grad in g_padded.items():
        torch.testing.assert_close(g_packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # AdamW's first step moves an element by lr g / (|g| + eps), eps = 1e-8: a gradient at rounding-noise level
    # (1e-9, the two paths summing in another order) moves by up to lr either way, so where both gradients are
    # below 1e-7 the weights may differ by up to 2 lr a step; everywhere else they match
    lr = 1e-3
    w_padded, w_packed = padded.state_dict(), packed.state_dict()
    for name, w in w_padded.items():
        noise = ((g_padded[name].abs() < 1e-7) & (g_packed[name].abs() < 1e-7) if name in g_padded
                 else torch.zeros_like(w, dtype=torch.bool))
        torch.testing.assert_close(w_packed[name][~noise], w[~noise], rtol=0, atol=1e-5, msg=name)
        assert float((w_packed[name] - w).abs().max()) <= 2 * lr * updates + 1e-5, name
    for key in ("loss", "grad_norm", "entropy", "num_tokens"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5), key


def test_packed_sequences_never_attend_to_each_other(tiny_qwen3):
    """Changing one sequence's tokens leaves the other's log-probs in the same packed row unchanged,
    and both equal a forward of each sequence alone."""
    path, _ = tiny_qwen3
    learner = make_learner(path, 1000)
    b = ragged_batch()
    pair = b.select(slice(0, 2))
    assert len(learner.micro_batches(pair, torch.arange(2))) == 1  # one packed row
    base = learner._logprobs(learner.model, pair)
    changed = pair.select(slice(0, 2))
    changed.input_ids = pair.input_ids.clone()
    changed.input_ids[0, :7] = (pair.input_ids[0, :7] + 11) % 96
    after = learner._logprobs(learner.model, changed)
    assert not torch.allclose(after[0, :6], base[0, :6], atol=1e-3)  # the perturbed row did change
    torch.testing.assert_close(after[1], base[1], rtol=0, atol=1e-6)
    alone = learner._logprobs(learner.model, pair.select(slice(1, 2)))
    torch.testing.assert_close(base[1:], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_count_and_the_even_plan_equal_the_row_by_row_searches_at_thousands_of_rows(seed):
    """The tree-searched first fit against the scan of every open micro-batch, and the doubling-then-halving
    search for an even fill against trying one more micro-batch at a time (log-normal lengths, as RL's)."""
    from kv4rl.trainer.packing import _fill_evenly, _first_fit_count

    g = torch.Generator().manual_seed(seed)
    rows = [7, 300, 3000][seed % 3]
    budget = [64, 4096, 32768][seed % 3]
    lengths = (torch.empty(rows).log_normal_(0.0, 1.0, generator=g) * budget / 8).clamp(1, budget * 1.2)
    lengths = lengths.long().tolist()
    order = sorted(range(rows), key=lambda i: (-lengths[i], i))
    rooms: list[int] = []
    for row in order:
        fit = next((b for b, r in enumerate(rooms) if r >= lengths[row]), None)
        if fit is None:
            rooms.append(max(budget - lengths[row], 0))
        else:
            rooms[fit] -= lengths[row]
    assert _first_fit_count(order, lengths, budget) == len(rooms)
    n = len(rooms)
    while (expected := _fill_evenly(order, lengths, budget, n)) is None:
        n += 1
    assert plan_micro_batches(lengths, budget) == expected
