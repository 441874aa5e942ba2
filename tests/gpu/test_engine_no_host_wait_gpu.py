"""An engine step queues its forward and its sampling without the host waiting for the device: CUDA's
sync debug mode raises on any synchronizing call (a blocking copy, `.item()`, a data-dependent shape)
inside `Engine._launch`, in decode steps that replay the CUDA graph and in split steps (graph for the
decode rows, an eager forward for the prompts admitted that step). The step's only wait is then the
read of its tokens, which `last_step["wait_s"]` records (it missed the sampler's blocking copies before:
bench/RESULTS.md, sixth session)."""

import pytest
import torch

from kv4rl.engine.sequence import Completion, SamplingParams
from tests.gpu.test_engine_fast_path_gpu import _engine, _prompts, ckpt  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _generate(engine, prompts):
    """Each request its own length, so a slot frees while the others decode and the next prompt is
    admitted beside decoding rows (a split step). With one length for all, the four running requests
    finish in the same step and every admission lands in a step with no decode rows (no split step:
    this test failed that way on an H200 on 2026-12-02, with no host wait raised)."""
    seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=6 + 5 * (i % 4), ignore_eos=True),
                               sample_seed=101 + i) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [Completion.from_sequence(s) for s in seqs]


@pytest.mark.parametrize("fmt", ["bf16", "kv4"])
def test_a_step_launches_without_waiting_for_the_device(ckpt, fmt, monkeypatch):  # noqa: F811
    kv = {"n_sink": 4, "n_recent": 32} if fmt == "kv4" else {}
    # four slots for twelve requests, so prompts are admitted while others decode (split steps); no
    # prefix sharing, so the second run takes the first one's shapes (graph buckets, kernel configs)
    engine = _engine(ckpt, fmt, "triton", sharing=False, max_num_seqs=4, **kv)
    prompts = _prompts(12, torch.Generator().manual_seed(3), hi=120)
    warm = _generate(engine, prompts)  # graph capture and kernel compilation synchronize: not checked

    launch, launched = engine._launch, []

    def checked(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append(len(args[0]))
        return out

    monkeypatch.setattr(engine, "_launch", checked)
    split_before, replays_before = engine.runner.num_split_steps, engine.runner.graphs.num_replays
    out = _generate(engine, prompts)
    assert launched and engine.runner.num_split_steps > split_before
    assert engine.runner.graphs.num_replays > replays_before
    assert [c.token_ids for c in out] == [c.token_ids for c in warm]  # the same seeds, the same tokens
    assert engine.last_step["wait_s"] > 0
