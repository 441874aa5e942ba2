"""FP8 engine weights: FP8Linear's maths against float64 references, the engine's swap and refresh."""

import itertools

import pytest
import torch
from torch import nn

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.fp8_linear import FP8Linear
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams

PROJS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, from its bit definition (bias 7, no infinities)."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def round_e4m3(mag: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value to each magnitude in [0, 448], ties to the even mantissa (even grid index)."""
    grid = e4m3_grid()
    lo = (torch.searchsorted(grid, mag, right=True) - 1).clamp(max=len(grid) - 2)
    below, above = mag - grid[lo], grid[lo + 1] - mag
    pick_hi = (above < below) | ((above == below) & (lo % 2 == 1))
    return grid[lo + pick_hi.long()]


def ref_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Float64 reference of per-row e4m3 quantize-dequantize: scale = amax / 448, nearest grid value.

    The scale and the scaled value are float32 as specified (bf16 inputs often land exactly on a
    rounding tie, which a float64 division would break differently); the rounding is the grid's."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 448
    scaled = (x / torch.where(scale > 0, scale, torch.ones_like(scale))).double()
    return torch.sign(scaled) * round_e4m3(scaled.abs()) * scale.double()


def engine(path, fmt, merge: bool = False):
    """Unmerged by default: these tests look at each projection's own FP8Linear (merged:
    tests/test_merged_projections.py)."""
    cfg = EngineConfig(kv=KVConfig(format="fp32"), weight_format=fmt, max_model_len=64, merge_projections=merge)
    return Engine(path, cfg, device="cpu", dtype="float32")


def fp8_modules(eng) -> dict[str, FP8Linear]:
    return {n: m for n, m in eng.model.model.layers.named_modules() if isinstance(m, FP8Linear)}


# ---- FP8Linear ---------------------------------------------------------------------------------


def test_weight_codes_and_per_channel_scales_by_hand():
    weight = torch.tensor([[1.0, -0.5, 0.25, 3.5], [0.1, 0.2, -0.7, 0.0], [1.0, 0.3, 0.0, 0.0]])
    m = FP8Linear(4, 3, bias=False)
    m.load_weight_(weight)
    assert m.weight_scale.dtype == torch.float32
    assert m.weight_scale.tolist() == pytest.approx([3.5 / 448, 0.7 / 448, 1 / 448], rel=1e-7)
    # row amax -> 448; 0.3 * 448 = 134.4 rounds to 128 (e4m3 steps by 16 in [128, 256))
    assert m.qweight.float().tolist() == [[128, -64, 32, 448], [64, 128, -448, 0], [448, 128, 0, 0]]


