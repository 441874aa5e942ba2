"""Mismatch attribution on CUDA (bf16): with the fast path (Triton decode kernels, CUDA graphs, fused ops),
KV4 and FP8 weights, the terms still add up exactly to learner - recorded; each format moves its own
term and leaves the unused ones at exactly 0. Prints each case's mean |term| for the record."""

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.scoring import Sampling
from kv4rl.engine.sequence import SamplingParams
from kv4rl.telemetry.attribution import MismatchAttribution
from kv4rl.telemetry.mismatch_curves import SOURCES
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TEMPERATURE = 1.0
KV4 = KVConfig(format="kv4", group_size=64, n_sink=4, n_recent=16)
CASES = {
    "bf16 torch reference": (EngineConfig(attention_backend="torch", fused_ops=False, cuda_graphs=False), set()),
    "bf16 fast path": (EngineConfig(), set()),
    "kv4 fast path": (EngineConfig(kv=KV4), {"kv_cache"}),
    "fp8 torch reference": (EngineConfig(weight_format="fp8", attention_backend="torch", fused_ops=False,
                                         cuda_graphs=False), {"weights"}),
    "fp8 fast path": (EngineConfig(weight_format="fp8"), {"weights"}),
    "kv4 + fp8 fast path": (EngineConfig(kv=KV4, weight_format="fp8"), {"kv_cache", "weights"}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("attribution-gpu")
    make_checkpoint(path, vocab=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    return str(path)


@pytest.fixture(scope="module")
def learner(checkpoint):
    return Learner(checkpoint, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=8, updates_per_batch=1, temperature=TEMPERATURE, device=torch.device("cuda"))


@pytest.mark.parametrize("case", list(CASES))
def test_terms_add_up_and_each_format_moves_its_own(case, checkpoint, learner):
    config, on = CASES[case]
    engine = Engine(checkpoint, config, max_num_seqs=8, device="cuda")
    fast = "fast" in case
    assert (engine.plan.attention.value == "triton") == fast, engine.plan.explain()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 511, (int(n),), generator=gen).tolist() for n in (5, 40, 12, 90, 7, 33, 64, 20)]
    done = engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_tokens=96, ignore_eos=True, seed=1))
    batch = build_batch(prompts, [c.token_ids for c in done], [c.logprobs for c in done],
                        [c.versions for c in done], [0.0] * len(done), pad_id=0)
    att = MismatchAttribution(engine, learner, every=1, samples=8, sampling=Sampling(TEMPERATURE), horizon=0)
    terms, skipped = att.token_terms(0, batch)
    assert skipped == 0 and len(terms["total"]) == 8 * 96
    assert all(bool(torch.isfinite(t).all()) for t in terms.values())
    torch.testing.assert_close(sum(terms[s] for s in SOURCES), terms["total"], rtol=0, atol=1e-12)
    sizes = {s: float(terms[s].abs().mean()) for s in (*SOURCES, "total")}
    print(f"\n{case}: " + ", ".join(f"{s} {v:.2e}" for s, v in sizes.items()))
    for s in ("staleness", "kv_cache", "weights", "truncation"):
        assert (sizes[s] > 0) == (s in on), (s, sizes[s])
