"""FP8Linear on CUDA: the scaled_mm path (Hopper) against the dequantized fallback, and a whole engine."""

import pytest
import torch
from torch import nn

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.fp8_linear import (
    DECODE_GEMM_PATH,
    FALLBACK_PATH,
    MAX_DECODE_ROWS,
    SCALED_MM_PATH,
    FP8Linear,
    fp8_matmul_device,
)
from kv4rl.engine.llm import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fp8_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_matmul_device(torch.device("cuda")),
    reason="needs FP8 tensor cores (compute capability >= 8.9)",
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def fp8_layer(k: int, n: int, bias: bool, seed: int) -> tuple[nn.Linear, FP8Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    return linear, FP8Linear.from_linear(linear)


@needs_fp8_mm
@pytest.mark.parametrize("k,n", [(2048, 6144), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 17, 64, 256])
def test_scaled_mm_matches_fallback(m, k, n):
    linear, fp8 = fp8_layer(k, n, bias=(m == 17), seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2
    x[0] *= 100  # tokens with very different magnitudes: the per-token scale must follow each
    assert fp8.path(x.dtype, x.device) == SCALED_MM_PATH
    fp8.use_scaled_mm = True
    fast = fp8(x)
    fp8.use_scaled_mm = False
    ref = fp8(x.float())  # the same maths in float32
    slow = fp8(x)  # the fallback in bf16
    assert fast.shape == (m, n) and fast.dtype == torch.bfloat16
    assert not fast.isnan().any()
    assert rel_err(fast, ref) < 2e-2
    assert rel_err(fast, slow) < 2e-2
    # and both are FP8 approximations of the full-precision layer, not a shared mistake
    full = nn.functional.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    assert rel_err(fast, full) < 0.1


@needs_fp8_mm
@pytest.mark.parametrize("k,n", [(2048, 6144), (4096, 4096), (12288, 4096)])
@pytest.mark.parametrize("m", [1, 17, 64, 128, 200, 256, 300])
def test_decode_gemm_matches_scaled_mm(m, k, n):
    """The Triton e4m3 GEMM computes scaled_mm's function (same codes and scales): they differ by
    accumulation order and the bias's rounding only; above MAX_DECODE_ROWS tokens the layer keeps scaled_mm."""
    _, fp8 = fp8_layer(k, n, bias=(m % 2 == 1), seed=m + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2
    x[0] *= 100
    fp8.fused_quant, fp8.use_scaled_mm = True, True
    cublas = fp8(x)
    fp8.enable_decode_gemm()
    triton = fp8(x)
    assert triton.shape == (m, n) and triton.dtype == torch.bfloat16 and not triton.isnan().any()
    if m > MAX_DECODE_ROWS:
        assert torch.equal(triton, cublas)
    else:
        assert rel_err(triton, cublas) < 4e-3
        fp8.use_scaled_mm = False
        assert rel_err(triton, fp8(x.float())) < 2e-2  # the dequantized maths in float32 (fallback)
    assert int(fp8.gemm_counters.abs().sum()) == 0


@needs_fp8_mm
def test_scaled_mm_handles_leading_dims_and_zero_tokens():
    _, fp8 = fp8_layer(256, 512, bias=False, seed=0)
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    x[1, 2] = 0
    fp8.use_scaled_mm = True
    out = fp8(x)
    fp8.use_scaled_mm = False
    ref = fp8(x.float())
    assert out.shape == (3, 5, 512) and not out.isnan().any()
    assert torch.all(out[1, 2] == 0)
    assert rel_err(out, ref) < 2e-2


def test_shapes_off_the_16_grid_fall_back():
    _, fp8 = fp8_layer(72, 40, bias=True, seed=0)
    x = torch.randn(4, 72, device="cuda", dtype=torch.bfloat16)
    assert fp8.path(x.dtype, x.device) == FALLBACK_PATH
    assert not fp8(x).isnan().any()
    fp8.use_scaled_mm = True
    with pytest.raises(RuntimeError, match="scaled_mm forced"):
        fp8(x)


PROMPTS, FORCED = [[5, 6, 7], [11, 12, 13, 14, 15]], [[8, 9, 10, 11, 12], [16, 17, 18]]


def forced_log_probs(engine: Engine) -> torch.Tensor:
    rows = engine.score_tokens(PROMPTS, FORCED)
    return torch.cat([r.log_softmax(-1)[torch.arange(len(t)), t] for r, t in zip(rows, FORCED)])


def fp8_engine(path, **overrides) -> Engine:
    cfg = EngineConfig(kv=KVConfig(format="bf16"), weight_format="fp8", max_model_len=64, **overrides)
    return Engine(path, cfg, device="cuda", dtype="bfloat16")


def assert_fp8_noise(a: torch.Tensor, b: torch.Tensor) -> None:
    """Each layer's outputs agree to bf16 rounding, but a rounding difference can flip an e4m3 code
    of the next layer's activation (a 2^-4 step), so two FP8 paths differ by FP8's own noise, not
    bf16's: on an H200, max 0.078 / mean 0.028, while plain bf16 vs fp32 differ by 0.011 and FP8
    vs no FP8 by 0.12."""
    assert not a.isnan().any() and not b.isnan().any()
    gap = (a - b).abs()
    assert gap.max() < 0.3 and gap.mean() < 0.1


@needs_fp8_mm
@pytest.mark.parametrize("fp8_gemm", ["scaled_mm", "auto"])
def test_engine_scaled_mm_log_probs_match_fallback(tiny_qwen3, fp8_gemm):
    path, _ = tiny_qwen3
    # the torch attention path runs eagerly, so switching the linears' path takes effect at once
    engine = fp8_engine(path, attention_backend="torch", fp8_gemm=fp8_gemm)
    assert f"fp8 weights: {SCALED_MM_PATH if fp8_gemm == 'scaled_mm' else DECODE_GEMM_PATH}" in engine.summary
    fast = forced_log_probs(engine)
    linears = [m for m in engine.model.modules() if isinstance(m, FP8Linear)]
    assert len(linears) == 8  # two layers of merged q|k|v, o, merged gate|up, down (engine.merge_projections)
    for m in linears:
        m.use_scaled_mm = False
    assert_fp8_noise(fast, forced_log_probs(engine))


@needs_fp8_mm
@pytest.mark.parametrize("fp8_gemm", ["scaled_mm", "auto"])
def test_engine_default_backend_runs_scaled_mm(tmp_path, fp8_gemm):
    """The default backend (fast attention and CUDA graphs where they apply; head_dim 32 so they
    can) replays the FP8 linears too, consistent with the eager engine, also after a refresh."""
    from tests.conftest import make_checkpoint

    path = tmp_path / "qwen3_hd32"
    hf = make_checkpoint(path, head_dim=32)
    eager, default = fp8_engine(path, attention_backend="torch", fp8_gemm="scaled_mm"), fp8_engine(path, fp8_gemm=fp8_gemm)
    assert f"fp8 weights: {SCALED_MM_PATH if fp8_gemm == 'scaled_mm' else DECODE_GEMM_PATH}" in default.summary
    before = forced_log_probs(default)
    assert_fp8_noise(forced_log_probs(eager), before)
    torch.manual_seed(0)
    new = {k: (v + 0.2 * v.std() * torch.randn_like(v)).bfloat16() for k, v in hf.state_dict().items()}
    for engine in (eager, default):
        engine.load_weights(new, version=1)
    refreshed = forced_log_probs(default)
    assert_fp8_noise(forced_log_probs(eager), refreshed)  # graphs read the re-quantized weights
    assert (refreshed - before).abs().mean() > 0.2  # the refresh moved them (H200: by 0.34)


@needs_fp8_mm
@pytest.mark.parametrize("decode_gemm", [False, True])
@pytest.mark.parametrize("tokens", [5, 200])
def test_fused_layers_hand_fp8_codes_without_changing_the_output(decode_gemm, tokens):
    """With fused ops, the norms and SwiGLU quantize the FP8 linears' inputs in their own launch
    (`kv4rl.models.fused.enable_fp8_inputs`): the same codes and scales, so the same hidden states bit
    for bit, on either FP8 product."""
    import torch.nn.functional as F

    from kv4rl.bench.random_model import random_decoder
    from kv4rl.engine.fp8_weights import apply_fp8_weights, set_fused_quant
    from kv4rl.engine.merged_linears import merge_projections
    from kv4rl.models.fused import FP8Inputs

    model = random_decoder("qwen3-0.6b", "cuda", num_layers=2)
    model.enable_fused_ops()
    merge_projections(model)
    apply_fp8_weights(model)
    ids = torch.randint(0, model.args.vocab_size, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
    positions = torch.arange(tokens, device="cuda")

    def attention(layer_idx, q, k, v):  # one causal sequence, GQA by repeating k/v
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    with torch.no_grad():
        set_fused_quant(model, True, decode_gemm, fp8_inputs=False)
        assert all(layer.fp8_inputs is None for layer in model.model.layers)
        ref = model(ids, positions, attention)
        set_fused_quant(model, True, decode_gemm)
        assert all(layer.fp8_inputs == FP8Inputs(True, True, True) for layer in model.model.layers)
        got = model(ids, positions, attention)
    assert not ref.isnan().any() and torch.equal(got, ref)
