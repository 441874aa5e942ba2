"""Fused elementwise kernels (kv4rl.kernels.fused_ops) against the eager layers of kv4rl.models.layers
computed in float64, then the fused decoder and engine against the eager ones.

Without CUDA the kernels run in Triton's CPU interpreter in float32 (its bf16 rounding is not faithful);
bf16 at Qwen3-1.7B's shapes on the GPU is tests/gpu/test_fused_ops_gpu.py.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.config import load_config  # noqa: E402
from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402
from kv4rl.kernels import fused_ops as fo  # noqa: E402
from kv4rl.kernels import rope as kr  # noqa: E402
from kv4rl.models import Decoder, ModelArgs  # noqa: E402
from kv4rl.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from tests.conftest import make_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
EPS = 1e-6
# float32 kernels against float64 references: a few float32 ulps
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def _eager_norm(weight: torch.Tensor) -> RMSNorm:
    """layers.RMSNorm in float64 holding `weight` (the reference arithmetic of every norm)."""
    norm = RMSNorm(weight.shape[0], EPS, dtype=torch.float64, device=DEVICE)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("shape", [(7, 96), (3, 2048), (5, 3, 64)])
def test_rms_norm_matches_eager(shape, gen):
    """Rows of a non-power-of-two hidden size, a large one, and per-head rows [N, H, D]."""
    x = _randn(*shape, gen=gen, scale=3.0)
    weight = _randn(shape[-1], gen=gen) * 0.3 + 1
    out = fo.rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _eager_norm(weight)(x.double()), **TOL)


@pytest.mark.parametrize("hidden", [96, 2048])
def test_add_rms_norm_returns_the_sum_and_its_norm(hidden, gen):
    x, residual = _randn(6, hidden, gen=gen), _randn(6, hidden, gen=gen, scale=4.0)
    weight = _randn(hidden, gen=gen) * 0.3 + 1
    normed, new_residual = fo.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, residual + x)  # one float32 addition on either side
    torch.testing.assert_close(normed.double(), _eager_norm(weight)((residual + x).double()), **TOL)
    assert fo.add_rms_norm(x[:0], residual[:0], weight, EPS)[0].shape == (0, hidden)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}


@pytest.mark.parametrize("head_dim,heads,scaling", [
    (32, (4, 2), None), (64, (3, 1), LLAMA3), (128, (16, 8), None)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_matches_eager(head_dim, heads, scaling, qk_norm, gen):
    """q and k are views into one fused qkv row (strided heads), at positions up to the table's end;
    the Llama 3 case shows the kernel just follows the (scaled) table."""
    (hq, hk), n = heads, 6
    rotary = RotaryEmbedding(head_dim, 40960, 1e6, scaling, device=DEVICE)
    qkv = _randn(n, (hq + 2 * hk) * head_dim, gen=gen, scale=2.0)
    q = qkv[:, : hq * head_dim].view(n, hq, head_dim)
    k = qkv[:, hq * head_dim: (hq + hk) * head_dim].view(n, hk, head_dim)
    positions = torch.tensor([0, 1, 7, 1000, 32767, 40959], device=DEVICE)
    if qk_norm:
        qw, kw = (_randn(head_dim, gen=gen) * 0.3 + 1 for _ in range(2))
        q_ref, k_ref = _eager_norm(qw)(q.double()), _eager_norm(kw)(k.double())
        q_out, k_out = kr.qk_norm_rope(q, k, qw, kw, EPS, rotary.cos, rotary.sin, positions)
    else:
        q_ref, k_ref = q.double(), k.double()
        q_out, k_out = kr.rope(q, k, rotary.cos, rotary.sin, positions)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous()
    torch.testing.assert_close(q_out.double(), rotary.apply_rotary(q_ref, positions), **TOL)
    torch.testing.assert_close(k_out.double(), rotary.apply_rotary(k_ref, positions), **TOL)


@pytest.mark.parametrize("head_dim,heads,rows", [(32, (4, 2), None), (128, (16, 8), 16), (128, (32, 8), 64)])
def test_qk_norm_rope_rotates_like_the_kv_cache(head_dim, heads, rows, gen):
    """`rotate=True`: each normed, RoPE'd head times the orthonormal Hadamard matrix (float64 reference),
    over blocks of (token, head) rows that end mid-token and a ragged last block (7 tokens)."""
    from kv4rl.quant.hadamard import rotate

    (hq, hk), n = heads, 7
    rotary = RotaryEmbedding(head_dim, 40960, 1e6, None, device=DEVICE)
    q, k = _randn(n, hq, head_dim, gen=gen, scale=2.0), _randn(n, hk, head_dim, gen=gen, scale=2.0)
    qw, kw = (_randn(head_dim, gen=gen) * 0.3 + 1 for _ in range(2))
    positions = torch.tensor([0, 1, 7, 1000, 32767, 40959, 5], device=DEVICE)
    q_out, k_out = kr.qk_norm_rope(q, k, qw, kw, EPS, rotary.cos, rotary.sin, positions, rotate=True,
                                   block_rows=rows)
    for out, x, w in ((q_out, q, qw), (k_out, k, kw)):
        with torch.no_grad():  # the cached Hadamard matrix may be an inference tensor from an earlier test
            ref = rotate(rotary.apply_rotary(_eager_norm(w)(x.double()), positions))
        torch.testing.assert_close(out.double(), ref, **TOL)
    plain, _ = kr.qk_norm_rope(q, k, qw, kw, EPS, rotary.cos, rotary.sin, positions)
    assert (q_out - plain).abs().max() > 0.1  # the rotation is not a no-op
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        kr.qk_norm_rope(q[..., :24], k[..., :24], None, None, EPS, rotary.cos[:, :12], rotary.sin[:, :12],
                        positions, rotate=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_silu_mul_matches_eager(gen):
    """1500 elements: a partial last block; gates out to where exp(-x) overflows float32."""
    gate, up = _randn(5, 300, gen=gen, scale=4.0), _randn(5, 300, gen=gen)
    gate[0, :4] = torch.tensor([-100.0, -88.0, 0.0, 100.0])
    out = fo.silu_mul(gate, up)
    torch.testing.assert_close(out.double(), F.silu(gate.double()) * up.double(), **TOL)


def test_silu_mul_reads_the_halves_of_a_merged_gate_up_in_place(gen):
    """Strided row views (the split of one gate|up product, 2-D and 3-D) give the contiguous inputs' result."""
    gate_up = _randn(2, 5, 600, gen=gen, scale=3.0)
    gate, up = gate_up.split(300, dim=-1)
    assert not gate.is_contiguous()
    for g, u in ((gate, up), (gate[0], up[0])):
        out = fo.silu_mul(g, u)
        assert out.is_contiguous() and torch.equal(out, fo.silu_mul(g.contiguous(), u.contiguous()))
        torch.testing.assert_close(out.double(), F.silu(g.double()) * u.double(), **TOL)


