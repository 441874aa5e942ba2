"""The one-launch FP8 activation quantizer (kv4rl.kernels.fp8_quant) against `quantize_fp8` and float64.

Without CUDA the kernel runs in Triton's CPU interpreter, whose fp32 -> e4m3 cast is wrong: these tests
check the scale and the clamped float32 values the codes are cast from (`scaled_rows_fp8`), bit for
bit; codes on CUDA are tests/gpu/test_fp8_quant_kernel_gpu.py. A float64 quotient or product of two
float32 values rounds to the correctly rounded float32 one (53 >= 2 * 24 + 2 bits), so float64 gives
independent exact references for both ways of computing the scale.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.fp8_linear import FP8Linear  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402
from kv4rl.kernels.fp8_quant import quantize_rows_fp8, scaled_rows_fp8  # noqa: E402
from kv4rl.quant.fp8 import quantize_fp8  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _rows(m: int, k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Gaussian rows at magnitudes from 1e-41 (subnormal scales, or zero ones) to 1e36, with an
    all-zero row, a row of signed zeros and tiny values, and a row with one huge outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    # the interpreter converts bf16 subnormals to float32 wrongly (the GPU does not): keep bf16 normal
    low = -30 if dtype == torch.bfloat16 else -41
    x *= torch.logspace(low, 36, m, dtype=torch.float64)[:, None] if m > 1 else 3.0
    if m > 4:
        x[m // 3] = 0
        x[m // 3 + 1] = -0.0
        x[m // 3 + 1, ::3] = -1e-30
        x[m // 2, k // 2] = 1e4 * x[m // 2].abs().max()
    finfo = torch.finfo(dtype)
    return x.clamp(-finfo.max, finfo.max).to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _reference(x: torch.Tensor, reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped float32 values, float32 scale) in float64: amax/448 (torch on the CPU) or amax times
    the float32 1/448 (torch on CUDA), each rounded once to float32; on the CPU, where torch divides."""
    values = x.double().cpu()
    amax = values.abs().amax(dim=-1)
    inv = torch.tensor(1.0, dtype=torch.float32) / 448  # torch's host-side reciprocal, in float32
    scale = (amax * inv.double() if reciprocal else amax / 448).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    return (values / safe[:, None]).float().clamp(-448, 448).to(x.device), scale.to(x.device)


@pytest.mark.parametrize("m,k,dtype", [
    (1, 2048, torch.float32), (37, 100, torch.float32), (37, 5000, torch.float32),
    (37, 100, torch.float16), (37, 100, torch.bfloat16), (6, 4500, torch.bfloat16)])
def test_scale_and_precast_values_equal_quantize_fp8(m, k, dtype):
    """K a power of two, below one block, and over a 4096-element chunk with a partial last one."""
    x = _rows(m, k, dtype, seed=m + k)
    clamped, scale = scaled_rows_fp8(x)
    _, ref_scale = quantize_fp8(x)
    values = x.float()
    safe = torch.where(ref_scale > 0, ref_scale, torch.ones_like(ref_scale))[:, None]
    assert clamped.shape == (m, k) and clamped.dtype == torch.float32 and scale.dtype == torch.float32
    assert torch.equal(_bits(scale), _bits(ref_scale))
    assert torch.equal(_bits(clamped), _bits((values / safe).clamp(-448, 448)))  # signed zeros too
    ref_clamped, ref_scale64 = _reference(x, reciprocal=CUDA)
    assert torch.equal(_bits(scale), _bits(ref_scale64)) and torch.equal(_bits(clamped), _bits(ref_clamped))