def test_activation_is_quantized_per_token_by_hand():
    m = FP8Linear(4, 4, bias=True)
    m.load_weight_(448 * torch.eye(4))  # scale 1, code 448: the weight is exactly 448 * I
    m.bias.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.tensor([[3.5, -1.75, 0.4375, 0.0], [5.25, 1.75, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # row 0: scale 3.5/448 = 2^-7, codes 448, -224, 56 are exact. Row 1: scale 5.25/448 = 3 * 2^-8,
    # 1.75 / scale = 149.3 -> 144 -> 1.6875 (one tensor-wide scale would have moved row 0's 3.5 to
    # 3.375). Row 2: scale 0, output = bias.
    x_deq = torch.tensor([[3.5, -1.75, 0.4375, 0.0], [5.25, 1.6875, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(m(x), 448 * x_deq + m.bias)


def test_forward_equals_float64_reference():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    m = FP8Linear.from_linear(lin)
    x = torch.randn(2, 7, 64) * 3
    out = m(x)
    ref = ref_quantize_rows(x) @ ref_quantize_rows(lin.weight).T + lin.bias.double()
    assert out.shape == (2, 7, 48) and out.dtype == torch.float32
    # float32 scales and accumulation: the error is a few float32 ulps of the row's magnitudes
    bound = 1e-6 * (ref_quantize_rows(x).abs() @ ref_quantize_rows(lin.weight).abs().T + 1)
    assert torch.all((out.double() - ref).abs() <= bound)
    assert not torch.equal(out, lin(x))  # quantization did change the result


def test_scaled_mm_forced_off_hopper_raises():
    m = FP8Linear(32, 32, bias=False)
    assert m.path(torch.bfloat16, torch.device("cpu")) == "dequantized fallback"
    m.use_scaled_mm = True
    with pytest.raises(RuntimeError, match="scaled_mm forced"):
        m(torch.randn(2, 32, dtype=torch.bfloat16))


# ---- the engine --------------------------------------------------------------------------------


def test_engine_swaps_block_linears_only(tiny_qwen3):
    path, hf = tiny_qwen3
    plain, fp8 = engine(path, "auto"), engine(path, "fp8")
    layers = fp8.model.model.layers
    mods = fp8_modules(fp8)
    assert set(mods) == {f"{i}.{p}" for i in range(2) for p in PROJS}
    assert not any(type(m) is nn.Linear for m in layers.modules())
    # no full-precision copy of a block weight: every matrix in the blocks is e4m3 codes
    for name, t in itertools.chain(layers.named_parameters(), layers.named_buffers()):
        assert t.dim() == 1 or t.dtype == torch.float8_e4m3fn, name
    # embeddings, norms and the LM head are untouched full-precision parameters
    reference = dict(plain.model.named_parameters())
    kept = dict(fp8.model.named_parameters())
    for name, t in reference.items():
        if not name.startswith("model.layers.") or "norm" in name:
            assert t.dtype == torch.float32 and torch.equal(kept[name], t), name
    # each FP8 linear holds the float64-reference quantization of the checkpoint's weight
    state = hf.state_dict()
    for name, m in mods.items():
        ref = ref_quantize_rows(state[f"model.layers.{name}.weight"])
        assert torch.allclose(m.dequantized_weight(torch.float64), ref, rtol=1e-6, atol=0), name
    assert fp8.model.hf_targets().keys() == plain.model.hf_targets().keys()
    assert "fp8 weights: dequantized fallback" in fp8.summary
    assert "weights auto" in plain.summary


def test_refresh_requantizes_in_place(tiny_qwen3):
    path, hf = tiny_qwen3
    fp8 = engine(path, "fp8")
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3)
    before = fp8.generate([[5, 6, 7]], params)[0]
    pointers = {n: t.data_ptr() for n, t in fp8.model.state_dict(keep_vars=True).items()}
    torch.manual_seed(1)
    # bf16 weights in (the learner's dtype), perturbed so the engine's output must change
    new = {k: (v + 0.2 * v.std() * torch.randn_like(v)).bfloat16() for k, v in hf.state_dict().items()}
    fp8.load_weights(new, version=1)
    assert {n: t.data_ptr() for n, t in fp8.model.state_dict(keep_vars=True).items()} == pointers
    for name, m in fp8_modules(fp8).items():
        ref = ref_quantize_rows(new[f"model.layers.{name}.weight"])
        assert torch.allclose(m.dequantized_weight(torch.float64), ref, rtol=1e-6, atol=0), name
    after = fp8.generate([[5, 6, 7]], params)[0]
    assert after.logprobs[0] != before.logprobs[0]
    fp8.load_weights(hf.state_dict(), version=2)  # back to the checkpoint: the same codes again
    again = fp8.generate([[5, 6, 7]], params)[0]
    assert again.token_ids == before.token_ids and again.logprobs == before.logprobs


def test_refresh_validates_shapes_before_copying(tiny_qwen3):
    path, hf = tiny_qwen3
    fp8 = engine(path, "fp8")
    q = fp8_modules(fp8)["0.self_attn.q_proj"]
    codes = q.qweight.clone()
    bad = dict(hf.state_dict())
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(64, 32\), expected \(64, 64\)"):
        fp8.load_weights({k: v * 2 for k, v in bad.items()}, version=1)
    assert torch.equal(q.qweight.view(torch.uint8), codes.view(torch.uint8))


def test_engine_state_dict_round_trip_is_exact(tiny_qwen3):
    """Checkpoint resume restores a lagging engine from its own state dict (codes and scales)."""
    path, hf = tiny_qwen3
    src, dst = engine(path, "fp8"), engine(path, "fp8")
    torch.manual_seed(2)
    src.load_weights({k: v + 0.1 * torch.randn_like(v) for k, v in hf.state_dict().items()}, version=1)
    dst.model.load_state_dict({k: v.clone() for k, v in src.model.state_dict().items()})
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=4)
    assert src.generate([[3, 4]], params)[0].logprobs == dst.generate([[3, 4]], params)[0].logprobs


def test_fp8_log_probs_differ_slightly_from_full_precision(tiny_qwen3):
    path, _ = tiny_qwen3
    plain, fp8 = engine(path, "auto"), engine(path, "fp8")
    prompts, forced = [[5, 6, 7], [11, 12]], [[8, 9, 10, 11], [13, 14, 15]]
    for a, b, toks in zip(plain.score_tokens(prompts, forced), fp8.score_tokens(prompts, forced), forced):
        rows = torch.arange(len(toks))
        lp_a = a.log_softmax(-1)[rows, toks]
        lp_b = b.log_softmax(-1)[rows, toks]
        gap = (lp_a - lp_b).abs()
        assert torch.all(gap > 0) and torch.all(gap < 0.5)


@pytest.mark.parametrize("key, value", [("weight_format", "FP8"), ("weight_format", "int8"), ("fp8_gemm", "cutlass")])
def test_an_engine_config_built_in_code_refuses_an_unknown_weight_format(key, value):
    """The config loader checks these keys, but an EngineConfig built in code took "FP8" and ran full
    precision (0 FP8 linears) while its summary said FP8."""
    from kv4rl.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"engine.{key} must be one of .*, got '{value}'"):
        EngineConfig(**{key: value}).validate()
