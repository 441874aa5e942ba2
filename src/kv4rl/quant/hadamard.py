"""Orthonormal Hadamard rotation of head_dim, applied to keys (and queries) before quantization.

A rotation spreads outlier channels across all channels so a per-group scale wastes less range.
The Sylvester matrix scaled by 1/sqrt(n) is orthonormal and symmetric, so it is its own inverse and
``(q H)·(k H) = q·k``: rotating both sides leaves attention scores unchanged. Matrices are built in
float64 and cached per (n, dtype, device); callers must not modify the returned tensor in place.
"""

import functools
import math

import torch


def _check_power_of_two(n: int) -> None:
    if n < 1 or n & (n - 1) != 0:
        raise ValueError(f"rotate: Hadamard size must be a power of two, got {n}")


@functools.lru_cache(maxsize=64)
def _cached_hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return (matrix / math.sqrt(n)).to(dtype=dtype, device=device)


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The ``n × n`` orthonormal Sylvester-Hadamard matrix (``n`` a power of two)."""
    _check_power_of_two(n)
    return _cached_hadamard(n, dtype, torch.device(device if device is not None else "cpu"))


@functools.lru_cache(maxsize=64)
def hadamard_signs(n: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """The ±1 Sylvester matrix (`hadamard_matrix` times sqrt(n)), exact in every float dtype: kernels
    multiply by it, summing the exact products in float32, then scale by 1/sqrt(n)."""
    signs = hadamard_matrix(n, torch.float64) * math.sqrt(n)
    return signs.round().to(dtype=dtype, device=torch.device(device if device is not None else "cpu"))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last dim; also its own inverse. bf16/fp16 inputs are rotated in float32."""
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    matrix = hadamard_matrix(x.shape[-1], compute_dtype, x.device)
    return (x.to(compute_dtype) @ matrix).to(x.dtype)
