"""KV quantization primitives against float64 references written from each format's definition.

The references never call kv4rl.quant: grids are enumerated from the bit-level definitions, rounding
is nearest with ties to the even grid index (= even mantissa / even integer), done in float64.
Where the implementation divides in float32 and the float64 quotient sits within 1e-5 (of a grid
step) of a rounding midpoint, either neighbour is accepted; such cases are counted and must be rare.
"""

import math

import numpy as np
import pytest
import torch

from kv4rl.quant import (
    decode_e2m1,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    hadamard_matrix,
    nvfp4_tensor_scale,
    pack_nibbles,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_mxfp4,
    quantize_nvfp4,
    rotate,
    storage_bytes,
    unpack_nibbles,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TIE_TOL = 1e-5


def e4m3_grid() -> np.ndarray:
    """Non-negative finite e4m3fn values from the definition: bias 7, no inf, S.1111.111 is NaN."""
    subnormal = [m / 8 * 2.0**-6 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return np.array(subnormal + normal)


def round_to_grid(values: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Signed nearest point of a sorted non-negative grid (clamped to its max), ties to even index.

    Returns (rounded values, magnitude index, mask of near-ties where float32 maths may differ).
    """
    magnitude = np.abs(values)
    upper = np.clip(np.searchsorted(grid, magnitude), 1, len(grid) - 1)
    lower = upper - 1
    to_lower, to_upper = magnitude - grid[lower], grid[upper] - magnitude
    take_upper = (to_upper < to_lower) | ((to_upper == to_lower) & (upper % 2 == 0))
    index = np.where(magnitude >= grid[-1], len(grid) - 1, np.where(take_upper, upper, lower))
    near_tie = (np.abs(to_upper - to_lower) <= TIE_TOL * (grid[upper] - grid[lower])) & (magnitude < grid[-1])
    return np.copysign(grid[index], values), index, near_tie


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def assert_on_grid(actual: np.ndarray, expected: np.ndarray, near_tie: np.ndarray, step: np.ndarray) -> None:
    """Equal everywhere except near-ties, where the neighbouring grid point is also accepted."""
    mismatch = actual != expected
    assert not (mismatch & ~near_tie).any(), f"{int((mismatch & ~near_tie).sum())} values off the reference"
    assert np.all(
        np.abs(actual - expected)[mismatch] <= np.broadcast_to(step, actual.shape)[mismatch] * 1.0001
    )
    assert near_tie.mean() < 0.01


def kv_like(shape: tuple[int, ...], seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Random keys/values with per-head scales, offsets and a few outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[:-1] + (1,), generator=gen))
    x = x + torch.randn(shape[:-1] + (1,), generator=gen)
    x[..., 3] *= 20.0
    return x.to(dtype=dtype, device=device)


def int4_reference(x: np.ndarray, scale16: np.ndarray, zero16: np.ndarray, group_size: int):
    """Codes and dequantization from the definition, using the stored fp16 scale and zero."""
    groups = x.reshape(x.shape[:-1] + (-1, group_size))
    scale, zero = scale16[..., None], zero16[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.where(scale > 0, np.clip((groups - zero) / scale, 0, 15), 0.0)
    codes, _, near_tie = round_to_grid(level, np.arange(16.0))
    return codes.reshape(x.shape), (zero + scale * codes).reshape(x.shape), near_tie.reshape(x.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matches_float64_reference(group_size, dtype, device):
    x = kv_like((5, 3, 128), seed=group_size, dtype=dtype, device=device)
    codes, scale, zero = quantize_int4(x, group_size)
    assert codes.shape == (5, 3, 64) and codes.dtype == torch.uint8
    assert (
        scale.shape == zero.shape == (5, 3, 128 // group_size) and scale.dtype == zero.dtype == torch.float16
    )

    xs = f64(x)
    groups = xs.reshape(5, 3, -1, group_size)
    lo, hi = groups.min(-1), groups.max(-1)
    np.testing.assert_array_equal(f64(zero), lo.astype(np.float16).astype(np.float64))
    exact_scale = (hi - lo) / 15
    half_ulp16 = np.spacing(exact_scale.astype(np.float16)).astype(np.float64) / 2
    assert np.all(np.abs(f64(scale) - exact_scale) <= half_ulp16 + 2**-22 * exact_scale)

    ref_codes, ref_values, near_tie = int4_reference(xs, f64(scale), f64(zero), group_size)
    assert_on_grid(f64(unpack_nibbles(codes)), ref_codes, near_tie, np.ones_like(xs))
    x_hat = dequantize_int4(codes, scale, zero, group_size, dtype=torch.float32)
    on_ref = ~near_tie
    np.testing.assert_allclose(f64(x_hat)[on_ref], ref_values[on_ref], rtol=2**-23, atol=0)

    # Error bound: half a step, plus the fp16 rounding of zero (bottom clamp) and of 15·scale (top).
    s, z = f64(scale), f64(zero)
    bound = s / 2 + np.abs(z - lo) + np.abs(hi - z - 15 * s)
    err = np.abs(f64(x_hat) - xs).reshape(groups.shape).max(-1)
    assert np.all(err <= bound * (1 + 1e-6))
    assert np.all(np.abs(z - lo) + np.abs(hi - z - 15 * s) <= 2**-10 * (np.abs(lo) + np.abs(hi)) + 1e-7)
    assert dequantize_int4(codes, scale, zero, group_size, dtype=dtype).dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_int4_representable_values_round_trip_exactly(device):
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (4, 2, 64), generator=gen).float()
    levels[..., 0], levels[..., 33] = 0.0, 15.0  # every group of 32 spans the full code range
    levels[..., 1], levels[..., 32] = 15.0, 0.0
    x = (levels * 2.0**-3).to(device)
    codes, scale, zero = quantize_int4(x, 32)
    assert torch.all(scale == 2.0**-3) and torch.all(zero == 0)
    assert torch.equal(unpack_nibbles(codes).cpu().float(), levels)
    assert torch.equal(dequantize_int4(codes, scale, zero, 32), x)
    # Exact half-way levels round to the even code: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 13.5 -> 14.
    halves = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 13.5] + [7.0] * 26) * 2.0**-3
    codes, _, _ = quantize_int4(halves, 32)
    assert unpack_nibbles(codes)[:6].tolist() == [0, 15, 0, 2, 2, 14]


def test_int4_clamps_when_fp16_scale_is_subnormal():
    # (hi - lo)/15 = 8.67e-8 rounds down to fp16's smallest subnormal 2^-24, so top levels exceed 15.
    x = torch.linspace(0, 1.3e-6, 32)
    codes, scale, zero = quantize_int4(x, 32)
    assert scale.item() == 2.0**-24 and zero.item() == 0.0
    ref_codes, ref_values, _ = int4_reference(f64(x), f64(scale), f64(zero), 32)
    assert ref_codes.max() == 15 and torch.equal(unpack_nibbles(codes).double(), torch.from_numpy(ref_codes))
    np.testing.assert_array_equal(f64(dequantize_int4(codes, scale, zero, 32)), ref_values)


def test_nibble_packing_order_low_is_even_channel():
    packed = pack_nibbles(torch.tensor([1, 2, 15, 0, 7, 9], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F, 0x97]
    assert unpack_nibbles(packed).tolist() == [1, 2, 15, 0, 7, 9]
    # Through the quantizer: group [0, 15·s, 3·s, 8·s, ...] -> bytes 0xF0, 0x83.
    x = torch.zeros(32)
    x[1], x[2], x[3], x[5] = 15.0, 3.0, 8.0, 1.0
    codes, _, _ = quantize_int4(x, 32)
    assert codes[:3].tolist() == [0xF0, 0x83, 0x10]


def test_int4_constant_groups_are_exact_and_finite():
    x = torch.empty(2, 64)
    x[0, :32], x[0, 32:] = 0.375, -2.5  # bf16/fp16-representable constants
    x[1, :32] = 0.1  # not fp16-representable: comes back as fp16(0.1)
    x[1, 32:] = torch.linspace(-1, 1, 32)
    codes, scale, zero = quantize_int4(x, 32)
    x_hat = dequantize_int4(codes, scale, zero, 32)
    assert torch.isfinite(x_hat).all() and torch.isfinite(scale).all()
    assert scale[0].tolist() == [0.0, 0.0] and scale[1, 0].item() == 0.0
    assert torch.equal(x_hat[0], x[0])
    assert torch.all(x_hat[1, :32] == float(np.float16(0.1)))


def test_int4_rejects_group_size_not_dividing_head_dim():
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.zeros(2, 96), 64)
    codes, scale, zero = quantize_int4(torch.zeros(2, 128), 64)
    with pytest.raises(ValueError, match="group_size"):
        dequantize_int4(codes, scale, zero, 128)


def test_int4_any_leading_shape_and_empty_batch():
    x = kv_like((2, 3, 4, 64), seed=3)
    codes, scale, _ = quantize_int4(x, 64)
    flat = quantize_int4(x.reshape(-1, 64), 64)
    assert torch.equal(codes.reshape(-1, 32), flat[0]) and torch.equal(scale.reshape(-1, 1), flat[1])
    empty = quantize_int4(torch.zeros(0, 8, 128), 128)
    assert [t.shape for t in empty] == [(0, 8, 64), (0, 8, 1), (0, 8, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_float64_reference(dtype, device):
    x = kv_like((6, 4, 64), seed=11, dtype=dtype, device=device)
    x[0, 0] = 0.0
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6, 4)
    xs = f64(x)
    amax = np.abs(xs).max(-1)
    # float32 division; CUDA computes x·(1/127), which may be 1 ulp off the correctly rounded quotient.
    np.testing.assert_allclose(f64(scale), amax / 127, rtol=2**-23, atol=0)
    s = f64(scale)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_codes, _, near_tie = round_to_grid(np.where(s > 0, xs / s, 0.0), np.arange(128.0))
    assert_on_grid(f64(codes), ref_codes, near_tie, np.ones_like(xs))
    x_hat = f64(dequantize_int8(codes, scale))
    np.testing.assert_allclose(x_hat, f64(codes) * s, rtol=2**-24, atol=0)
    assert np.all(np.abs(x_hat - xs) <= s / 2 * (1 + 1e-5))
    assert np.all(x_hat[0, 0] == 0) and np.all(np.abs(f64(codes)) <= 127)


def test_int8_representable_values_round_trip_exactly():
    ints = torch.randint(-127, 128, (3, 2, 128), generator=torch.Generator().manual_seed(1)).float()
    ints[..., 7] = -127.0
    x = ints * 2.0**-5
    codes, scale = quantize_int8(x)
    assert torch.equal(codes.float(), ints) and torch.equal(dequantize_int8(codes, scale), x)


def test_e4m3_reference_grid_matches_torch_float8():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = np.sort(np.unique(np.abs(bits[np.isfinite(bits)])))
    np.testing.assert_array_equal(finite, e4m3_grid())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_float64_reference(dtype, device):
    x = kv_like((6, 4, 64), seed=21, dtype=dtype, device=device)
    x[0, 0] = 0.0
    x[1, 1, 5:9] = torch.tensor([1e-5, -3e-6, 2e-7, 0.0], dtype=dtype)  # land in the subnormals
    codes, scale = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6, 4)
    xs = f64(x)
    np.testing.assert_allclose(f64(scale), np.abs(xs).max(-1) / 448, rtol=2**-23, atol=0)
    s = f64(scale)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_codes, index, near_tie = round_to_grid(np.where(s > 0, xs / s, 0.0), e4m3_grid())
    grid = e4m3_grid()
    step = grid[np.minimum(index + 1, len(grid) - 1)] - grid[index]
    assert_on_grid(f64(codes), ref_codes, near_tie, step)
    x_hat = f64(dequantize_fp8(codes, scale))
    np.testing.assert_allclose(x_hat, f64(codes) * s, rtol=2**-24, atol=0)
    scaled = np.abs(xs) / np.where(s > 0, s, 1)
    normal = scaled >= 2.0**-6
    assert np.all(np.abs(x_hat - xs)[normal] <= 2.0**-4 * np.abs(xs)[normal] * (1 + 1e-5))
    subnormal_err = np.abs(x_hat - xs) <= 2.0**-10 * np.broadcast_to(s, xs.shape) * (1 + 1e-5)
    assert np.all(subnormal_err[~normal])


def test_fp8_representable_values_round_trip_exactly():
    grid = torch.tensor(e4m3_grid(), dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    picks = grid[torch.randint(0, len(grid), (4, 2, 64), generator=gen)]
    signs = torch.where(torch.rand(picks.shape, generator=gen) < 0.5, -1.0, 1.0)
    values = picks * signs
    values[..., 0] = 448.0
    x = values * 2.0**-4
    codes, scale = quantize_fp8(x)
    assert torch.all(scale == 2.0**-4) and torch.equal(dequantize_fp8(codes, scale), x)


def test_e2m1_encoding_against_brute_force():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    probes = np.concatenate([E2M1_GRID, ties, np.linspace(0, 9, 181), [1e-9, 6.0001, 1e9]])
    probes = np.concatenate([probes, -probes]).astype(np.float32)
    codes = encode_e2m1(torch.from_numpy(probes))
    expected, index, _ = round_to_grid(probes.astype(np.float64), E2M1_GRID)
    np.testing.assert_array_equal(f64(decode_e2m1(codes)), expected)
    np.testing.assert_array_equal(codes.numpy() & 7, index)
    # Ties go to the even index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    tie_values = f64(decode_e2m1(encode_e2m1(torch.tensor(ties))))
    assert tie_values.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert encode_e2m1(torch.tensor([-6.0, 0.5, 3.0, -1.0])).tolist() == [0b1111, 0b0001, 0b0101, 0b1010]


def floor_log2(value: float) -> int:
    k = math.floor(math.log2(value))
    while 2.0**k > value:
        k -= 1
    while 2.0 ** (k + 1) <= value:
        k += 1
    return k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_float64_reference_exactly(dtype, device):
    x = kv_like((5, 2, 128), seed=31, dtype=dtype, device=device)
    x[0, 0, :32] = 0.0
    x[0, 1, 32:64] = 2.0**-125  # exponent -127 = biased 0: the float32-subnormal scale 2^-127
    x[0, 1, 64:96] = 2.0**-130  # below the e8m0 range: clamps to biased 0
    codes, exponent = quantize_mxfp4(x)
    assert codes.shape == (5, 2, 64) and exponent.shape == (5, 2, 4) and exponent.dtype == torch.uint8
    blocks = f64(x).reshape(5, 2, 4, 32)
    amax = np.abs(blocks).max(-1)
    expected_exp = np.array([0 if a == 0 else max(0, floor_log2(a) - 2 + 127) for a in amax.ravel()])
    np.testing.assert_array_equal(f64(exponent).ravel(), expected_exp)
    block_scale = 2.0 ** (expected_exp.reshape(amax.shape) - 127.0)
    expected, _, _ = round_to_grid(blocks / block_scale[..., None], E2M1_GRID)
    x_hat = dequantize_mxfp4(codes, exponent)
    np.testing.assert_array_equal(f64(x_hat), (expected * block_scale[..., None]).reshape(5, 2, 128))
    # Error: at most one e2m1 step (2·scale) / 2 inside the grid; the clamped part above 6·scale.
    err = np.abs(f64(x_hat).reshape(blocks.shape) - blocks)
    bound = np.maximum(block_scale[..., None], np.abs(blocks) - 6 * block_scale[..., None])
    assert np.all(err <= bound)


def test_mxfp4_representable_values_and_clamp():
    gen = torch.Generator().manual_seed(4)
    values = torch.tensor(E2M1_GRID, dtype=torch.float32)[torch.randint(0, 8, (3, 64), generator=gen)]
    values[:, 0], values[:, 32] = 6.0, -4.0
    x = values * torch.tensor([[2.0**-7], [1.0], [2.0**5]])
    codes, exponent = quantize_mxfp4(x)
    assert exponent.tolist() == [[120, 120], [127, 127], [132, 132]]
    assert torch.equal(dequantize_mxfp4(codes, exponent), x)
    clamped = dequantize_mxfp4(*quantize_mxfp4(torch.tensor([7.0, -7.5] + [1.0] * 30)))
    assert clamped[:3].tolist() == [6.0, -6.0, 1.0]


def nvfp4_reference(x: np.ndarray, block_scale: np.ndarray, tensor_scale: float) -> tuple:
    blocks = x.reshape(x.shape[:-1] + (-1, 16))
    denom = (block_scale * tensor_scale)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(denom > 0, blocks / denom, 0.0)
    values, index, near_tie = round_to_grid(scaled, E2M1_GRID)
    step = E2M1_GRID[np.minimum(index + 1, 7)] - E2M1_GRID[index]
    return (values * denom).reshape(x.shape), near_tie.reshape(x.shape), (step * denom).reshape(x.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_float64_reference(dtype, device):
    x = kv_like((5, 2, 128), seed=41, dtype=dtype, device=device)
    x[0, 0, :16] = 0.0
    tensor_scale = nvfp4_tensor_scale(x)
    xs = f64(x)
    assert tensor_scale == float(np.float32(np.abs(xs).max() / (6 * 448)))
    codes, block_scale = quantize_nvfp4(x, tensor_scale)
    assert codes.shape == (5, 2, 64) and block_scale.shape == (5, 2, 8)
    assert block_scale.dtype == torch.float8_e4m3fn
    ratio = np.abs(xs.reshape(5, 2, 8, 16)).max(-1) / (6 * np.float64(tensor_scale))
    ref_scale, index, near_tie = round_to_grid(ratio, e4m3_grid())
    grid = e4m3_grid()
    assert_on_grid(
        f64(block_scale), ref_scale, near_tie, grid[np.minimum(index + 1, len(grid) - 1)] - grid[index]
    )

    ref_values, near_tie, step = nvfp4_reference(xs, f64(block_scale), tensor_scale)
    x_hat = f64(dequantize_nvfp4(codes, block_scale, tensor_scale))
    close = np.abs(x_hat - ref_values) <= 2**-23 * np.abs(ref_values)
    assert np.all(close | near_tie) and near_tie.mean() < 0.01
    assert np.all(np.abs(x_hat - ref_values)[~close] <= step[~close] * 1.0001)
    denom = np.repeat(f64(block_scale) * tensor_scale, 16, axis=-1)
    assert np.all(np.abs(x_hat - xs) <= np.maximum(denom, np.abs(xs) - 6 * denom) * (1 + 1e-6))


def test_nvfp4_representable_values_round_trip_exactly():
    gen = torch.Generator().manual_seed(5)
    values = torch.tensor(E2M1_GRID, dtype=torch.float32)[torch.randint(0, 8, (4, 32), generator=gen)]
    values = values * torch.where(torch.rand(values.shape, generator=gen) < 0.5, -1.0, 1.0)
    values[:, 0], values[:, 16] = 6.0, -6.0
    x = values * torch.tensor([[2.0**-9], [2.0**-3], [1.0], [4.0]])
    codes, block_scale = quantize_nvfp4(x, tensor_scale=2.0**-8)
    np.testing.assert_array_equal(f64(block_scale)[:, 0], [2.0**-1, 2.0**5, 2.0**8, 448.0])
    x_hat = dequantize_nvfp4(codes, block_scale, 2.0**-8)
    assert torch.equal(x_hat[:3], x[:3])
    # The last row exceeds the calibrated range (ratio 2^10 > 448) and saturates at 6·448·tensor_scale.
    assert x_hat[3].abs().max().item() == 6 * 448 * 2.0**-8


def test_fp4_rejects_bad_shapes_and_scales():
    with pytest.raises(ValueError, match="nvfp4"):
        quantize_nvfp4(torch.zeros(2, 24), 1.0)
    with pytest.raises(ValueError, match="mxfp4"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="tensor_scale"):
        quantize_nvfp4(torch.zeros(2, 32), 0.0)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_hadamard_is_sylvester_and_orthonormal(n):
    matrix = f64(hadamard_matrix(n, torch.float64))
    # Sylvester's matrix has entry (-1)^popcount(i & j); scaled by 1/sqrt(n).
    expected = np.array([[(-1) ** (i & j).bit_count() for j in range(n)] for i in range(n)]) / math.sqrt(n)
    np.testing.assert_array_equal(matrix, expected)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(n), atol=1e-14)


def test_rotation_preserves_dot_products_and_is_involution():
    gen = torch.Generator().manual_seed(6)
    q, k = (
        torch.randn(7, 128, dtype=torch.float64, generator=gen),
        torch.randn(9, 128, dtype=torch.float64, generator=gen),
    )
    np.testing.assert_allclose(f64(rotate(q) @ rotate(k).T), f64(q @ k.T), rtol=0, atol=1e-12)
    np.testing.assert_allclose(f64(rotate(rotate(q))), f64(q), atol=1e-14)
    k32 = k.float().reshape(3, 3, 128)
    assert torch.allclose(rotate(rotate(k32)), k32, atol=1e-5)
    k16 = k.to(torch.bfloat16)
    assert rotate(k16).dtype == torch.bfloat16
    assert torch.allclose(rotate(k16).double(), rotate(k16.double()), atol=0.02)
    assert hadamard_matrix(64) is hadamard_matrix(64, torch.float32, "cpu")


def test_rotation_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="rotate"):
        hadamard_matrix(96)
    with pytest.raises(ValueError, match="rotate"):
        rotate(torch.zeros(3, 96))


def test_storage_bytes_per_token_per_head():
    # Hand-computed for D = 128: data bytes + scales (int4: fp16 scale+zero per group; fp8/int8: fp32).
    expected = {"bf16": 256, "fp32": 512, "fp8": 132, "int8": 132, "int4": 68, "nvfp4": 72, "mxfp4": 68}
    assert {name: storage_bytes(name, 128, 128) for name in expected} == expected
    assert storage_bytes("int4", 128, 32) == 64 + 4 * 4
    assert storage_bytes("int4", 64, 64) == 36
    with pytest.raises(ValueError, match="group_size"):
        storage_bytes("int4", 128, 48)
    with pytest.raises(ValueError, match="unknown KV format"):
        storage_bytes("int3", 128)