def test_wrappers_reject_mismatched_inputs():
    x = torch.zeros(2, 8, 32, device=DEVICE)
    table = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="both norm weights"):
        kr.qk_norm_rope(x, x, torch.ones(32, device=DEVICE), None, EPS, table, table, torch.zeros(2).long())
    with pytest.raises(ValueError, match="cos/sin"):
        kr.rope(x, x, table[:, :8], table[:, :8], torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        fo.rms_norm(x, torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="silu_mul"):
        fo.silu_mul(x, x[:1])


# ---- float16 roundings -----------------------------------------------------------------------------
# The interpreter rounds float32 to float16 exactly (numpy, to nearest even), unlike bf16, so there the
# kernels' rounding after every op can be checked against eager torch bit for bit.
half_only = pytest.mark.skipif(CUDA, reason="interpreter check; bf16 on the GPU is tests/gpu")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float16 ulps at the larger magnitude."""
    exponent = torch.frexp(torch.maximum(a.float().abs(), b.float().abs()).clamp(min=2.0**-14))[1]
    return (a.float() - b.float()).abs() / torch.ldexp(torch.ones_like(a, dtype=torch.float32), exponent - 11)


@half_only
@torch.inference_mode()
def test_float16_rope_and_residual_sum_are_bit_identical(gen):
    rotary = RotaryEmbedding(128, 40960, 1e6, None)
    q, k = ((2 * torch.randn(32, h, 128, generator=gen)).half() for h in (16, 8))
    positions = torch.randint(0, 40960, (32,), generator=gen)
    q_out, k_out = kr.rope(q, k, rotary.cos, rotary.sin, positions)
    assert torch.equal(q_out, rotary.apply_rotary(q, positions))
    assert torch.equal(k_out, rotary.apply_rotary(k, positions))
    x, residual = torch.randn(8, 2048, generator=gen).half(), (4 * torch.randn(8, 2048, generator=gen)).half()
    assert torch.equal(fo.add_rms_norm(x, residual, torch.ones(2048).half(), EPS)[1], residual + x)


@half_only
@torch.inference_mode()
def test_float16_silu_mul_rounds_like_eager(gen):
    """Bit-identical to eager's formula evaluated with the interpreter's exp (numpy's); torch's CPU silu
    uses another float32 exp, one bit apart on many inputs, which moves a few SiLU values by an ulp
    (two after the product with `up`)."""
    import numpy as np

    gate, up = (3 * torch.randn(16, 2048, generator=gen)).half(), torch.randn(16, 2048, generator=gen).half()
    out = fo.silu_mul(gate, up)
    g = gate.float()
    silu = (g / (1 + torch.from_numpy(np.exp(-g.numpy())))).half()
    assert torch.equal(out, silu * up)
    ulps = _ulps(out, F.silu(gate) * up)
    assert float(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 1e-3


@half_only
@torch.inference_mode()
def test_float16_norms_within_an_ulp_or_two(gen):
    """The sum of squares runs in another order (and numpy's rsqrt is 1/sqrt): a normalised value may
    round one ulp away, two after the weight product; rarely."""
    x = (3 * torch.randn(16, 2048, generator=gen)).half()
    norm = RMSNorm(2048, EPS, dtype=torch.float16)
    norm.weight.copy_(1 + 0.3 * torch.randn(2048, generator=gen))
    ulps = _ulps(fo.rms_norm(x, norm.weight, EPS), norm(x))
    assert float(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 1e-3
    rotary = RotaryEmbedding(128, 40960, 1e6, None)
    q, k = ((2 * torch.randn(16, h, 128, generator=gen)).half() for h in (16, 8))
    positions = torch.randint(0, 40960, (16,), generator=gen)
    q_norm = RMSNorm(128, EPS, dtype=torch.float16)
    q_norm.weight.copy_(1 + 0.3 * torch.randn(128, generator=gen))
    q_out, _ = kr.qk_norm_rope(q, k, q_norm.weight, q_norm.weight, EPS, rotary.cos, rotary.sin, positions)
    assert float((q_out != rotary.apply_rotary(q_norm(q), positions)).float().mean()) < 1e-3


@half_only
@torch.inference_mode()
def test_float16_rotation_rounds_once(gen):
    """The rotation inside `qk_norm_rope` sums the exact ±1 products in float32, then scales and rounds
    (as the KV write rotates bf16 keys): the float64 rotation of the RoPE'd heads rounded once to float16,
    up to the float32 sums and scaling (rarely an ulp)."""
    from kv4rl.quant.hadamard import rotate

    rotary = RotaryEmbedding(128, 40960, 1e6, None)
    q, k = ((2 * torch.randn(64, h, 128, generator=gen)).half() for h in (16, 8))
    positions = torch.randint(0, 40960, (64,), generator=gen)
    plain = kr.rope(q, k, rotary.cos, rotary.sin, positions)
    rotated = kr.qk_norm_rope(q, k, None, None, 0.0, rotary.cos, rotary.sin, positions, rotate=True)
    for before, after in zip(plain, rotated):
        ulps = _ulps(after, rotate(before.double()).half())
        assert float(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 1e-3


def test_kernels_compile_for_hopper_with_eager_arithmetic():
    """sm_90 offline (no GPU needed): the kernels (and FP8Linear's input quantizer) compile, and their
    PTX keeps eager's roundings (tools/fused_ops_sass.py). A fresh process: this one runs Triton's
    interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools" / "fused_ops_sass.py")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "rope", "silu_mul", "quantize_rows_fp8",
                 "add_rms_norm_fp8", "silu_mul_fp8"):
        assert f"{name}: " in run.stdout


# ---- the decoder ---------------------------------------------------------------------------------

def _decoder(model_type: str, seed: int = 0) -> Decoder:
    """A random float32 decoder with random norm weights and biases (qwen2: q/k/v biases)."""
    args = ModelArgs.from_hf_config({
        "model_type": model_type, "vocab_size": 101, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 2048, "rope_theta": 1e6, "tie_word_embeddings": model_type == "qwen3"})
    torch.manual_seed(seed)
    model = Decoder(args, dtype=torch.float32, device=DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + name.endswith("norm.weight"))
    return model


def _varlen_attention(seq_lens):
    """Causal attention within each of several flattened sequences (GQA by repeating k/v)."""
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).to(DEVICE)
    index = torch.arange(len(seq_of), device=DEVICE)
    allowed = (seq_of[:, None] == seq_of[None, :]) & (index[:, None] >= index[None, :])

    def attention(layer_idx, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=allowed)
        return out.transpose(0, 1)

    return attention


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
@torch.inference_mode()
def test_fused_decoder_matches_eager(model_type):
    """Two sequences in one flattened batch, the second deep into the position table."""
    model = _decoder(model_type)
    ids = torch.randint(0, 101, (11,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.cat([torch.arange(5), torch.arange(1500, 1506)]).to(DEVICE)
    attention = _varlen_attention([5, 6])
    eager = model(ids, positions, attention)
    model.enable_fused_ops()
    assert model.fused_ops
    fused = model(ids, positions, attention)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    model.enable_fused_ops(False)
    assert torch.equal(model(ids, positions, attention), eager)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
@torch.inference_mode()
def test_merged_projections_fused_and_eager_match_the_separate_ones(model_type):
    """The engine's merged q|k|v and gate|up (split views, no copies) through the fused kernels and the
    eager layers, against the unmerged eager decoder."""
    from kv4rl.engine.merged_linears import merge_projections

    model = _decoder(model_type)
    ids = torch.randint(0, 101, (11,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.cat([torch.arange(5), torch.arange(1500, 1506)]).to(DEVICE)
    attention = _varlen_attention([5, 6])
    reference = model(ids, positions, attention)
    assert merge_projections(model) == 2 * model.args.num_layers
    assert merge_projections(model) == 0  # a merged model stays as it is (an engine built on it again)
    torch.testing.assert_close(model(ids, positions, attention), reference, rtol=1e-5, atol=1e-5)
    model.enable_fused_ops()
    torch.testing.assert_close(model(ids, positions, attention), reference, rtol=1e-5, atol=1e-5)
    with _OpCounter() as counter:
        model(ids, positions, lambda layer_idx, q, k, v: q)
    assert counter.ops["linear"] == 4 * model.args.num_layers  # q|k|v, o, gate|up, down
    assert counter.ops["split_with_sizes"] == 2 * model.args.num_layers
    assert "clone" not in counter.ops, "a split view was copied (.contiguous())"


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_fused_decoder_leaves_only_projections_to_torch():
    """With fused ops a layer's torch work is its seven projections (plus views and allocations, and
    the interpreter's argument copies): none of eager's to/pow/mean/rsqrt/mul/add/sub/index/cat/silu
    kernels remain (eager: about sixty a layer besides the projections)."""
    model = _decoder("qwen3")
    model.enable_fused_ops()
    ids, positions = torch.arange(4, device=DEVICE), torch.arange(4, device=DEVICE)
    with _OpCounter() as counter:
        model(ids, positions, lambda layer_idx, q, k, v: q)  # attention is the engine's, not counted
    elementwise = {"to", "_to_copy", "pow", "mean", "rsqrt", "mul", "add", "sub", "index", "cat", "silu"}
    assert not elementwise & set(counter.ops), counter.ops
    assert counter.ops["linear"] == 7 * model.args.num_layers  # q, k, v, o, gate, up, down
    assert counter.ops["embedding"] == 1


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused")
    make_checkpoint(path, head_dim=32, num_attention_heads=4, num_key_value_heads=2, hidden_size=96)
    return path


def test_engine_fused_ops_scores_the_same_logprobs(ckpt):
    """Prefill and decode steps (several prompts, teacher-forced) with the fused model vs the eager one."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 9)]
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (4, 3)]
    scores = {}
    for fused in (False, True):
        cfg = EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, fused_ops=fused, cuda_graphs=False)
        engine = Engine(ckpt, cfg, max_num_seqs=2, device=DEVICE, dtype="float32")
        assert engine.model.fused_ops == fused and ("fused ops" in engine.summary) == fused
        scores[fused] = engine.score_tokens(prompts, forced)
    for eager, fused in zip(scores[False], scores[True]):
        torch.testing.assert_close(fused.log_softmax(-1), eager.log_softmax(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="the kernels can run on this machine")
def test_engine_fused_ops_fail_at_start_without_kernels(ckpt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, fused_ops=True)
    with pytest.raises(ValueError, match="engine.fused_ops"):
        Engine(ckpt, cfg, max_num_seqs=2, device="cpu", dtype="float32")


def test_config_knows_fused_ops():
    assert load_config().engine.fused_ops == "auto"
    assert load_config(overrides=["engine.fused_ops=true"]).engine.fused_ops is True
    assert load_config(overrides=["engine.fused_ops=false"]).engine.fused_ops is False
    assert load_config(overrides=["engine.fused_ops=true"]).engine.fused_ops is True


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_auto_settings_keep_cpu_engines_off_the_kernels(ckpt, monkeypatch, interpret):
    """`auto` means the compiled kernels on CUDA; a CPU engine (even with the interpreter on) keeps the
    torch sampler and eager ops."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    engine = Engine(ckpt, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), max_num_seqs=2, device="cpu",
                    dtype="float32")
    assert engine.sampler == "torch" and engine.fused_ops is False and not engine.model.fused_ops
    assert "sampler torch" in engine.summary and "fused ops" not in engine.summary
