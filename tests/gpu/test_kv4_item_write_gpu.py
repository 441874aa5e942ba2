"""KV4's CUDA INT8 item storing a decode step's new K/V itself (`DecodeKernels.write_in_item`), against the
Triton write it replaces: the same cache bytes and the same attention output, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")

DEVICE = torch.device("cuda")
HKV, HQ, D, BLOCK = 8, 32, 128, 16


def _step(fmt, lens, gen):
    """A cache holding every sequence's first L - 1 tokens and the step that adds token L - 1: DecodeInputs
    with one padding row (slot -1, context 0, sequence slot 0 as CUDA graphs pad) and the new rows, V a
    strided slice of a q|k|v product as in the engine."""
    from kv4rl.engine.fast_path import DecodeInputs
    from kv4rl.kernels.decode_attention import DecodeBatch
    from tests.kernel_cases import random_paged_batch

    cache, meta = random_paged_batch(fmt, lens, HKV, D, BLOCK, DEVICE, gen)
    b = len(lens) + 1
    width = meta.block_tables.shape[1]
    tables = torch.cat((meta.block_tables, torch.zeros(1, width, dtype=meta.block_tables.dtype, device=DEVICE)))
    context = torch.cat((meta.context_lens, torch.zeros(1, dtype=meta.context_lens.dtype, device=DEVICE)))
    seq_slots = torch.cat((meta.seq_slots, torch.zeros(1, dtype=meta.seq_slots.dtype, device=DEVICE)))
    slots = torch.cat((meta.slot_mapping, torch.tensor([-1], device=DEVICE))).long()
    positions = np.array(lens) - 1
    rows = fmt.decode_side_rows(meta.seq_slots.cpu().numpy().astype(np.int64), positions)
    protect = torch.tensor(np.append(rows, -1), dtype=torch.long, device=DEVICE)
    split = 256
    batch = DecodeBatch(block_tables=tables.to(torch.int32), context_lens=context.to(torch.int32),
                        seq_slots=seq_slots.to(torch.int32),
                        split_size=torch.tensor([split], dtype=torch.int32, device=DEVICE),
                        max_splits=-(-max(lens) // split), block_size=BLOCK)
    qkv = torch.randn(b, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = qkv[:, : HQ * D].view(b, HQ, D)
    k = qkv[:, HQ * D: (HQ + HKV) * D].reshape(b, HKV, D).contiguous()  # out of the RoPE kernel
    v = qkv[:, (HQ + HKV) * D:].view(b, HKV, D)
    return cache, meta, DecodeInputs(slots=slots, protect_rows=protect, batch=batch), q, k, v


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as integers (NaN-poisoned scales compare by their bits)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("subs", [1, 2, 4])
@pytest.mark.parametrize("sink,recent,group", [(16, 128, 128), (4, 32, 128), (4, 32, 32)])
def test_the_int8_item_stores_the_triton_writes_bytes(subs, sink, recent, group, gen, monkeypatch):
    """The item's INT4 page row, fp16 scale and zero, INT8 side row and float32 scale of each new token equal
    the Triton write's bit for bit, the padding row writes nothing, and the attention output is the same
    (beside the body and after it, with 1, 2 and 4 warps a head). New tokens: the first sink, a sink, the first
    recent row, rows before and after the ring wraps, long contexts. INT8 rows also equal `quantize_int8` on
    CUDA, and the output the float64 reference of the cache the step left. INT4 groups of 32 channels (four
    scales a row, which the engine's decode kernels do not read: bytes only) check the item's group reductions."""
    import dataclasses

    import kv4rl.kernels.fp8_decode_cuda as fc
    from kv4rl.engine.fast_path import FastAttention
    from kv4rl.kernels.decode_attention import DecodeKernels
    from kv4rl.kernels.kv_write import PendingWrite
    from kv4rl.quant import quantize_int8
    from tests.kernel_cases import clone_cache, make_format, reference_decode, rel_err

    monkeypatch.setattr(fc, "SIDE_CONFIG", {**fc.SIDE_CONFIG, "subs": subs})
    runs = []
    real_run = PendingWrite.run
    monkeypatch.setattr(PendingWrite, "run", lambda self: (runs.append(1), real_run(self)))
    # no rotation: the keys need none in the write, and the query counts as rotated like them, so the item
    # starts beside the body (the fused forward hands both over rotated the same way)
    fmt = make_format("kv4", D, n_sink=sink, n_recent=recent, rotate="none")
    if group != D:
        from kv4rl.engine.kv_formats import get_kv_format

        fmt = get_kv_format("kv4", n_sink=sink, n_recent=recent, rotate="none", group_size=group)
    lens = [1, sink, sink + 1, sink + recent, sink + recent + 1, sink + 2 * recent + 7, 1000, 3001]
    cache, meta, inputs, q, k, v = _step(fmt, lens, gen)
    results = {}
    for in_item in (False, True):
        for beside in (True, False):
            runs.clear()
            mine = clone_cache(cache)
            fast = FastAttention(fmt, HKV, D, BLOCK, DEVICE, num_q_heads=HQ,
                                 kernels=DecodeKernels(int8_item_beside_body=beside, write_in_item=in_item))
            pending = dataclasses.replace(fast.pending_write(mine, k, v, inputs, rotated=True), group_size=group)
            assert pending.item_problem() is None
            out = fast.attend(mine, q, inputs, out=torch.empty(q.shape, dtype=torch.float32, device=DEVICE),
                              rotated=True, pending=pending)
            assert len(runs) == (0 if in_item else 1), (in_item, beside)
            results[in_item, beside] = (mine, out)
    base_cache, base_out = results[False, False]
    for key, (mine, out) in results.items():
        for name in base_cache:
            assert torch.equal(_bits(mine[name]), _bits(base_cache[name])), (key, name)
        assert torch.equal(out, base_out), key
    # the new rows are there: INT8 copies as torch quantizes them on CUDA, pages not what they held before
    rows = inputs.protect_rows[:-1]
    for prefix, x in (("k", k), ("v", v)):
        codes, scale = quantize_int8(x[:-1])
        assert torch.equal(base_cache[f"{prefix}_prot_codes"][rows], codes)
        assert torch.equal(base_cache[f"{prefix}_prot_scale"][rows], scale)
    # and nothing else changed: the padding row (sequence slot 0, as a real sequence may have) wrote nothing
    slots = inputs.slots[:-1]
    for name, t in base_cache.items():
        changed = (_bits(t) != _bits(cache[name])).reshape(t.shape[0], -1).any(1).nonzero().flatten()
        allowed = rows if "prot" in name else slots
        assert set(changed.tolist()) <= set(allowed.tolist()), name
    assert not torch.equal(base_cache["k_codes"][slots], cache["k_codes"][slots])
    # attention over the step's cache: the float64 reference of what the step left
    if group != D:
        return
    b = len(lens)
    ref = reference_decode(fmt, base_cache, meta, q[:b])
    assert rel_err(base_out[:b], ref) < 2e-2
    assert torch.equal(base_out[b], torch.zeros_like(base_out[b]))
