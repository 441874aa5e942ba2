"""The engine's fast path (Triton decode rows + prefill rows through the prefill kernel or the reference
path, in one step) on CPU, with the kernels in Triton's interpreter, against the all-reference engine.
Covers what the GPU tests cannot run in CI: splitting a mixed step, putting rows back in order,
prefix-sharing forks through the kernels, prompt chunks, and KV4's protected rows written by the fused
writer."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402


@pytest.fixture
def ckpt(gqa_hd32_ckpt):
    return gqa_hd32_ckpt


def _scores(ckpt, backend: str, prompts, forced, max_num_seqs: int, reverse_batches: bool = False,
            prefill: str = "torch", rotate: str = "auto", budget: int = 16384, split: bool = False,
            fused_ops: bool | str = "auto"):
    """`split`: False runs a mixed step's decode and prefill rows in one forward, as on the CPU; on CUDA
    (with decode graphs) the engine would split it, and the mixed path these tests count would not run."""
    kv = KVConfig(format="kv4", group_size=32, n_sink=2, n_recent=3, block_size=4, rotate=rotate)
    engine = Engine(ckpt, EngineConfig(kv=kv, attention_backend=backend, prefill_backend=prefill, num_kv_blocks=64,
                                       max_model_len=64, max_num_batched_tokens=budget, fused_ops=fused_ops),
                    dtype="bfloat16", max_num_seqs=max_num_seqs)
    engine.runner.split_mixed_steps = split
    engine.mixed_steps = 0
    eager = engine.runner._forward_eager

    def counting(host, rest, *pending):
        engine.mixed_steps += host is not None and bool(rest)
        return eager(host, rest, *pending)

    engine.runner._forward_eager = counting
    if reverse_batches:  # prefill rows before decode rows: the runner must put its logits back in order
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: list(reversed(schedule()))
    out = engine.score_tokens(prompts, forced)
    return engine, out


@pytest.mark.parametrize("case", ["mixed steps", "prefix forks"])
def test_fast_path_matches_the_reference_path(ckpt, case):
    """"mixed steps": two running slots, so the third request is prefilled while another decodes;
    "prefix forks": the second request repeats the first's prompt and computes only its last token,
    through the decode kernels."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 9, 6))
    prompts, slots = ([a, b, c], 2) if case == "mixed steps" else ([a, a, b], 4)
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (6, 3, 5)]
    ref_engine, ref = _scores(ckpt, "torch", prompts, forced, slots)
    fast_engine, fast = _scores(ckpt, "triton", prompts, forced, slots, reverse_batches=case == "mixed steps")
    assert "Triton" in fast_engine.attention_desc and "torch" in ref_engine.attention_desc
    if case == "mixed steps":
        assert fast_engine.mixed_steps > 0
    else:
        assert fast_engine.num_prefill_tokens_saved > 0
    for r, f in zip(ref, fast):
        assert torch.isfinite(f).all()
        assert float((f - r).norm() / r.norm()) < 3e-2  # bf16 model; see tests/gpu for real shapes
    assert fast_engine.scheduler.blocks.num_free_blocks == fast_engine.scheduler.blocks.num_blocks


def test_fused_forward_hands_the_kernels_rotated_queries_and_keys(ckpt, monkeypatch):
    """With the fused ops the RoPE kernel rotates q and k into KV4's key space (`rotates_qk`): the decode
    and prefill kernels then rotate neither. Against the same fused engine with the rotations left to the
    kernels (the write rotates the keys, `rotate_rows` the prefill's queries), and the all-reference one."""
    from kv4rl.engine.fast_path import FastAttention

    seen = []
    for name in ("decode", "prefill"):
        original = getattr(FastAttention, name)

        def recording(self, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, bool(args[5] if len(args) > 5 else kwargs.get("rotated", False))))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FastAttention, name, recording)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 9, 6)]
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (6, 3, 5)]
    _, ref = _scores(ckpt, "torch", prompts, forced, 2)
    results = {}
    for in_rope in (True, False):
        seen.clear()
        if not in_rope:
            monkeypatch.setattr(FastAttention, "qk_rotation_in_rope", False)
        engine, results[in_rope] = _scores(ckpt, "triton", prompts, forced, 2, prefill="triton", fused_ops=True)
        assert engine.model.fused_ops and engine.runner.fast.fmt.rotate == "k"
        assert ("rotate k, in the RoPE kernel" in engine.summary) == in_rope, engine.summary
        assert {("decode", in_rope), ("prefill", in_rope)} == set(seen), seen
    # the interpreter truncates the fused norms' and RoPE's bf16 roundings (a rotation's too): both fused
    # engines sit 3-8% from the reference, and within 1% of each other
    for r, in_rope, in_kernels in zip(ref, results[True], results[False]):
        assert torch.isfinite(in_rope).all()
        error_rope, error_kernels = (float((x - r).norm() / r.norm()) for x in (in_rope, in_kernels))
        assert error_rope < 1e-1 and error_rope < error_kernels + 5e-3
        assert float((in_rope - in_kernels).norm() / in_kernels.norm()) < 2e-2


