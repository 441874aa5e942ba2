"""The weight-only FP8 GEMM (kv4rl.kernels.fp8_weight_gemm) against float64 maths.

On CUDA the kernel runs as compiled; without CUDA in Triton's CPU interpreter (small shapes), whose
bf16 rounding truncates instead of rounding to nearest: one bf16 ulp (2^-7 relative) there, half of
one (2^-8) on the GPU. Above the output's rounding, the float32 accumulation of K exact products may
add at most K * 2^-24 * sum|x_k w_k| (plus the scale and bias roundings), the classic bound.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.kernels.fp8_weight_gemm import (  # noqa: E402
    GemmConfig,
    counter_slots,
    fp8_weight_matmul,
    gemm_problem,
    pick_config,
)
from kv4rl.quant.fp8 import quantize_fp8  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
ROUNDING = 2.0**-8 if CUDA else 2.0**-7


def _problem(m: int, n: int, k: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    # weights with per-channel magnitudes over 4 decades, activations with a loud token
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    codes, scale = quantize_fp8(w)
    x = torch.randn(m, k, generator=gen)
    x[0] *= 50
    b = torch.randn(n, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x.bfloat16()), to(codes), to(scale), to(None if b is None else b.bfloat16())


def _check(y: torch.Tensor, x, codes, scale, bias) -> None:
    """Within the output rounding plus float32 accumulation of the float64 product of the same
    bf16 activations and dequantized weights."""
    xd, wd = x.double().cpu(), codes.double().cpu() * scale.double().cpu()[:, None]
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if bias is not None:
        ref += bias.double().cpu()
        mag += bias.double().cpu().abs()
    bound = ROUNDING * ref.abs() + (x.shape[1] + 3) * 2.0**-24 * mag + 1e-30
    err = (y.double().cpu() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bound (max abs err {err.max().item():.3g})"
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape


# (m, n, k, config): ragged rows and channels, K of one 16-wide block, every split count, and the
# tiles the launcher picks itself
CASES = [
    (1, 48, 64, None),
    (5, 80, 48, GemmConfig(16, 32, 16, 1)),
    (17, 64, 256, GemmConfig(16, 32, 32, 2, 4, 2)),
    (33, 80, 128, GemmConfig(32, 16, 16, 4)),
    (20, 40, 256, GemmConfig(16, 16, 32, 8, 4, 3)),
    (64, 96, 512, None),
]
if CUDA:  # decode shapes of the engine's products, with the launcher's split-K choice
    CASES += [(m, n, k, None) for m in (1, 64, 100, 128, 256) for n, k in ((4096, 4096), (6144, 4096), (4096, 12288))]
    CASES += [(200, 1024, 2048, GemmConfig(64, 128, 128, 2, 8, 4)), (256, 512, 1024, GemmConfig(128, 64, 128, 2, 4, 3))]


@pytest.mark.parametrize("m,n,k,config", CASES)
def test_matches_float64(m, n, k, config):
    x, codes, scale, bias = _problem(m, n, k, seed=m * 7 + n + k, bias=m % 2 == 1)
    counters = torch.zeros(counter_slots(n, max(m, 256)), dtype=torch.int32, device=DEVICE)
    y = fp8_weight_matmul(x, codes, scale, bias, counters, config)
    _check(y, x, codes, scale, bias)
    assert int(counters.abs().sum()) == 0  # every tile's last program set its counter back


@pytest.mark.parametrize("m,n,k,config", [(1, 48, 64, None), (17, 80, 256, GemmConfig(16, 32, 32, 4)),
                                           (64, 96, 512, GemmConfig(64, 64, 64, 2)),
                                           # tiles by the copy engine (TMA), ragged edges read as zeros
                                           (17, 80, 256, GemmConfig(16, 32, 32, 4, tma=True)),
                                           (40, 96, 512, GemmConfig(64, 64, 64, 2, tma=True))]
                         + ([(m, 4096, 4096, None) for m in (3, 64, 256)]
                            + [(m, n, k, GemmConfig(bm, 64, 256, split, 4, 3, tma=True))
                               for m, n, k, bm, split in ((3, 4096, 4096, 16, 2), (64, 6144, 4096, 64, 1),
                                                          (100, 4096, 12288, 128, 4), (128, 24576, 4096, 128, 1))]
                            if CUDA else []))
def test_fp8_activations_match_float64(m, n, k, config):
    """With ``x_scale`` the activations are e4m3 codes (one scale per row): the product is the one of the
    dequantized activations and weights, as the ``scaled_mm`` path computes it."""
    x, codes, scale, bias = _problem(m, n, k, seed=m + n + k, bias=m % 2 == 1)
    x_codes, x_scale = quantize_fp8(x.float())
    if config is not None and m % 2:  # also the float32 add per K block
        config = GemmConfig(**{**config.__dict__, "fast_accum": False})
    counters = torch.zeros(counter_slots(n, max(m, 256)), dtype=torch.int32, device=DEVICE)
    y = fp8_weight_matmul(x_codes, codes, scale, bias, counters, config, x_scale=x_scale)
    xd = (x_codes.double().cpu() * x_scale.double().cpu()[:, None])
    wd = codes.double().cpu() * scale.double().cpu()[:, None]
    ref, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        ref += bias.double().cpu()
        mag += bias.double().cpu().abs()
    # on the GPU the e4m3 products are summed by the tensor cores, whose FP8 running sum keeps fewer bits
    # than float32: an allowance of 2^-12 of the sum of |products| with a float32 add per K block, 2^-10
    # with one running sum over K (fast_accum; 2^-12 was exceeded at K = 4,096 on an H200); the interpreter: float32
    fast = (config or pick_config(m, n, k, 132)).fast_accum
    acc_err = (2.0**-10 if fast else 2.0**-12) if CUDA else (k + 4) * 2.0**-24
    bound = ROUNDING * ref.abs() + acc_err * mag + 1e-30
    worst = ((y.double().cpu() - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bound"
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("m,n,k,config", [(5, 48, 64, None), (33, 80, 256, GemmConfig(32, 32, 32, 4))]
                         + ([(64, 2048, 6144, None), (256, 4096, 2048, None)] if CUDA else []))
def test_bf16_weights_match_float64(m, n, k, config):
    """The kernel also multiplies bf16 weights (the skinny-GEMM comparison against cuBLAS)."""
    x, _, _, bias = _problem(m, n, k, seed=m + 2 * n + k, bias=m % 2 == 1)
    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16().to(DEVICE)
    scale = torch.rand(n, generator=gen).add(0.5).to(DEVICE)
    counters = torch.zeros(counter_slots(n, max(m, 256)), dtype=torch.int32, device=DEVICE)
    _check(fp8_weight_matmul(x, w, scale, bias, counters, config), x, w, scale, bias)


def test_split_k_is_deterministic_and_reusable():
    """Partials are summed in slice order, so repeated calls give the same bits whichever program
    finished last; the counters, reset by each call, serve the next one."""
    x, codes, scale, bias = _problem(24, 64, 512, seed=3)
    counters = torch.zeros(counter_slots(64, 24), dtype=torch.int32, device=DEVICE)
    cfg = GemmConfig(16, 32, 32, 4)
    first = fp8_weight_matmul(x, codes, scale, bias, counters, cfg)
    for _ in range(3):
        assert torch.equal(fp8_weight_matmul(x, codes, scale, bias, counters, cfg), first)
    # the unsplit product of the same numbers agrees within the float32 summation bound
    _check(fp8_weight_matmul(x, codes, scale, bias, counters, GemmConfig(16, 32, 32, 1)), x, codes, scale, bias)


def test_pick_config_feeds_small_token_tiles_by_tma_and_slices_k_for_the_rest():
    # 8B o_proj at 64 tokens: one 64-token tile, TMA-fed, five 256-wide K blocks in flight, no K slices
    cfg = pick_config(64, 4096, 4096, 132)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages, cfg.tma) == (64, 64, 256, 1, 5, True)
    assert pick_config(64, 24576, 4096, 132).block_k == 128  # gate|up: six times wider than deep
    assert pick_config(64, 24576, 4096, 132).num_stages == 4
    assert pick_config(3, 4096, 4096, 132).block_m == 16  # the tensor cores' smallest tile
    assert pick_config(128, 4096, 4096, 132).block_m == 64  # 32 tiles of 128 tokens -> 64 of 64 ...
    assert pick_config(128, 4096, 4096, 132).tma  # ... which TMA feeds
    assert not pick_config(64, 4096, 4096, 132, x_fp8=False).tma  # bf16 activations: pointer-fed
    # 128-token tiles are pointer-fed, with K slices where the tiles fill at most half the SMs
    assert pick_config(256, 24576, 4096, 132).block_m == 128  # 384 tiles of 128 tokens
    assert pick_config(256, 4096, 4096, 132).block_m == 128  # 128 tiles fill more than half
    qkv = pick_config(128, 6144, 4096, 132)  # 96 tiles of 128 tokens: 192 of 64 would take two waves
    assert (qkv.block_m, qkv.tma, qkv.split_k) == (128, False, 1)
    assert pick_config(256, 4096, 2048, 132, x_fp8=False).block_k == 128  # bf16 tiles: half as deep
    down = pick_config(128, 2048, 6144, 132, x_fp8=False)  # bf16: 64 tiles of 64 x 64, two slices of 3,072
    assert (down.block_m, down.split_k, down.tma) == (64, 2, False)
    small = pick_config(1, 64, 48, 132)  # K = 48: 16-wide K blocks, too short to split, pointer-fed
    assert (small.block_k, small.split_k, small.tma) == (16, 1, False)
    for m, n, k in ((64, 4096, 4096), (128, 4096, 12288), (256, 6144, 4096), (64, 2048, 6144)):
        cfg = pick_config(m, n, k, 132)
        assert k % (cfg.split_k * cfg.block_k) == 0 and k // cfg.split_k >= 8 * cfg.block_k


def test_unaligned_operands_fall_back_from_tma_to_pointers():
    """A row view that starts off a 16-byte boundary cannot be read by the copy engine: the launcher's own
    tiles run pointer-fed (same result), an explicit TMA setting is refused."""
    x, codes, scale, _ = _problem(9, 64, 256, seed=3, bias=False)
    x_codes, x_scale = quantize_fp8(x.float())
    padded = torch.zeros(9, 256 + 8, dtype=x_codes.dtype, device=DEVICE)
    padded[:, 8:] = x_codes
    shifted = padded[:, 8:]  # rows start 8 bytes in, stride 264: not 16-byte aligned
    counters = torch.zeros(counter_slots(64, 16), dtype=torch.int32, device=DEVICE)
    assert pick_config(9, 64, 256, 4 if not CUDA else 132).tma
    want = fp8_weight_matmul(x_codes, codes, scale, None, counters, x_scale=x_scale)
    assert torch.equal(fp8_weight_matmul(shifted, codes, scale, None, counters, x_scale=x_scale), want)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_weight_matmul(shifted, codes, scale, None, counters, GemmConfig(16, 64, 128, tma=True), x_scale=x_scale)


def test_bad_inputs_are_named():
    x, codes, scale, _ = _problem(4, 32, 64, seed=0)
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    assert gemm_problem(x, codes, scale) is None
    assert "bfloat16" in gemm_problem(x.float(), codes, scale)
    assert "float8_e4m3fn" in gemm_problem(x, codes.float(), scale)
    assert "multiple of 16" in gemm_problem(x[:, :40], codes[:, :40].contiguous(), scale)
    assert "do not multiply" in gemm_problem(x, codes[:, :32].contiguous(), scale)
    assert "one value per output channel" in gemm_problem(x, codes, scale[:8])
    assert "float8_e4m3fn codes" in gemm_problem(x, codes, scale, x_scale=scale[:4])
    x_codes = x.to(torch.float8_e4m3fn)
    assert "one value per row" in gemm_problem(x_codes, codes, scale, x_scale=scale)
    assert gemm_problem(x_codes, codes, scale, x_scale=scale[:4]) is None
    with pytest.raises(ValueError, match="needs 2 int32 counters, got 1"):
        fp8_weight_matmul(x, codes, scale, None, counters[:1], GemmConfig(16, 16, 16, 2))
    with pytest.raises(ValueError, match="not a multiple of split_k x block_k"):
        fp8_weight_matmul(x, codes, scale, None, counters, GemmConfig(16, 16, 32, 4))
    with pytest.raises(ValueError, match="TMA tiles take e4m3 activations"):
        fp8_weight_matmul(x, codes, scale, None, counters, GemmConfig(16, 16, 16, tma=True))
    assert fp8_weight_matmul(x[:0], codes, scale, None, counters).shape == (0, 32)
