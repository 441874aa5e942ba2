"""Prefill graphs (`engine.prefill_graph_tokens`) on CPU: the padded forward a graph replays, run
eagerly with the kernels in Triton's interpreter, against the engine's eager prefill of the same rows.
Padding tokens must write nothing, padding rows and tiles must attend to nothing, and KV4's side rows
must hold what the eager step stores. The graphs themselves are captured on the GPU
(tests/gpu/test_prefill_graphs_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402
from kv4rl.engine.prefill_graphs import MAX_ROWS, PrefillGraphs, prefill_buckets  # noqa: E402


def test_buckets_double_from_64_and_end_at_the_cap():
    assert prefill_buckets(512) == [64, 128, 256, 512]
    assert prefill_buckets(300) == [64, 128, 256, 300]
    assert prefill_buckets(64) == [64]
    assert prefill_buckets(8) == [8]


def _engine(path, fmt: str, graph_tokens: int, budget: int, slots: int) -> Engine:
    kv = KVConfig(format=fmt, group_size=32, block_size=4, rotate="none",
                  **({"n_sink": 2, "n_recent": 3} if fmt == "kv4" else {}))
    engine = Engine(path, EngineConfig(kv=kv, attention_backend="triton", prefill_backend="triton", num_kv_blocks=64,
                                       max_model_len=64, max_num_batched_tokens=budget), dtype="bfloat16",
                    max_num_seqs=slots)
    runner = engine.runner
    assert runner.prefill_graphs is None and engine.plan.prefill_graphs.value == 0  # no CUDA graphs here
    # as on CUDA, where the decode graph covers a mixed step's decode rows: they run first, the prefill
    # rows after them (here in the padded forward)
    runner.split_mixed_steps = True
    if graph_tokens:  # what the runner builds on CUDA, run without capture
        runner.prefill_graph_tokens = graph_tokens
        runner.prefill_graphs = PrefillGraphs(runner.model, runner.caches, runner.fast, graph_tokens,
                                              -(-runner.max_model_len // runner.block_size),
                                              runner.model.args.num_heads, replay=False)
    return engine


def _prompts(case: str):
    gen = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 11, 7))
    prompts, slots = ([a, a, b, c], 4) if case == "prefix forks" else ([a, b, c], 2)
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (6, 3, 5, 4)][: len(prompts)]
    return prompts, forced, slots, (4 if case == "chunks" else 16384)


@pytest.mark.parametrize(("fmt", "case"), [("bf16", "mixed steps"), ("int4", "prefix forks"), ("kv4", "mixed steps")])
def test_padded_prefill_equals_the_eager_prefill(gqa_hd32_ckpt, fmt, case):
    """"mixed steps": two slots, so later prompts prefill while others decode (the split step);
    "prefix forks": a repeated prompt forks the first's cache. Prompt chunks: the KV4 test below (CI
    time keeps the grid of formats x cases to these)."""
    prompts, forced, slots, budget = _prompts(case)
    eager = _engine(gqa_hd32_ckpt, fmt, 0, budget, slots)
    padded = _engine(gqa_hd32_ckpt, fmt, 32, budget, slots)
    ref = eager.score_tokens(prompts, forced)
    got = padded.score_tokens(prompts, forced)
    assert padded.runner.prefill_graphs.num_runs > 0
    for r, g in zip(ref, got):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)
    blocks = padded.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_kv4_chunks_padded_leave_the_cache_the_eager_prefill_leaves(gqa_hd32_ckpt):
    """KV4 prompts in chunks of at most 4 tokens (later chunks read the side rows the earlier ones
    stored): the same scores, and pages, scales and side rows byte for byte, so the padding tokens
    wrote nothing and the padded side-row stores repeat a real one."""
    prompts, forced, slots, budget = _prompts("chunks")
    prompts, forced = prompts[:2], forced[:2]  # 5 and 11 tokens: chunks past the 2 sinks and 3 recent rows
    engines = [_engine(gqa_hd32_ckpt, "kv4", tokens, budget, slots) for tokens in (0, 32)]
    ref, got = (e.score_tokens(prompts, forced) for e in engines)
    assert engines[1].runner.prefill_graphs.num_runs > 0
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)
    for ref_cache, got_cache in zip(*(e.runner.caches for e in engines)):
        assert ref_cache.keys() == got_cache.keys()
        for name in ref_cache:
            if torch.is_tensor(ref_cache[name]):
                assert torch.equal(ref_cache[name], got_cache[name]), name


def test_rows_beyond_the_buckets_fall_back_to_the_eager_prefill(gqa_hd32_ckpt):
    """A 9-token prompt exceeds an 8-token cap and more than MAX_ROWS rows exceed the row cap: both run
    eagerly; the short prompt's prefill runs padded. The scores still equal the eager engine's."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (9, 3)]
    prompts += [torch.randint(0, 90, (2,), generator=gen).tolist() for _ in range(MAX_ROWS + 1)]
    forced = [[1, 2]] * len(prompts)
    ref = _engine(gqa_hd32_ckpt, "bf16", 0, 16384, 1).score_tokens(prompts[:2], forced[:2])
    engine = _engine(gqa_hd32_ckpt, "bf16", 8, 16384, 1)  # one slot: each prompt prefills alone
    got = engine.score_tokens(prompts[:2], forced[:2])
    assert engine.runner.prefill_graphs.num_runs == 1  # the 3-token prompt; the 9-token one ran eagerly
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)
    many = _engine(gqa_hd32_ckpt, "bf16", 64, 16384, MAX_ROWS + 1)
    many.score_tokens(prompts[2:], forced[2:])  # one step prefills MAX_ROWS + 1 prompts
    assert many.runner.prefill_graphs.num_runs == 0


def test_prefill_graph_tokens_is_validated_and_named_in_the_plan(gqa_hd32_ckpt):
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=-1).validate()
    engine = Engine(gqa_hd32_ckpt, EngineConfig(kv=KVConfig(format="bf16", block_size=4), attention_backend="triton",
                                       prefill_backend="triton", num_kv_blocks=16, max_model_len=32,
                                       prefill_graph_tokens=256), dtype="bfloat16", max_num_seqs=2)
    choice = engine.plan.prefill_graphs
    assert choice.value == 0 and "decode graphs" in choice.reason  # CPU: no decode graphs, so none
    assert "prefill_graphs=0" in engine.plan.explain()
