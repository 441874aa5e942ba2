"""A linear layer that keeps its weight as FP8 e4m3 codes with one float32 scale per output channel.

The point is half the weight bytes per decode step, so no full-precision copy of the weight is kept:
a refresh quantizes the incoming tensor straight into the codes and scales (in place, nothing is
reallocated). Both forward paths compute the same function,

    y = deq(q(x)) @ deq(W_q).T + b,    q(x): e4m3 with one scale per row (token), amax / 448,

and differ only in accumulation order and output rounding:

- ``scaled_mm``: CUDA with compute capability >= 8.9 (Hopper, Ada) in bfloat16 multiplies the FP8
  codes on the tensor cores with row-wise scales (``torch._scaled_mm``);
- dequantized fallback (CPU, older GPUs, other dtypes, in/out features not multiples of 16):
  dequantizes activation and weight to the compute dtype and runs an ordinary matmul.

``fused_quant`` (set by the engine with ``engine.fused_ops``) quantizes the activation of the
``scaled_mm`` path with one Triton kernel (``kv4rl.kernels.fp8_quant``) instead of ~8 small torch ones,
which dominate a CUDA-graph decode step; its codes and scales are ``quantize_fp8``'s bit for bit.
``decode_gemm`` (``engine.fp8_gemm``) multiplies those codes at up to ``MAX_DECODE_ROWS`` tokens with the
Triton e4m3 x e4m3 kernel of ``kv4rl.kernels.fp8_weight_gemm`` instead of ``torch._scaled_mm``: the same
function, summed in the FP8 MMA's own running sum (fast accumulation: within a norm-relative 4e-3 of
scaled_mm's float32 sum) with the bias added before the one rounding. An 8B step's block products take
2.88 / 3.25 ms with it at 64 / 128 tokens, against scaled_mm's 4.28 / 4.29 ms and cuBLAS BF16's
4.24 / 4.67 (twenty-second session); at 256 tokens the products alone were faster too (4.93 against 5.10
ms, twenty-first session) but the whole step was not, so larger products keep scaled_mm.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kv4rl.models.checkpoint_slots import CheckpointSlot
from kv4rl.quant.fp8 import QuantizedRows, dequantize_fp8, quantize_fp8

SCALED_MM_PATH = "scaled_mm (Hopper)"
FALLBACK_PATH = "dequantized fallback"
# the most tokens the Triton decode GEMM takes: a whole 8B step at 256 rows ran 1-3% faster on scaled_mm,
# at 128 rows 2-4% slower (bench decode-forward, twenty-first session)
MAX_DECODE_ROWS = 128
DECODE_GEMM_PATH = f"e4m3 GEMM (Triton) up to {MAX_DECODE_ROWS} tokens, {SCALED_MM_PATH} above"


def describe_fp8_paths(num_scaled_mm: int, num_linears: int, decode_gemm: bool = False) -> str:
    """Which products FP8 linears use, `num_scaled_mm` of `num_linears` on the tensor cores, those with the
    Triton kernel at decode sizes when `decode_gemm` (for logs)."""
    fast = DECODE_GEMM_PATH if decode_gemm else SCALED_MM_PATH
    if num_scaled_mm == num_linears:
        return fast
    if num_scaled_mm == 0:
        return FALLBACK_PATH
    return f"{fast} for {num_scaled_mm} of {num_linears} linears, {FALLBACK_PATH} for the rest"


@functools.cache
def scaled_mm_fits(in_features: int, out_features: int, dtype: torch.dtype, fp8_matmul: bool) -> bool:
    """Whether ``torch._scaled_mm`` can run an FP8 linear: FP8 tensor cores (`fp8_matmul`), bf16
    compute, and the in/out features multiples of 16 (its layout rule for the operands). The engine's
    plan asks it from the model's shape before any linear exists."""
    return fp8_matmul and dtype == torch.bfloat16 and in_features % 16 == 0 and out_features % 16 == 0


