"""Building blocks of the decoder, written to reproduce ``transformers``' arithmetic step by step.

The engine's log-probs are compared with the learner's (a ``transformers`` model) on every RL step,
so each block performs the same operations in the same dtype as the reference implementation:
RMSNorm normalises in float32 and multiplies by the weight after casting back; RoPE angles are
computed in float32 and cast to the activation dtype before the rotation.

Shape legend: N tokens (flattened over sequences), H heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x_f32 = x.to(torch.float32)
        x_f32 = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_f32.to(input_dtype)


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self.reduce = None  # tensor parallel: sums the ranks' partial down_proj outputs
        self.gate_up_proj = None  # the engine's merged gate|up projection (kv4rl.engine.merged_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_gate_up(x)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)

    def project_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate, up: one merged product split (views with the row stride of gate|up), or two."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x)
        return self.gate_proj(x), self.up_proj(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, optionally rescaled ("linear" or "llama3")."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 RoPE: keep short wavelengths, stretch long ones by `factor`, blend in between.

    A wavelength shorter than context/high_freq_factor is kept; one longer than
    context/low_freq_factor is divided by `factor`; in between, the frequency interpolates linearly
    in (context / wavelength) between the two.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > context / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelength < context / high_freq_factor, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF Llama/Qwen convention) with a cos/sin table per absolute position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device=None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_cache(device)

    def build_cache(self, device=None) -> None:
        """(Re)compute the float32 tables, e.g. after the module was materialised from ``meta``."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).to(torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        self.cos = angles.cos()
        self.sin = angles.sin()

    def apply_rotary(self, x_NHD: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
        """Rotate each token's heads by its own absolute position (tokens may come from many sequences).

        Same products and sums as HF's ``x * cos + rotate_half(x) * sin``, in the dtype of ``x``.
        """
        cos = self.cos[positions_N].to(x_NHD.dtype)[:, None, :]
        sin = self.sin[positions_N].to(x_NHD.dtype)[:, None, :]
        x1, x2 = x_NHD.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    forward = apply_rotary
