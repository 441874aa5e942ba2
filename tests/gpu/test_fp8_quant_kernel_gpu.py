"""The one-launch FP8 activation quantizer on CUDA: codes and scales equal `quantize_fp8`'s bit for bit,
and FP8Linear's scaled_mm path gives the same output with it (same operands, same `_scaled_mm`).

Expected to hold exactly: the scale is torch's `amax * fl(1/448)` (its CUDA divide-by-a-number), the
codes `div.rn` then clamp then `cvt.rn.satfinite` (round to nearest even, as torch's e4m3 cast within
±448). A mismatch in the scale points at how torch divides; one in the codes only (scales equal) at
the cast, e.g. the sign of a zero code.
"""

import pytest
import torch

from kv4rl.engine.fp8_linear import SCALED_MM_PATH, FP8Linear, fp8_matmul_device
from kv4rl.quant.fp8 import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fp8_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_matmul_device(torch.device("cuda")),
    reason="needs FP8 tensor cores (compute capability >= 8.9)",
)


def _activations(m: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes from 1e-30 to 1e4 (fp16: zeros and subnormals at the low
    end), an outlier, signed zeros, values that round to zero codes (both signs) and, with several
    rows, an all-zero row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda")
    x *= torch.logspace(-30, 4, m, device="cuda")[:, None] if m > 1 else 2.0
    zero_codes = torch.tensor([-0.0, 0.0, 1e-6, -1e-6, 3e-7, -3e-7, 0.5, -0.5], device="cuda")
    x[0, :8] = zero_codes * x[0].abs().max()
    x[-1, k // 3] *= 50
    if m > 2:
        x[m // 2] = 0
    finfo = torch.finfo(dtype)
    return x.clamp(-finfo.max, finfo.max).to(dtype)  # fp16 saturates rather than overflowing to inf


def _assert_same_quantization(x: torch.Tensor) -> None:
    from kv4rl.kernels.fp8_quant import quantize_rows_fp8

    codes, scale = quantize_rows_fp8(x)
    ref_codes, ref_scale = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), "scales differ"
    differ = codes.view(torch.uint8) != ref_codes.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} codes differ, first at {differ.nonzero()[:4].tolist()}"


@pytest.mark.parametrize("m,k", [(1, 2048), (256, 4096), (17, 12288)])
def test_codes_and_scales_equal_quantize_fp8_bf16(m, k):
    _assert_same_quantization(_activations(m, k, seed=m))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_codes_and_scales_equal_quantize_fp8_other_dtypes(dtype):
    _assert_same_quantization(_activations(37, 5000, dtype, seed=5))


def test_strided_rows_and_cuda_graph_replay():
    """Rows of a wider tensor, and the kernel captured in a CUDA graph (as the engine's decode step)."""
    from kv4rl.kernels.fp8_quant import quantize_rows_fp8

    wide = _activations(64, 6144, seed=9)
    _assert_same_quantization(wide[:, 1024:5120])
    x = wide[:, :2048].clone()
    quantize_rows_fp8(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, scale = quantize_rows_fp8(x)
    x.copy_(_activations(64, 2048, seed=10))
    graph.replay()
    ref_codes, ref_scale = quantize_fp8(x)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))


@needs_fp8_mm
@pytest.mark.parametrize("k,n", [(2048, 6144), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 17, 256])
def test_fp8_linear_fused_quant_gives_identical_outputs(m, k, n):
    torch.manual_seed(m)
    linear = torch.nn.Linear(k, n, bias=(m == 17), device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = FP8Linear.from_linear(linear)
    x = _activations(m, k, seed=m + k).view(m, 1, k)
    assert fp8.path(x.dtype, x.device) == SCALED_MM_PATH
    fp8.use_scaled_mm = True
    out = fp8(x)
    fp8.fused_quant = True
    fused = fp8(x)
    assert fused.shape == (m, 1, n) and torch.equal(fused, out)
