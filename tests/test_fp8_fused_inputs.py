"""FP8 linears' inputs quantized inside the kernels that make them (`rms_norm_fp8`, `silu_mul_fp8` in
kv4rl.kernels.fused_ops) against the two launches they replace: the fused norm or SwiGLU, then
`quantize_rows_fp8`. The codes must be the same bits, so an engine that hands the codes over computes
what it did before.

Without CUDA the kernels run in Triton's CPU interpreter, whose fp32 -> e4m3 cast is wrong: there the
clamped float32 values before the cast are compared (`debug=True`, against `scaled_rows_fp8`), with the
CPU's scale (a division); on CUDA the codes themselves, with torch's CUDA scale (a product with 1/448).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.kernels.fp8_quant import quantize_rows_fp8, scaled_rows_fp8  # noqa: E402
from kv4rl.kernels.fused_ops import add_rms_norm, rms_norm, rms_norm_fp8, silu_mul, silu_mul_fp8  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# the interpreter rounds bf16 by truncation (tests/test_fused_ops.py): float32 and float16 there
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32)


def _quantized(y: torch.Tensor):
    """What the unfused path hands the linear: the codes (CUDA) or pre-cast values (interpreter), scale."""
    return quantize_rows_fp8(y) if CUDA else scaled_rows_fp8(y)


def _assert_same(got, want):
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    assert torch.equal(_bits(got[0]), _bits(want[0])), "codes differ"
    assert torch.equal(_bits(got[1]), _bits(want[1])), "scales differ"


def _rows(n: int, c: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=gen) * torch.logspace(-3, 2, n)[:, None]
    x[n // 2, c // 3] *= 300  # one loud channel: the scale follows it
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c", [(1, 64), (7, 96), (33, 2048)])
def test_norm_codes_equal_norm_then_quantize(n, c, dtype):
    x = _rows(n, c, dtype, seed=n + c)
    w = (torch.rand(c, generator=torch.Generator().manual_seed(c)) + 0.5).to(dtype).to(DEVICE)
    codes, scale, none = rms_norm_fp8(x, w, 1e-6, debug=not CUDA)
    assert none is None
    _assert_same((codes, scale), _quantized(rms_norm(x, w, 1e-6)))
    # with the residual add in front: the same codes, and the same residual sum as add_rms_norm's
    residual = _rows(n, c, dtype, seed=n * c)
    codes, scale, summed = rms_norm_fp8(x, w, 1e-6, residual, debug=not CUDA)
    normed, ref_sum = add_rms_norm(x, residual, w, 1e-6)
    _assert_same((codes, scale), _quantized(normed))
    assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,i", [(1, 96), (5, 1024), (9, 2500), (3, 5000)])  # one chunk (partial, whole), two
def test_swiglu_codes_equal_swiglu_then_quantize(n, i, dtype):
    merged = _rows(n, 2 * i, dtype, seed=n + i) * 0.1  # a merged gate|up product: strided halves
    gate, up = merged[:, :i], merged[:, i:]
    _assert_same(silu_mul_fp8(gate, up, debug=not CUDA), _quantized(silu_mul(gate, up)))


def test_zero_rows_and_bad_shapes():
    """A row of zeros gets scale 0 and zero codes (quantize_fp8's safe scale of 1); shapes are checked."""
    dtype = DTYPES[0]
    x = torch.zeros(3, 64, dtype=dtype, device=DEVICE)
    w = torch.ones(64, dtype=dtype, device=DEVICE)
    codes, scale, _ = rms_norm_fp8(x, w, 1e-6, debug=not CUDA)
    assert torch.equal(scale, torch.zeros(3, device=DEVICE)) and not codes.float().any()
    codes, scale = silu_mul_fp8(x, x, debug=not CUDA)
    assert torch.equal(scale, torch.zeros(3, device=DEVICE)) and not codes.float().any()
    with pytest.raises(ValueError, match="weight of their dtype"):
        rms_norm_fp8(x, w.float() if dtype != torch.float32 else w.half(), 1e-6)
    with pytest.raises(ValueError, match=r"must be \[N, I\] of one dtype"):
        silu_mul_fp8(x, x[:, :32])


# ---- the linear and the decoder that hand codes over --------------------------------------------

def test_fp8_linear_takes_codes_as_the_rows_they_came_from():
    """On the dequantized path (CPU) a linear given `QuantizedRows` computes what it computes from the
    rows: the same codes, the same product."""
    from kv4rl.engine.fp8_linear import FP8Linear
    from kv4rl.quant.fp8 import QuantizedRows, quantize_fp8

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=True)
    fp8 = FP8Linear.from_linear(linear)
    x = torch.randn(2, 3, 48)
    codes, scale = quantize_fp8(x)
    assert torch.equal(fp8(QuantizedRows(codes, scale, x.dtype)), fp8(x))
    assert fp8(QuantizedRows(codes[:0], scale[:0], x.dtype)).shape == (0, 3, 40)


@pytest.mark.parametrize("merge", [True, False])
def test_layers_hand_codes_only_where_every_consumer_takes_them(monkeypatch, merge):
    """intermediate 40 is not a multiple of 16: gate and up (40 outputs) and down (40 inputs) fall back,
    the merged gate|up (80 outputs) does not; the linears' flags decide, and switching off clears them."""
    from kv4rl.engine import fp8_linear
    from kv4rl.engine.fp8_weights import apply_fp8_weights, set_fused_quant
    from kv4rl.engine.merged_linears import merge_projections
    from kv4rl.models.args import ModelArgs
    from kv4rl.models.decoder import Decoder
    from kv4rl.models.fused import FP8Inputs, enable_fp8_inputs

    args = ModelArgs.from_hf_config({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6})
    model = Decoder(args, dtype=torch.bfloat16)
    apply_fp8_weights(model)
    if merge:
        merge_projections(model)
    assert enable_fp8_inputs(model) == 0  # on the CPU every linear takes the dequantized path
    monkeypatch.setattr(fp8_linear, "fp8_matmul_device", lambda device: True)  # as on an H200
    assert enable_fp8_inputs(model) == 0  # their inputs are not quantized by the Triton kernel yet
    model.enable_fused_ops()
    set_fused_quant(model)
    assert [layer.fp8_inputs for layer in model.model.layers] == [FP8Inputs(True, merge, False)] * 2
    set_fused_quant(model, fp8_inputs=False)
    assert all(layer.fp8_inputs is None for layer in model.model.layers)
    set_fused_quant(model)
    set_fused_quant(model, enabled=False)
    assert all(layer.fp8_inputs is None for layer in model.model.layers)
