"""The varlen paged prefill kernel against the float64 reference of what the format hands a prefill.

Ragged query lengths, rows with a cached prefix (later chunks of a prompt, recomputes), GQA, every KV
format with kernels; KV4 with windows shorter and longer than the rows, so queries see their own
recent window in INT8 (fresh copies and the previous step's side rows) and the rest in INT4. The
final cache must be the reference's: pages and side rows. On CPU in Triton's interpreter at small
shapes (exact float32 dots); tests/gpu/test_prefill_kernel_gpu.py runs the real shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from tests.kernel_cases import (  # noqa: E402
    clone_cache,
    fast_prefill,
    make_format,
    random_prefill_case,
    reference_prefill,
    rel_err,
)

DEVICE = torch.device("cpu")
HEAD_DIM, HKV, HQ, BLOCK = 32, 2, 4, 4
# (prefix, new tokens) per row: fresh prompts, one-token rows, chunks after a cached prefix
PREFIX = [0, 0, 5, 0, 11, 2]
QUERY = [1, 3, 17, 20, 6, 1]


def _check(fmt, gen, prefix=PREFIX, query=QUERY, hq=HQ, fused_write=False, tol=1e-5):
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, HKV, hq, HEAD_DIM, BLOCK, DEVICE, gen)
    ref_cache, fast_cache = clone_cache(cache), clone_cache(cache)
    ref = reference_prefill(fmt, ref_cache, meta, q, k, v)
    out = fast_prefill(fmt, fast_cache, meta, q, k, v, fused_write=fused_write)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    starts = torch.cumsum(torch.tensor([0] + query), 0).tolist()
    for i in range(len(query)):  # every row, not just the batch on average
        assert rel_err(out[starts[i]:starts[i + 1]], ref[starts[i]:starts[i + 1]]) < 3 * tol, i
    return ref_cache, fast_cache


@pytest.mark.parametrize("name", ["bf16", "fp8", "int4", "kv4"])
def test_prefill_kernel_matches_reference(name, gen):
    """The step stored by the reference format, so the kernel and the side-row bookkeeping are what is
    compared: the outputs to float32 rounding, the final caches bit for bit."""
    fmt = make_format(name, HEAD_DIM, n_sink=2, n_recent=5)
    ref_cache, fast_cache = _check(fmt, gen)
    for key in ref_cache:
        a, b = ref_cache[key], fast_cache[key]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), key


@pytest.mark.parametrize("n_sink,n_recent", [(0, 4), (3, 0), (4, 30)])
def test_kv4_windows(gen, n_sink, n_recent):
    """No sinks, no recent window, and a window longer than every row (all INT8)."""
    fmt = make_format("kv4", HEAD_DIM, n_sink=n_sink, n_recent=n_recent)
    _check(fmt, gen, prefix=[0, 9, 3], query=[13, 7, 1])


@pytest.mark.parametrize("hq", [2, 6])
def test_gqa_groups(gen, hq):
    """One query head per KV head, and a group (3) that does not divide the tile's rows."""
    _check(make_format("kv4", HEAD_DIM, n_sink=2, n_recent=5), gen, prefix=[4, 0], query=[9, 22], hq=hq)


@pytest.mark.parametrize("name", ["bf16", "int4", "kv4"])
def test_fused_write_path(name, gen):
    """The engine's whole prefill (fused writer, kernel, side rows) without rotation, where the fused
    writer's codes are the reference's bit for bit (FP8's e4m3 cast is off in the interpreter). The
    output comes back in the activation dtype: bf16 rounding (2^-8) bounds the tolerance."""
    fmt = make_format(name, HEAD_DIM, n_sink=2, n_recent=5, rotate="none")
    ref_cache, fast_cache = _check(fmt, gen, fused_write=True, tol=5e-3)
    for key in ref_cache:
        assert torch.equal(ref_cache[key].nan_to_num(7.0), fast_cache[key].nan_to_num(7.0)), key


