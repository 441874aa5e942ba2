"""`trainer.attention`: the setting's checks, `auto`'s choice, and packed rows through FlexAttention.

FlexAttention has no backward pass on the CPU (torch raises), so here the packed flex forward is
checked against the padded SDPA forward in fp32 (the log-probs every loss term is built from);
tests/gpu/test_learner_flex_gpu.py compares gradients and a whole update on CUDA.
"""

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.config import ConfigError, RunConfig, TrainerConfig
from kv4rl.trainer.attention import check_attention, document_block_mask, resolve_attention, set_attention
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def make(path, **kw):
    return Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=2, updates_per_batch=1, temperature=1.0, device=CPU, **kw)


def ragged_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [(7, 30), (3, 5), (12, 21), (5, 1)]  # (prompt, response): 37, 8, 33, 6 tokens
    prompts = [torch.randint(0, 96, (p,), generator=g).tolist() for p, _ in sizes]
    responses = [torch.randint(0, 96, (r,), generator=g).tolist() for _, r in sizes]
    return build_batch(prompts, responses, [[-4.0] * len(r) for r in responses], [[0] * len(r) for r in responses],
                       torch.randn(len(sizes), generator=g).tolist(), pad_id=0)


def test_choices_are_checked_before_any_model_is_loaded(tmp_path):
    with pytest.raises(ValueError, match="trainer.attention must be one of auto, sdpa, flex, got 'flash'"):
        check_attention("flash", CUDA)
    with pytest.raises(ValueError, match="trainer.attention=flex needs a CUDA device"):
        make(tmp_path / "no-model-here", attention="flex")  # refused before the (missing) folder is read
    with pytest.raises(ConfigError, match="trainer.attention must be auto, sdpa or flex"):
        RunConfig(trainer=TrainerConfig(attention="flash")).validate()
    with pytest.raises(ConfigError, match="trainer.attention=flex needs a CUDA device"):
        RunConfig(device="cpu", trainer=TrainerConfig(attention="flex")).validate()


@pytest.mark.parametrize(("choice", "device", "packed", "expected"), [
    ("auto", CUDA, True, "flex"), ("auto", CUDA, False, "sdpa"), ("auto", CPU, True, "sdpa"),
    ("sdpa", CUDA, True, "sdpa"), ("flex", CUDA, False, "flex")])
def test_auto_picks_flex_only_for_packed_rows_on_cuda(choice, device, packed, expected):
    assert resolve_attention(choice, device, packed) == expected


def test_learner_reports_the_kernel_it_runs(tiny_qwen3):
    path, _ = tiny_qwen3
    for kw, expected in (({}, "sdpa"), ({"max_tokens_per_micro_batch": 64}, "sdpa")):
        learner = make(path, **kw)
        assert learner.attention == expected
        assert learner.model.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_packed_flex_forward_equals_padded_sdpa_and_keeps_sequences_apart(tiny_qwen3):
    path, _ = tiny_qwen3
    batch = ragged_batch()
    padded = make(path)
    packed = make(path, max_tokens_per_micro_batch=1024)
    assert len(packed.micro_batches(batch, torch.arange(len(batch)))) == 1  # all four rows share one packed row
    set_attention(packed.model, "flex")  # the learner itself refuses flex on the CPU: no backward pass here
    packed.attention = "flex"  # so the learner hands the model its own document block mask
    assert packed.model.config._attn_implementation == "flex_attention"
    real = batch.attention_mask[:, 1:].bool()  # every next-token position, prompt ones included
    reference, flex = padded.logprobs(batch), packed.logprobs(batch)
    assert (flex[~real] == 0).all()
    torch.testing.assert_close(flex[real], reference[real], rtol=0, atol=2e-5)

    changed = batch.select(torch.arange(len(batch)))
    changed.input_ids = batch.input_ids.clone()
    changed.input_ids[0, :37] = (batch.input_ids[0, :37] + 11) % 96  # every token of row 0, packed first
    after = packed.logprobs(changed)
    assert float((after[0] - flex[0]).abs().max()) > 0.1
    torch.testing.assert_close(after[1:][real[1:]], flex[1:][real[1:]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("lengths", [[5, 300, 7, 1, 200], [128, 128], [1000], [129, 127, 3], [1], [64] * 9])
def test_document_block_mask_equals_the_mask_mod_evaluated_everywhere(lengths):
    """The block lists built from the lengths equal torch's own `create_block_mask` of the same
    mask_mod (uncompiled), and the dense mask equals causal-within-sequence worked out element by element."""
    from torch.nn.attention.flex_attention import create_block_mask

    lens = torch.tensor(lengths)
    total = int(lens.sum())
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    ours = document_block_mask(lens)
    ref = create_block_mask(lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q), 1, 1, total, total, device="cpu",
                            _compile=False)
    assert ours.seq_lengths == (total, total)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for row, n in enumerate(getattr(ours, num)[0, 0].tolist()):  # the listed blocks, as sets
            assert set(getattr(ours, idx)[0, 0, row, :n].tolist()) == set(getattr(ref, idx)[0, 0, row, :n].tolist())
    q, k = torch.arange(total)[:, None], torch.arange(total)[None, :]
    expected = (doc[q] == doc[k]) & (k <= q)
    qb, kb = q // 128, k // 128  # each element through the block lists: full blocks all True, partial via mask_mod
    n_blocks = -(-total // 128)
    full = torch.zeros(n_blocks, n_blocks, dtype=torch.bool)
    for row, n in enumerate(ours.full_kv_num_blocks[0, 0].tolist()):
        full[row, ours.full_kv_indices[0, 0, row, :n].long()] = True
    partial = torch.zeros_like(full)
    for row, n in enumerate(ours.kv_num_blocks[0, 0].tolist()):
        partial[row, ours.kv_indices[0, 0, row, :n].long()] = True
    assert not (full & partial).any()
    dense = full[qb, kb] | (partial[qb, kb] & ours.mask_mod(0, 0, q, k))
    assert torch.equal(dense, expected)


def test_a_compiled_consumer_of_the_block_mask_compiles_once_for_every_block_count():
    """Packed micro-batches are nearly all full, so nearly all have one block count; a compiled layer took
    that count as a constant and recompiled at the first micro-batch with another, iterations later (the
    likely cause of a slow timed 4B update, H200). With the counts symbolic from the first graph, new lengths and
    new block counts reuse the graphs of the first two lengths (the sequence length itself turns symbolic
    at its first change, as before). FlexAttention's eager forward on the CPU; dynamo's frame counter."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=None)
    def attend(q, k, v, mask):
        return flex_attention(q, k, v, block_mask=mask)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    # 3 blocks twice (the length turns symbolic), then 4, 2 and 5 blocks: block counts never seen before
    for lengths in ([130, 170], [150, 140, 20], [200, 250], [140, 60], [300, 260]):
        lens = torch.tensor(lengths)
        total = int(lens.sum())
        q, k, v = (torch.randn(1, 2, total, 16, generator=g) for _ in range(3))
        out = attend(q, k, v, document_block_mask(lens, symbolic=True))  # the CUDA default
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # the same attention, dense, in float64
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        scores = (q.double() @ k.double().transpose(-1, -2) / 4.0).masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.double(), rtol=0, atol=1e-5)
    assert counter.frame_count == 2, counter.frame_count  # the first length, then any length and block count
