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
                out_dtype=None, kernels=None, rotated: bool = False):
    """The engine's Triton path (`FastAttention.attend`) on the same cache, with a chosen split grid
    (and `kernels`: launch settings, default the tuned ones; `rotated`: q is rotated like the keys)."""
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
    return fast.attend(cache, q, DecodeInputs(slots=meta.slot_mapping, protect_rows=None, batch=batch), out=out,
                       rotated=rotated)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# ---- prefill: many new tokens per row over a cached prefix ------------------------------------------
def random_prefill_case(fmt, prefix_lens: list[int], query_lens: list[int], num_kv_heads: int, num_q_heads: int,
                        head_dim: int, block_size: int, device, generator: torch.Generator,
                        dtype=torch.bfloat16):
    """A cache holding each row's `prefix_lens` tokens (written through the reference format, so KV4 holds
    the prefix's sinks and recent ring) with blocks for `query_lens` more, and the step's q/k/v.
    Returns (cache, meta of the step, q [N, Hq, D], k, v [N, Hkv, D])."""
    totals = [p + n for p, n in zip(prefix_lens, query_lens)]
    nblocks = [math.ceil(n / block_size) for n in totals]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=generator).tolist()
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at:at + nb])
        at += nb
    cache = fmt.allocate(total * block_size, num_kv_heads, head_dim, device, num_seq_slots=len(totals) + 2)
    for t in cache.values():  # poison: unwritten memory must never be read
        if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
            t.fill_(float("nan"))
    seq_slots = torch.randperm(len(totals) + 2, generator=generator)[: len(totals)].tolist()
    rows = [i for i, p in enumerate(prefix_lens) if p]
    if rows:
        n = sum(prefix_lens)
        pre = _to(AttnMetadata.build([prefix_lens[i] for i in rows], [prefix_lens[i] for i in rows],
                                     [tables[i] for i in rows], block_size, rows, torch.device("cpu"),
                                     [seq_slots[i] for i in rows]), device)
        fmt.write(cache, pre, torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype).to(device),
                  torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype).to(device))
    meta = _to(AttnMetadata.build(query_lens, totals, tables, block_size, list(range(len(totals))),
                                  torch.device("cpu"), seq_slots), device)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, head_dim, generator=generator).to(dtype).to(device)
               for h in (num_q_heads, num_kv_heads, num_kv_heads))
    return cache, meta, q, k, v


def clone_cache(cache: dict) -> dict:
    return {key: t.clone() for key, t in cache.items()}


def reference_prefill(fmt, cache, meta: AttnMetadata, q, k, v) -> torch.Tensor:
    """float64 attention of q[N, Hq, D] over what the reference format hands the step (`append_and_read`,
    which also writes the step into `cache`)."""
    keys, values, mask = fmt.append_and_read(cache, meta, k, v, dtype=torch.float64)  # [B, L', Hkv, D]
    mask = mask[:, 0]  # [B, Qmax, L']
    seen = mask.any(1)  # keys some query reads; the others may be padding over poisoned memory
    keys = keys.masked_fill(~seen[:, :, None, None], 0.0)
    values = values.masked_fill(~seen[:, :, None, None], 0.0)
    group = q.shape[1] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    qr = fmt.prepare_query(q).double()[meta.query_index]  # [B, Qmax, Hq, D]
    scores = torch.einsum("bqhd,blhd->bhql", qr, keys) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhql,blhd->bqhd", scores.softmax(-1).nan_to_num(0.0), values)
    return fmt.finish_output(out)[meta.query_valid]


def prefill_inputs(fast, fmt, meta: AttnMetadata, num_q_heads: int):
    """The engine's `PrefillInputs` for the step `meta` describes."""
    q_lens = meta.query_valid.sum(1).tolist()
    ctx = meta.context_lens.tolist()
    tables = [row[: math.ceil(n / meta.block_size)] for row, n in zip(meta.block_tables.tolist(), ctx)]
    host = fast.prefill_host(q_lens, ctx, tables, meta.seq_slots.tolist(), num_q_heads)
    return fast.prefill_inputs(host)


def fast_prefill(fmt, cache, meta: AttnMetadata, q, k, v, fused_write: bool = True) -> torch.Tensor:
    """The engine's prefill kernel path on `cache` (written in place). `fused_write=False` stores the step's
    tokens through the reference format instead of the fused writer, so only the attention kernel (and
    the side-row bookkeeping) is under test."""
    from kv4rl.engine.fast_path import FastAttention
    from kv4rl.quant import quantize_int8

    fast = FastAttention(fmt, k.shape[1], k.shape[2], meta.block_size, q.device, num_q_heads=q.shape[1])
    inputs = prefill_inputs(fast, fmt, meta, q.shape[1])
    if fused_write:
        return fast.prefill(cache, q, k, v, inputs)
    from kv4rl.kernels.prefill_triton import paged_prefill_attention

    kr, vr = fmt.rotate_kv(k, v)
    fresh = None
    for prefix, x in (("k", kr), ("v", vr)):
        fmt.store(cache, prefix, meta.slot_mapping, x)  # the pages only (KV4's side rows come below)
    if fast.side:
        fresh = {"k": quantize_int8(kr), "v": quantize_int8(vr)}
    kc, ks, kz = fmt.paged_tensors(cache, "k")
    vc, vs, vz = fmt.paged_tensors(cache, "v")
    out = paged_prefill_attention(fmt.prepare_query(q), kc, vc, inputs.batch, kind=fmt.decode_kind, k_scale=ks,
                                  v_scale=vs, k_zero=kz, v_zero=vz, side=fmt.side_tensors(cache), fresh=fresh,
                                  out=torch.empty(q.shape, dtype=torch.float32, device=q.device))
    if fresh is not None:
        for prefix in ("k", "v"):
            codes, scale = fresh[prefix]
            cache[f"{prefix}_prot_codes"][inputs.keep_rows] = codes[inputs.keep_tokens]
            cache[f"{prefix}_prot_scale"][inputs.keep_rows] = scale[inputs.keep_tokens]
    return fmt.finish_output(out)