def test_reciprocal_scale_is_torch_cudas_product():
    """`reciprocal=True` is torch's CUDA divide-by-a-number (amax * fl(1/448)), the other mode the
    correctly rounded quotient: they disagree on many rows, and each matches its float64 reference."""
    x = _rows(64, 96, seed=7)
    results = {}
    for reciprocal in (False, True):
        clamped, scale = scaled_rows_fp8(x, reciprocal=reciprocal)
        ref_clamped, ref_scale = _reference(x, reciprocal)
        assert torch.equal(_bits(scale), _bits(ref_scale)), reciprocal
        assert torch.equal(_bits(clamped), _bits(ref_clamped)), reciprocal
        results[reciprocal] = scale
    assert int((results[True] != results[False]).sum()) >= 5


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_non_finite_rows_propagate_like_torch():
    """inf makes the scale inf (finite values 0, inf/inf NaN); a NaN makes the scale NaN, which the
    `where` turns into a divisor of 1."""
    x = _rows(6, 40, seed=3)
    x[1, 5] = float("inf")
    x[2, 7] = -float("inf")
    x[3, 9] = float("nan")
    clamped, scale = scaled_rows_fp8(x)
    _, ref_scale = quantize_fp8(x)
    safe = torch.where(ref_scale > 0, ref_scale, torch.ones_like(ref_scale))[:, None]
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(clamped, (x.float() / safe).clamp(-448, 448), rtol=0, atol=0, equal_nan=True)


def test_strided_rows_and_shapes():
    """Rows of a wider tensor (a row stride other than K), no rows, and the codes' layout."""
    wide = _rows(5, 200, seed=1)
    x = wide[:, 30:150]
    clamped, scale = scaled_rows_fp8(x)
    ref_clamped, ref_scale = _reference(x.contiguous(), reciprocal=CUDA)
    assert torch.equal(_bits(clamped), _bits(ref_clamped)) and torch.equal(_bits(scale), _bits(ref_scale))
    codes, scale = quantize_rows_fp8(x)
    assert codes.shape == (5, 120) and codes.dtype == torch.float8_e4m3fn and codes.is_contiguous()
    assert torch.equal(_bits(scale), _bits(ref_scale))
    codes, scale = quantize_rows_fp8(x[:0])
    assert codes.shape == (0, 120) and scale.shape == (0,)
    for bad in (x[0], x.to(torch.int32), x[:, :0]):
        with pytest.raises(ValueError, match="quantize_rows_fp8"):
            quantize_rows_fp8(bad)


def test_fp8_linear_fused_quant_feeds_scaled_mm_the_kernels_operands(monkeypatch):
    """FP8Linear's scaled_mm path with `fused_quant` hands torch._scaled_mm the kernel's codes and
    scales (3-D input, non-contiguous rows); recorded here, as _scaled_mm needs Hopper."""
    layer = FP8Linear(64, 32, bias=True, device=DEVICE)
    layer.load_weight_(torch.randn(32, 64, device=DEVICE))
    calls = []

    def fake_scaled_mm(codes, weight_t, scale_a, scale_b, out_dtype):
        calls.append((codes, scale_a))
        return torch.zeros(codes.shape[0], weight_t.shape[1], dtype=out_dtype, device=codes.device)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    x = _rows(6, 128, seed=2)[:, ::2].reshape(2, 3, 64)
    layer.fused_quant = True
    assert layer._scaled_mm(x.reshape(-1, 64)).shape == (6, 32)
    codes, scale_a = calls[-1]
    expected_codes, expected_scale = quantize_rows_fp8(x.reshape(-1, 64))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (6, 64)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert torch.equal(_bits(scale_a.view(-1)), _bits(expected_scale))
    assert torch.equal(_bits(expected_scale), _bits(quantize_fp8(x.reshape(-1, 64))[1]))
    assert "fused_quant=True" in repr(layer)


@pytest.mark.parametrize("fused_ops", [False, True])
def test_engine_fused_ops_switches_fp8_linears_to_the_kernel(tiny_qwen3, fused_ops):
    path, _ = tiny_qwen3
    cfg = EngineConfig(kv=KVConfig(format="fp32"), weight_format="fp8", max_model_len=64, fused_ops=fused_ops,
                       cuda_graphs=False)
    engine = Engine(path, cfg, max_num_seqs=2, device=DEVICE, dtype="float32")
    linears = [m for m in engine.model.modules() if isinstance(m, FP8Linear)]
    # two layers of merged q|k|v, o, merged gate|up, down (engine.merge_projections)
    assert len(linears) == 8 and all(m.fused_quant == fused_ops for m in linears)
