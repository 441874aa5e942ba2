"""The engine's fast prefill on CUDA (prompts through the prefill kernel, whole and in chunks) against the
torch reference path, at a real head shape (head_dim 128, GQA 4), for every format with kernels."""

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from tests.gpu.test_engine_fast_path_gpu import REF_REL_BOUND

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def ckpt(gqa_hd128_ckpt):
    return gqa_hd128_ckpt


def _engine(ckpt, fmt, backend, prefill="auto", budget=16384, **kv):
    cfg = EngineConfig(kv=KVConfig(format=fmt, block_size=16, **kv), attention_backend=backend,
                       prefill_backend=prefill, max_num_batched_tokens=budget, num_kv_blocks=1024,
                       max_model_len=2048)
    return Engine(ckpt, cfg, device="cuda", dtype="bfloat16", max_num_seqs=32)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "kv4"])
def test_fast_prefill_scores_like_reference(ckpt, fmt):
    """Prompts of 5-1000 tokens, whole and in chunks of a 256-token budget, then forced tokens decoded."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    lens = torch.randint(5, 1000, (12,), generator=gen).tolist()
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in lens]
    forced = [torch.randint(0, 500, (k,), generator=gen).tolist() for k in torch.randint(1, 100, (12,), generator=gen)]
    kv = {"n_sink": 4, "n_recent": 32} if fmt == "kv4" else {}
    ref = _engine(ckpt, fmt, "torch", **kv).score_tokens(prompts, forced)
    for budget in (16384, 256):
        engine = _engine(ckpt, fmt, "triton", budget=budget, **kv)
        assert "fast prefill" in engine.attention_desc
        fast = engine.score_tokens(prompts, forced)
        for r, f in zip(ref, fast):
            assert torch.isfinite(f).all()
            assert _rel(f, r) < REF_REL_BOUND[fmt], (budget, _rel(f, r))  # the decode engine test's bounds


def test_fast_prefill_greedy_tokens_match_reference_prefill_bf16(ckpt):
    """bf16 greedy: the fast prefill and the reference prefill (same decode kernels) pick the same tokens,
    except where bf16 rounding flips a near tie; then the runs part, so count the common prefix."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (7, 100, 333, 900, 64, 500)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = {p: _engine(ckpt, "bf16", "triton", prefill=p).generate(prompts, params) for p in ("torch", "triton")}
    same = total = 0
    for a, b in zip(out["torch"], out["triton"]):
        n = 0
        while n < len(a.token_ids) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        same, total = same + n, total + len(a.token_ids)
    assert same > 0.8 * total