def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_matmul_device(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor-core matrix products (CUDA compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


class FP8Linear(nn.Module):
    """``nn.Linear`` replacement for inference; ``use_scaled_mm`` None picks the path per call,
    True forces ``torch._scaled_mm`` (raising where it cannot run), False forces the fallback.
    ``fused_quant`` quantizes the ``scaled_mm`` path's input in one Triton launch (same codes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.use_scaled_mm: bool | None = None
        self.fused_quant = False
        self.decode_gemm = False  # `enable_decode_gemm`

    def enable_decode_gemm(self, enabled: bool = True) -> None:
        """Run products of up to ``MAX_DECODE_ROWS`` tokens on the scaled_mm path with the Triton e4m3 GEMM;
        allocates its split-K arrival counters (zeros, kept zero by the kernel) here, outside any graph."""
        self.decode_gemm = enabled
        if enabled and getattr(self, "gemm_counters", None) is None:
            from kv4rl.kernels.fp8_weight_gemm import counter_slots

            self.register_buffer("gemm_counters", torch.zeros(counter_slots(self.out_features, MAX_DECODE_ROWS),
                                                              dtype=torch.int32, device=self.qweight.device),
                                 persistent=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize an ``nn.Linear`` (bias kept in its dtype); the caller drops the original."""
        w = linear.weight
        fp8 = cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device, dtype=w.dtype)
        fp8.load_weight_(w)
        if linear.bias is not None:
            fp8.bias.copy_(linear.bias)
        return fp8

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor, rows: slice = slice(None)) -> None:
        """Quantize a full-precision ``[out, in]`` weight into the codes and scales, in place; ``rows``
        fills only those output channels (one part of a merged q|k|v, say: scales are per row)."""
        expected = (len(range(self.out_features)[rows]), self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(weight.shape)}, expected {expected}")
        codes, scale = quantize_fp8(weight.to(self.qweight.device))
        self.qweight[rows].copy_(codes)
        self.weight_scale[rows].copy_(scale)

    def checkpoint_slots(self) -> dict:
        """HF names for the decoder's loader: ``weight`` is quantized on copy, ``bias`` copied."""
        slots = {"weight": CheckpointSlot((self.out_features, self.in_features), self.load_weight_)}
        if self.bias is not None:
            slots["bias"] = self.bias
        return slots

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.weight_scale, dtype)

    def scaled_mm_ok(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``torch._scaled_mm`` can run this linear here (`scaled_mm_fits`)."""
        return scaled_mm_fits(self.in_features, self.out_features, dtype, fp8_matmul_device(device))

    def path(self, dtype: torch.dtype, device: torch.device) -> str:
        """Which forward path an input of ``dtype`` on ``device`` takes."""
        if self.use_scaled_mm is False:
            return FALLBACK_PATH
        if self.scaled_mm_ok(dtype, device):
            return SCALED_MM_PATH
        if self.use_scaled_mm:
            raise RuntimeError(f"scaled_mm forced but unavailable for {dtype} on {device} ({self.extra_repr()})")
        return FALLBACK_PATH

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """``x``: activations, or their codes and scales (`QuantizedRows`, from a fused norm or SwiGLU),
        which skip the quantization and give the same output as the activations they came from."""
        if isinstance(x, QuantizedRows):
            return self._forward_codes(x)
        x_MK = x.reshape(-1, self.in_features)
        if self.path(x.dtype, x.device) == SCALED_MM_PATH and x_MK.shape[0] > 0:
            out_MN = self._scaled_mm(x_MK)
        else:
            out_MN = self._dequantized(x_MK)
        return out_MN.reshape(*x.shape[:-1], self.out_features)

    def _forward_codes(self, q: QuantizedRows) -> torch.Tensor:
        codes_MK, scale_M = q.codes.reshape(-1, self.in_features), q.scale.reshape(-1)
        if self.path(q.dtype, q.codes.device) == SCALED_MM_PATH and codes_MK.shape[0] > 0:
            out_MN = self._product(codes_MK, scale_M)
        else:
            out_MN = self._dequantized_codes(codes_MK, scale_M, q.dtype)
        return out_MN.reshape(*q.codes.shape[:-1], self.out_features)

    def _dequantized(self, x_MK: torch.Tensor) -> torch.Tensor:
        return self._dequantized_codes(*quantize_fp8(x_MK), x_MK.dtype)

    def _dequantized_codes(self, codes_MK: torch.Tensor, scale_M: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x_deq = dequantize_fp8(codes_MK, scale_M, dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x_deq, self.dequantized_weight(dtype), bias)

    def _scaled_mm(self, x_MK: torch.Tensor) -> torch.Tensor:
        # row-wise scaling takes any token count M (seen with torch 2.11 on an H200 for M = 1, 17)
        if self.fused_quant:
            from kv4rl.kernels.fp8_quant import quantize_rows_fp8  # Triton only when asked for

            codes_MK, scale_M = quantize_rows_fp8(x_MK)
        else:
            codes_MK, scale_M = quantize_fp8(x_MK.contiguous())
        return self._product(codes_MK, scale_M)

    def _product(self, codes_MK: torch.Tensor, scale_M: torch.Tensor) -> torch.Tensor:
        """The FP8 tensor-core product of quantized rows: the Triton GEMM at decode sizes or scaled_mm."""
        if self.decode_gemm and codes_MK.shape[0] <= MAX_DECODE_ROWS:
            from kv4rl.kernels.fp8_weight_gemm import fp8_weight_matmul

            return fp8_weight_matmul(codes_MK, self.qweight, self.weight_scale, self.bias, self.gemm_counters,
                                     x_scale=scale_M)
        out_MN = torch._scaled_mm(
            codes_MK,  # row-major [M, K]
            self.qweight.t(),  # column-major [K, N], as the FP8 GEMM wants its second operand
            scale_a=scale_M.view(-1, 1),  # [M, 1] float32: one scale per token
            scale_b=self.weight_scale.view(1, -1),  # [1, N] float32: one scale per output channel
            out_dtype=torch.bfloat16,
        )
        if self.bias is not None:
            out_MN = out_MN + self.bias
        return out_MN

    def extra_repr(self) -> str:
        fused = ", fused_quant=True" if self.fused_quant else ""
        fused += ", decode_gemm=True" if self.decode_gemm else ""
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}{fused}"
