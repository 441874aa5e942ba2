"""KV pool sized from CUDA memory: the profiled peak covers a real largest step, the fraction is kept."""

import gc
import time

import pytest
import torch

from kv4rl.bench.random_model import random_decoder
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.memory import kv_footprint
from kv4rl.engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")


def test_random_8b_decoder_builds_in_seconds():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = random_decoder("qwen3-8b", DEV, seed=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    assert 8.1e9 < params < 8.3e9  # Qwen3-8B: 8.2B parameters, untied head
    assert seconds < 30, seconds
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", ["bf16", "kv4"])
def test_pool_fills_the_fraction_and_the_largest_step_fits(fmt):
    fraction = 0.4
    model = random_decoder("qwen3-1.7b", DEV)  # 256 x 8192 tokens: 240 GB in bf16, 66 GB in kv4: not capped
    cfg = EngineConfig(kv=KVConfig(format=fmt), max_model_len=8192, max_num_batched_tokens=8192,
                       gpu_memory_fraction=fraction)
    engine = Engine.from_model(model, cfg, max_num_seqs=256)
    assert "gpu_memory_fraction=0.4" in engine.pool_sizing and "capped" not in engine.pool_sizing
    fp = kv_footprint(engine.kv_format, 28, 8, 128, 16)
    assert engine.pool_bytes == fp.total_bytes(engine.pool_tokens // 16, 256)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(DEV)
    assert engine.pool_bytes < total - free <= fraction * total
    # the pool takes all of the fraction but the weights (4 GB), the CUDA context and the largest step's
    # activations, none of which grows with the card: 10.0-10.3 GB on an H100, where 0.3 of the card was
    # too much to ask (the pool was 0.28 of it)
    assert fraction * total - engine.pool_bytes < 12 * 2**30
    outside_torch = total - free - torch.cuda.memory_reserved(DEV)  # CUDA context, libraries
    # real largest steps (a longest prompt alone; the token budget in two prompts) stay within the fraction
    for prompts in ([[1] * 8191], [[2] * 4096, [3] * 4096]):
        torch.cuda.reset_peak_memory_stats(DEV)
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        assert torch.cuda.max_memory_allocated(DEV) + outside_torch <= fraction * total


def test_a_fraction_too_small_is_refused_naming_the_key():
    model = random_decoder("qwen3-1.7b", DEV, num_layers=2)
    gc.collect()  # earlier tests' engines
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(DEV)
    fraction = (total - free) / total + 1e-4  # room for what is in use, none for a sequence
    with pytest.raises(ValueError, match="engine.gpu_memory_fraction"):
        Engine.from_model(model, EngineConfig(max_model_len=40960, gpu_memory_fraction=fraction))