@pytest.mark.parametrize("head_dim,n_sink,n_recent,prefix,query,direct", [
    (HEAD_DIM, 2, 5, [0, 0, 3, 2], [7, 1, 4, 3], True),  # every row ends within n_sink + n_recent tokens
    (HEAD_DIM, 2, 5, [0, 3], [7, 5], False),  # one row's ring wraps by one token
    (128, 16, 128, [0, 16, 100], [128, 128, 44], True),  # Qwen3's heads and the engine's windows
])
def test_kv4_steps_inside_the_window_write_side_rows_directly(head_dim, n_sink, n_recent, prefix, query, direct,
                                                                gen, monkeypatch):
    """A KV4 step whose rows all end within n_sink + n_recent tokens stores the INT8 copies straight into the
    side rows and reads them there (no step buffer, no copies after it); one token more and it takes the
    buffer. Either way the output is the reference's and the cache (pages, side rows) equals its bit for bit."""
    from kv4rl.kernels import prefill_triton as pt

    fmt = make_format("kv4", head_dim, n_sink=n_sink, n_recent=n_recent, rotate="none")
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, HKV, HQ, head_dim, BLOCK, DEVICE, gen)
    seen, real = [], pt.paged_prefill_attention
    monkeypatch.setattr(pt, "paged_prefill_attention",
                        lambda *a, **kw: (seen.append(kw["fresh_in_side"]), real(*a, **kw))[1])
    ref_cache, fast_cache = clone_cache(cache), clone_cache(cache)
    ref = reference_prefill(fmt, ref_cache, meta, q, k, v)
    out = fast_prefill(fmt, fast_cache, meta, q, k, v, fused_write=True)
    assert seen == [direct]
    assert rel_err(out, ref) < 5e-3, rel_err(out, ref)
    for key in ref_cache:
        assert torch.equal(ref_cache[key].nan_to_num(7.0), fast_cache[key].nan_to_num(7.0)), key


