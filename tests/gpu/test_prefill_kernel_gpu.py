"""The prefill kernel on CUDA at a real head shape (head_dim 128, 32 query / 8 KV heads), fresh random
inputs, ragged rows up to 1000 tokens with and without a cached prefix, every format with kernels, the
engine's whole prefill (fused writer with the formats' default rotations and KV4 with both rotated, kernel,
the query and output rotations, KV4 side rows)."""

import pytest
import torch

from tests.conftest import fresh_generator
from tests.kernel_cases import clone_cache, fast_prefill, make_format, random_prefill_case, reference_prefill, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda")
TOL = 2e-2  # bf16 dot operands (q, codes, p·s), as the decode kernels' GPU tests


@pytest.mark.parametrize("name,rotate", [("bf16", "auto"), ("fp8", "auto"), ("int4", "auto"), ("kv4", "auto"),
                                         ("kv4", "kv")])
def test_prefill_kernel_gpu_matches_reference(name, rotate):
    gen = fresh_generator()
    fmt = make_format(name, 128, n_sink=16, n_recent=128, rotate=rotate)
    query = [1000, 1, 37, 128, 300, 513, 7, 999]
    prefix = [0, 600, 0, 200, 16, 0, 900, 1]
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, 8, 32, 128, 16, DEVICE, gen)
    ref_cache, fast_cache = clone_cache(cache), clone_cache(cache)
    ref = reference_prefill(fmt, ref_cache, meta, q, k, v)
    out = fast_prefill(fmt, fast_cache, meta, q, k, v)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL, rel_err(out, ref)
    starts = torch.cumsum(torch.tensor([0] + query), 0).tolist()
    for i in range(len(query)):
        assert rel_err(out[starts[i]:starts[i + 1]], ref[starts[i]:starts[i + 1]]) < 2 * TOL, (name, i)
    # the cache the fast path leaves: pages written where the reference wrote them, side rows alike
    for key in ref_cache:
        written = torch.isfinite(ref_cache[key].float()) if ref_cache[key].dtype.is_floating_point else None
        if written is not None and ref_cache[key].dtype != torch.float8_e4m3fn:
            assert torch.equal(written, torch.isfinite(fast_cache[key].float())), key


@pytest.mark.parametrize("rotate", ["auto", "kv"])
def test_kv4_short_steps_through_the_side_rows_gpu(rotate):
    """A KV4 step whose rows all end within the sinks and the window (128-token prompts, a continuation to
    144 tokens) writes its INT8 copies straight into the side rows and reads them there
    (`PrefillInputs.direct`); the output and the side rows match the reference's."""
    from kv4rl.kernels import prefill_triton as pt

    gen = fresh_generator()
    fmt = make_format("kv4", 128, n_sink=16, n_recent=128, rotate=rotate)
    query, prefix = [128, 128, 7, 44, 1], [0, 0, 16, 100, 143]
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, 8, 32, 128, 16, DEVICE, gen)
    seen, real = [], pt.paged_prefill_attention
    pt.paged_prefill_attention = lambda *a, **kw: (seen.append(kw["fresh_in_side"]), real(*a, **kw))[1]
    try:
        ref_cache, fast_cache = clone_cache(cache), clone_cache(cache)
        ref = reference_prefill(fmt, ref_cache, meta, q, k, v)
        out = fast_prefill(fmt, fast_cache, meta, q, k, v)
    finally:
        pt.paged_prefill_attention = real
    assert seen == [True]
    assert rel_err(out, ref) < TOL, rel_err(out, ref)
    for key in ("k_prot_scale", "v_prot_scale"):  # rows nobody wrote stay NaN in both
        assert torch.equal(torch.isfinite(fast_cache[key]), torch.isfinite(ref_cache[key])), key
        assert rel_err(fast_cache[key].nan_to_num(0.0), ref_cache[key].nan_to_num(0.0)) < TOL, key
