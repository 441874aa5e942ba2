"""FP8 engine weights: per-output-channel e4m3 rounding of block linears, re-applied on refresh."""

import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, from its bit definition (bias 7, no infinities)."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def engine(path, fmt):
    cfg = EngineConfig(kv=KVConfig(format="fp32"), weight_format=fmt, max_model_len=64)
    return Engine(path, cfg, device="cpu", dtype="float32")


def test_block_linears_lie_on_the_per_channel_e4m3_grid(tiny_qwen3):
    path, hf = tiny_qwen3
    plain, fp8 = engine(path, "auto"), engine(path, "fp8")
    grid = e4m3_grid()
    p_ref, p_q = dict(plain.model.named_parameters()), dict(fp8.model.named_parameters())
    changed = 0
    for name, w in p_q.items():
        ref = p_ref[name]
        if (".self_attn." in name and name.endswith("proj.weight")) or ".mlp." in name:
            scale = ref.double().abs().amax(dim=1, keepdim=True) / 448
            scaled = (w.double() / scale).abs()
            # every scaled magnitude is an e4m3 value, the nearest one to the original
            nearest = grid[(scaled.reshape(-1, 1) - grid).abs().argmin(1)].reshape(scaled.shape)
            assert torch.allclose(scaled, nearest, rtol=1e-6, atol=1e-9), name
            ideal = (ref.double() / scale).abs()
            # round-to-nearest with 3 mantissa bits: relative error <= 2^-4 (subnormals: <= 2^-10 absolute)
            assert torch.all((scaled - ideal).abs() <= ideal * 2**-4 + 2**-10 + 1e-6), name
            assert torch.allclose(scaled.amax(dim=1), torch.full_like(scaled[:, 0], 448.0))
            changed += int(not torch.equal(w, ref))
        else:  # embeddings, norms, LM head stay as they are
            assert torch.equal(w, ref), name
    assert changed == 2 * 7  # two layers x (q, k, v, o, gate, up, down)


def test_refresh_requantizes_and_sampling_differs_only_slightly(tiny_qwen3):
    path, hf = tiny_qwen3
    fp8 = engine(path, "fp8")
    before = {k: v.clone() for k, v in fp8.model.state_dict().items()}
    fp8.load_weights(hf.state_dict(), version=1)  # full-precision weights in, FP8 weights after
    for k, v in fp8.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    plain = engine(path, "auto")
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3)
    a = plain.generate([[5, 6, 7]], params)[0]
    b = fp8.generate([[5, 6, 7]], params)[0]
    gap = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs()
    assert 0 < gap[0] < 0.5  # same prompt, same first token context: FP8 moves the log-prob a little