def test_long_steps_launch_their_own_tiles(gen, monkeypatch):
    """INT4 pages: a step whose longest row reaches `LONG_PREFILL_CONTEXT` launches with `LONG_PREFILL_LAUNCH`
    (query tiles cut to match) and still computes the reference's output; shorter steps keep the defaults.
    KV4 and BF16 launch their defaults at every length, KV4's its own tiles."""
    from kv4rl.kernels import prefill_plan as plan
    from kv4rl.kernels import prefill_triton as pt
    from kv4rl.kernels.decode_common import DecodeKind

    short, long_cfg = plan.DEFAULT_PREFILL_LAUNCH[(DecodeKind.INT4, False)], plan.LONG_PREFILL_LAUNCH[(DecodeKind.INT4, False)]
    assert long_cfg != short
    assert plan.prefill_launch(DecodeKind.INT4, False, plan.LONG_PREFILL_CONTEXT - 1) == short
    assert plan.prefill_launch(DecodeKind.INT4, False, plan.LONG_PREFILL_CONTEXT) == long_cfg
    kv4 = plan.DEFAULT_PREFILL_LAUNCH[(DecodeKind.INT4, True)]
    assert kv4 != short
    assert plan.prefill_launch(DecodeKind.INT4, True, 1) == plan.prefill_launch(DecodeKind.INT4, True, 10**6) == kv4
    assert plan.prefill_launch(DecodeKind.BF16, False, 10**6) == plan.DEFAULT_PREFILL_LAUNCH[(DecodeKind.BF16, False)]

    monkeypatch.setattr(plan, "LONG_PREFILL_CONTEXT", max(p + q for p, q in zip(PREFIX, QUERY)))
    seen = []
    real = pt.paged_prefill_attention
    monkeypatch.setattr(pt, "paged_prefill_attention",
                        lambda *a, **kw: (seen.append((a[3].launch, a[3].queries_per_tile)), real(*a, **kw))[1])
    _check(make_format("int4", HEAD_DIM, n_sink=2, n_recent=5), gen)
    _check(make_format("kv4", HEAD_DIM, n_sink=2, n_recent=5), gen)
    group = HQ // HKV
    assert seen == [(long_cfg, long_cfg["BLOCK_M"] // group), (kv4, kv4["BLOCK_M"] // group)]


@pytest.mark.parametrize("name,rotate", [("kv4", "k"), ("kv4", "kv"), ("int4", "kv")])
def test_rotated_formats_through_the_engine_prefill(name, rotate, gen):
    """With a Hadamard rotation the engine rotates the step's queries (and, when values rotate, the
    outputs back) with the write's kernel, not the reference's float32 matmul. The output stays the
    reference's up to the fused write's rounding: the interpreter casts float32 to bf16 by truncation, which
    moves codes (0.010-0.040 with either rotation of the queries); a missing rotation errs by ~1."""
    _check(make_format(name, HEAD_DIM, n_sink=2, n_recent=5, rotate=rotate), gen, fused_write=True, tol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_rows_matches_float64(dtype, gen):
    """`rotate_rows` (the prefill's query rotation) is the float64 rotation of every row and head, rounded
    to the input dtype: within one rounding step (the interpreter truncates float32 to bf16) plus float32
    accumulation."""
    from kv4rl.kernels.kv_write import rotate_rows
    from kv4rl.quant import hadamard_matrix

    x = (torch.randn(7, 3, HEAD_DIM, generator=gen) * 3).to(dtype)
    got = rotate_rows(x, torch.arange(7)).double()
    hadamard = hadamard_matrix(HEAD_DIM, torch.float64)
    exact = x.double() @ hadamard
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    accumulation = HEAD_DIM * 2**-24 * (x.double().abs() @ hadamard.abs())
    assert got.shape == x.shape
    assert ((got - exact).abs() <= ulp * exact.abs() + accumulation).all()


@pytest.mark.parametrize("d", [32, 6])
def test_side_row_copy_in_words_equals_indexing(d, gen):
    """The KV4 prefill's copy of the protected INT8 rows (8-byte words where the rows allow, bytes
    otherwise) stores what plain indexing stores, into a slice of a larger buffer, touching nothing else."""
    from kv4rl.engine.fast_path import _copy_rows

    src = torch.randint(-127, 128, (9, 3, d), generator=gen, dtype=torch.int8)
    buffer = torch.randint(-127, 128, (2, 12, 3, d), generator=gen, dtype=torch.int8)
    dst, expect = buffer[1], buffer[1].clone()
    dst_rows, src_rows = torch.tensor([11, 0, 4, 7]), torch.tensor([8, 2, 2, 5])
    expect[dst_rows] = src[src_rows]
    before = buffer[0].clone()
    _copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, expect) and torch.equal(buffer[0], before)


@pytest.mark.parametrize("launch", [(64, 64), (128, 32)])
def test_kv4_at_a_real_head_shape(launch, gen, monkeypatch):
    """Qwen3's head shape (128 channels, 4 query heads per KV head, 16-token blocks) with the engine's KV4
    windows (16 sinks, 128 recent): rows that start fresh, continue a cached prefix past the window, and
    decode one token, under KV4's tiles and the other formats' (so both launch shapes are checked off the
    GPU too)."""
    from kv4rl.kernels import prefill_plan as plan
    from kv4rl.kernels.decode_common import DecodeKind

    tiles = {"BLOCK_M": launch[0], "BLOCK_N": launch[1], "num_warps": 4, "num_stages": 2}
    monkeypatch.setitem(plan.DEFAULT_PREFILL_LAUNCH, (DecodeKind.INT4, True), tiles)
    fmt = make_format("kv4", 128, n_sink=16, n_recent=128)
    query, prefix = [150, 1, 37, 20], [0, 200, 16, 150]
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, 2, 8, 128, 16, DEVICE, gen)
    ref = reference_prefill(fmt, clone_cache(cache), meta, q, k, v)
    out = fast_prefill(fmt, clone_cache(cache), meta, q, k, v, fused_write=False)
    starts = torch.cumsum(torch.tensor([0] + query), 0).tolist()
    for i in range(len(query)):
        assert rel_err(out[starts[i]:starts[i + 1]], ref[starts[i]:starts[i + 1]]) < 1e-5, i
