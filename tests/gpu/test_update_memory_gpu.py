"""The learner's update memory on CUDA (`Learner.update_memory_bytes`): it leaves the weights and the
optimizer untouched, covers the device memory a real update then allocates, and an engine given it as
`reserve_bytes` holds that much less pool. The arithmetic and the wiring on the CPU:
tests/test_update_memory.py."""

import gc

import pytest
import torch

from kv4rl.bench.random_model import random_decoder
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine
from kv4rl.trainer.update_memory import BENCHMARK_ALLOWANCE
from tests.gpu.test_learner_gpu import make, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
MIB = 2**20


@pytest.mark.parametrize("kw", [{"max_tokens_per_micro_batch": 256}, {}, {"offload_optimizer": True}, {"offload": True},
                                {"compile_layers": None, "fused_logprobs": None}], ids=str)
def test_the_reserve_covers_a_real_update_and_changes_nothing(tiny_qwen3, kw):
    path, _ = tiny_qwen3
    learner = make(path, CUDA, **kw)
    batch = ragged_batch().to(CUDA)
    max_len = int(batch.attention_mask.sum(1).max())
    weights = [p.detach().clone() for p in learner.model.parameters()]
    # the first measurement compiles the dummy batch's shapes and benchmarks their kernels (~60 MB on
    # 2026-12-02, against a 5 MB update of this model), which the allowance covers once: the second does not
    first = learner.update_memory_bytes(max_len)
    reserve = learner.update_memory_bytes(max_len)
    assert reserve <= first + MIB
    assert all(p.grad is None for p in learner.model.parameters()) and not learner.optimizer.state
    assert all(torch.equal(p, w) for p, w in zip(learner.model.parameters(), weights, strict=True))
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    learner.step(batch)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated(CUDA) - before
    assert 0 < used <= reserve + MIB, (used, reserve)  # 1 MiB: the loss's and metrics' small tensors
    assert reserve < 4 * used + BENCHMARK_ALLOWANCE + 4 * MIB, (used, reserve)  # and not a wild over-estimate


def test_an_engine_holds_its_reserve_less_pool():
    cfg = EngineConfig(max_model_len=8192, max_num_batched_tokens=8192, gpu_memory_fraction=0.4)
    pools = {}
    for reserve in (0, 8 * 2**30):  # 256 x 8192 tokens do not fit 0.4 of the device: not capped
        engine = Engine.from_model(random_decoder("qwen3-1.7b", CUDA), cfg, max_num_seqs=256, reserve_bytes=reserve)
        assert "capped" not in engine.pool_sizing
        assert ("8.00 GiB reserved for the learner's update" in engine.pool_sizing) == bool(reserve)
        pools[reserve] = engine.pool_bytes
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert abs(pools[0] - pools[8 * 2**30] - 8 * 2**30) < 64 * MIB, pools
