"""Shared cases for the Triton kernel tests: random paged caches filled through the reference formats,
and the float64 reference of what a decode query attends to. Used on CPU (Triton interpreter, small
shapes) and on the GPU (real shapes)."""

from __future__ import annotations

import math

import torch

from kv4rl.engine.attention import AttnMetadata
from kv4rl.engine.kv_formats import get_kv_format

def make_format(name: str, head_dim: int, n_sink: int = 2, n_recent: int = 5, rotate: str = "auto"):
    """The fast INT4 path keeps one scale and zero per token and head (group = head_dim)."""
    if name == "kv4":
        return get_kv_format("kv4", n_sink=n_sink, n_recent=n_recent, rotate=rotate, group_size=head_dim)
    if name == "int4":
        return get_kv_format("int4", rotate=rotate, group_size=head_dim)
    return get_kv_format(name, rotate=rotate)


def random_paged_batch(fmt, lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, device,
                       generator: torch.Generator, dtype=torch.bfloat16, spare_blocks: int = 3):
    """Fill a paged cache through the reference write path for
    sequences of the given context lengths, with shuffled block tables. Returns (cache, meta, k, v) where
    meta describes a decode step whose last token is the sequence's newest (already written)."""
    nblocks = [math.ceil(n / block_size) for n in lens]
    total = sum(nblocks) + spare_blocks
    perm = torch.randperm(total, generator=generator).tolist()
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at:at + nb])
        at += nb
    cache = fmt.allocate(total * block_size, num_kv_heads, head_dim, device, num_seq_slots=len(lens) + 2)
    for t in cache.values():  # poison: unwritten memory must never be read
        if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
            t.fill_(float("nan"))
    seq_slots = torch.randperm(len(lens) + 2, generator=generator)[: len(lens)].tolist()
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in lens]
    # one prefill-like write of every position: the same final cache as decoding token by token (INT4
    # pages are per token; KV4 keeps INT8 rows for what is protected at the end: sinks and the recent ring)
    meta = _to(AttnMetadata.build(lens, lens, tables, block_size, list(range(len(lens))), torch.device("cpu"),
                                  seq_slots), device)
    fmt.write(cache, meta, torch.cat(keys).to(device), torch.cat(values).to(device))
    final = _to(AttnMetadata.build([1] * len(lens), lens, tables, block_size, list(range(len(lens))),
                                   torch.device("cpu"), seq_slots), device)
    return cache, final


def _to(meta: AttnMetadata, device) -> AttnMetadata:
    for name in ("slot_mapping", "positions", "block_tables", "context_lens", "query_index", "query_valid",
                 "mask", "seq_slots"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


def reference_decode(fmt, cache, meta: AttnMetadata, q: torch.Tensor) -> torch.Tensor:
    """float64 attention of q[B, Hq, D] over what the reference format hands a decode query."""
    keys, values = fmt.gather(cache, meta, torch.float64)  # [B, L, Hkv, D]
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < meta.context_lens[:, None]
    keys = keys.masked_fill(~valid[:, :, None, None], 0.0)  # padding gathers poisoned memory
    values = values.masked_fill(~valid[:, :, None, None], 0.0)
    qr = fmt.prepare_query(q).double()  # rotated in the activation dtype, as the engine does
    group = q.shape[1] // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", qr, keys) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)
    return fmt.finish_output(out)


def fast_decode(fmt, cache, meta: AttnMetadata, q: torch.Tensor, max_splits: int, split_size: int,
                out_dtype=None, kernels=None):
    """The engine's Triton path (`FastAttention.attend`) on the same cache, with a chosen split grid
    (and `kernels`: launch settings, default the tuned ones)."""
    from kv4rl.engine.fast_path import DecodeInputs, FastAttention
    from kv4rl.kernels.decode_attention import DecodeBatch

    device = q.device
    batch = DecodeBatch(block_tables=meta.block_tables.to(torch.int32), context_lens=meta.context_lens.to(torch.int32),
                        seq_slots=meta.seq_slots.to(torch.int32),
                        split_size=torch.tensor([split_size], dtype=torch.int32, device=device),
                        max_splits=max_splits, block_size=meta.block_size)
    fast = FastAttention(fmt, cache[next(iter(cache))].shape[1], q.shape[-1], meta.block_size, device,
                         num_q_heads=q.shape[1], kernels=kernels)
    out = None if out_dtype is None else torch.empty(q.shape, dtype=out_dtype, device=device)
    return fast.attend(cache, q, DecodeInputs(slots=meta.slot_mapping, protect_rows=None, batch=batch), out=out)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())