def test_mixed_steps_split_into_a_decode_forward_and_a_prefill_forward_match_the_reference(ckpt):
    """On CUDA a step with prefill rows replays the decode graph for its decode rows and runs the
    prefill rows in a second, eager forward; forced here without graphs, with the batch reversed so
    the logits must be put back in the scheduler's order."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 9, 6)]
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (6, 3, 5)]
    _, ref = _scores(ckpt, "torch", prompts, forced, 2, rotate="none")
    fast_engine, fast = _scores(ckpt, "triton", prompts, forced, 2, prefill="triton", rotate="none", split=True,
                                reverse_batches=True)
    assert fast_engine.runner.num_split_steps > 0 and fast_engine.mixed_steps == 0
    for r, f in zip(ref, fast):
        assert torch.isfinite(f).all()
        assert float((f - r).norm() / r.norm()) < 5e-2
    assert fast_engine.scheduler.blocks.num_free_blocks == fast_engine.scheduler.blocks.num_blocks


@pytest.mark.parametrize("case", ["mixed steps", "prefix forks", "chunks"])
def test_fast_prefill_matches_the_reference_path(ckpt, case):
    """Prompts through the prefill kernel (whole, or in chunks of at most 4 new tokens a step) against the
    all-reference engine. Without rotation the fused writer stores the reference's codes bit for bit (the
    interpreter truncates a rotation's bf16 rounding); what remains is the reference attending in bf16 over
    bf16-dequantized keys while the interpreted kernel runs float32 dots, which two layers of INT4 codes
    amplify to at most ~3% of the logits here."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 9, 6))
    prompts, slots = ([a, a, b], 4) if case == "prefix forks" else ([a, b, c], 2)
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (6, 3, 5)]
    budget = 4 if case == "chunks" else 16384
    _, ref = _scores(ckpt, "torch", prompts, forced, slots, rotate="none")
    fast_engine, fast = _scores(ckpt, "triton", prompts, forced, slots, prefill="triton", rotate="none", budget=budget,
                                reverse_batches=case == "mixed steps")
    assert "fast prefill" in fast_engine.attention_desc
    assert fast_engine.mixed_steps > 0 or case == "prefix forks"
    for r, f in zip(ref, fast):
        assert torch.isfinite(f).all()
        assert float((f - r).norm() / r.norm()) < 5e-2
    assert fast_engine.scheduler.blocks.num_free_blocks == fast_engine.scheduler.blocks.num_blocks


def test_triton_backend_refuses_formats_without_kernels(ckpt):
    cfg = EngineConfig(kv=KVConfig(format="nvfp4"), attention_backend="triton", num_kv_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match="attention_backend=triton"):
        Engine(ckpt, cfg, dtype="bfloat16", max_num_seqs=2)


def test_merged_projections_through_the_kernels_equal_separate_ones(ckpt):
    """The decode and prefill kernels' KV writes reading v as a split view of merged q|k|v (its row stride,
    no copy) against seven separate projections (the fused ops on split views: tests/test_fused_ops.py)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (5, 7)]
    forced = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (3, 2)]
    scores = {}
    for merge in (False, True):
        cfg = EngineConfig(kv=KVConfig(format="bf16", block_size=4), attention_backend="triton",
                           prefill_backend="triton", num_kv_blocks=16, max_model_len=32,
                           merge_projections=merge)
        engine = Engine(ckpt, cfg, dtype="bfloat16", max_num_seqs=2)
        assert engine.plan.merge_projections.value is merge and "fast prefill" in engine.attention_desc
        scores[merge] = engine.score_tokens(prompts, forced)
    for separate, merged in zip(scores[False], scores[True]):
        assert float((merged - separate).norm() / separate.norm()) < 1e-3  # bit-identical on the CPU here


def test_async_scheduling_feeds_the_decode_kernels_the_sampled_ids_on_the_device(ckpt):
    """`engine.async_scheduling` through the fast path: steps launched ahead take their input ids from the
    previous step's sampled tokens (`pending_ids`), not from the host, gathered to the rows that continue
    when others stop by length; the tokens equal the synchronous engine's, KV4 rows written by the fused
    writer included."""
    from kv4rl.engine.sequence import SamplingParams

    def run(async_scheduling):
        kv = KVConfig(format="kv4", group_size=32, n_sink=2, n_recent=3, block_size=4)
        engine = Engine(ckpt, EngineConfig(kv=kv, attention_backend="triton", num_kv_blocks=64, max_model_len=64,
                                           async_scheduling=async_scheduling), dtype="bfloat16", max_num_seqs=3)
        seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True), sample_seed=5 + i)
                for i, (p, m) in enumerate((([1, 2, 3], 4), ([4, 5, 6, 7, 8], 8), ([9, 10], 6)))]
        while engine.has_unfinished():
            engine.step()
        return engine, [s.output_ids for s in seqs]

    sync, ref = run(False)
    eng, got = run(True)
    assert eng.num_steps_ahead == 7  # steps 2-8: past the stops after tokens 4 and 6
    assert got == ref
