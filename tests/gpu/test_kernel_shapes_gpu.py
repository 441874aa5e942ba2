"""The decode and prefill kernels on CUDA at head shapes other than Qwen3's 128-dim heads, which every
other GPU kernel test uses: 64-dim heads (SmolLM2's 9 query / 3 KV heads, Llama-3.2-1B's 32 / 8,
Qwen2.5-0.5B's 14 / 2) and 256-dim ones (BF16/FP8; INT4 groups stop at 128). The engine sends these shapes
to the Triton kernels (the CUDA INT4/FP8 bodies take head_dim 128 only), compiled with the GPU-only
settings (the bit-trick code conversions, tensor-core dots) that the interpreter's tests do not reach.
Fresh random inputs against the reference formats, as tests/test_kernels.py and the prefill GPU tests."""

import pytest
import torch

from tests.conftest import fresh_generator
from tests.kernel_cases import (
    clone_cache,
    fast_decode,
    fast_prefill,
    make_format,
    random_paged_batch,
    random_prefill_case,
    reference_decode,
    reference_prefill,
    rel_err,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda")
TOL = 2e-2  # bf16 dot operands, as the other kernel GPU tests
# (head_dim, KV heads, query heads, formats)
SHAPES = [(64, 3, 9, ("bf16", "fp8", "int4", "kv4")), (64, 8, 32, ("bf16", "fp8", "int4", "kv4")),
          (64, 2, 14, ("bf16", "fp8", "int4", "kv4")), (256, 2, 16, ("bf16", "fp8"))]
CASES = [(d, hkv, hq, name) for d, hkv, hq, names in SHAPES for name in names]
LENS = [1, 7, 16, 17, 150, 1000, 2049]


def _kernels(variant: str):
    """The engine's launch settings (`default`: heads on M for BF16/FP8, tokens on M with the bit-trick
    conversions for INT4/KV4), or every kind with tokens on M, with or without those conversions."""
    from kv4rl.kernels.decode_attention import DEFAULT_LAUNCH, DecodeKernels

    if variant == "default":
        return DecodeKernels(DEFAULT_LAUNCH, int4_cuda=False, fp8_cuda=False)
    launch = {kind: {**cfg, "tokens_on_m": True, "magic": variant == "tokens_on_m+magic"}
              for kind, cfg in DEFAULT_LAUNCH.items()}
    return DecodeKernels(launch, int4_cuda=False, fp8_cuda=False)


@pytest.mark.parametrize("variant", ["default", "tokens_on_m", "tokens_on_m+magic"])
@pytest.mark.parametrize("head_dim,hkv,hq,name", CASES)
def test_decode_kernels_at_other_head_shapes(head_dim, hkv, hq, name, variant):
    gen = fresh_generator()
    fmt = make_format(name, head_dim, n_sink=4, n_recent=128)
    cache, meta = random_paged_batch(fmt, LENS, hkv, head_dim, 16, DEVICE, gen)
    q = torch.randn(len(LENS), hq, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = reference_decode(fmt, cache, meta, q)
    for max_splits, split in [(1, max(LENS)), (8, 320), (64, 64)]:
        out = fast_decode(fmt, cache, meta, q, max_splits, split, out_dtype=torch.float32, kernels=_kernels(variant))
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL, (max_splits, split, rel_err(out, ref))
        for i in range(len(LENS)):
            assert rel_err(out[i], ref[i]) < 3 * TOL, (max_splits, i, LENS[i])


@pytest.mark.parametrize("head_dim,hkv,hq,name", CASES)
def test_prefill_kernel_at_other_head_shapes(head_dim, hkv, hq, name):
    """The engine's whole prefill (fused writer with the format's default rotation, kernel, side rows)."""
    gen = fresh_generator()
    fmt = make_format(name, head_dim, n_sink=16, n_recent=128)
    query, prefix = [700, 1, 37, 128, 300, 7], [0, 600, 0, 200, 16, 900]
    cache, meta, q, k, v = random_prefill_case(fmt, prefix, query, hkv, hq, head_dim, 16, DEVICE, gen)
    ref_cache, fast_cache = clone_cache(cache), clone_cache(cache)
    ref = reference_prefill(fmt, ref_cache, meta, q, k, v)
    out = fast_prefill(fmt, fast_cache, meta, q, k, v)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL, rel_err(out, ref)
    starts = torch.cumsum(torch.tensor([0] + query), 0).tolist()
    for i in range(len(query)):
        assert rel_err(out[starts[i]:starts[i + 1]], ref[starts[i]:starts[i + 1]]) < 2 * TOL, i
