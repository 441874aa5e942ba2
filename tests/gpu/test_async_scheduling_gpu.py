"""`engine.async_scheduling` on CUDA, CUDA graphs on: steps launched ahead copy their input ids into the
decode graph's static buffer on the device; the tokens equal the synchronous engine's, bit for bit, when
the batches are the same (every request stops by length, so no stop is found a step late; log-probs
to 1e-5), and with
EOS stops (found a step late) the tokens still match; the host does not wait inside a launched step.
The logic on the CPU: tests/test_async_scheduling.py, and through the kernels: tests/test_fast_path_cpu.py."""

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from tests.gpu.test_engine_fast_path_gpu import ckpt  # noqa: F401 (fixture: head_dim 128, GQA)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _engine(path, fmt, async_scheduling):
    kv = {"n_sink": 4, "n_recent": 32} if fmt == "kv4" else {}
    cfg = EngineConfig(kv=KVConfig(format=fmt, block_size=16, **kv), num_kv_blocks=512, max_model_len=1024,
                       async_scheduling=async_scheduling)
    return Engine(path, cfg, device="cuda", dtype="bfloat16", max_num_seqs=16)


def _run(engine, stop_ids=None, n=24):
    """`n` requests, each its own length limit, in 16 slots: admissions into freed slots along the way."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (int(k),), generator=gen).tolist() for k in torch.randint(5, 200, (n,), generator=gen)]
    limits = torch.randint(20, 120, (n,), generator=gen).tolist()
    seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=stop_ids is None,
                                                 stop_token_ids=stop_ids), sample_seed=i)
            for i, (p, m) in enumerate(zip(prompts, limits))]
    returned = []
    while engine.has_unfinished():
        returned += engine.step()
    return seqs, returned


def _generate(path, fmt, async_scheduling, stop_ids=None):
    engine = _engine(path, fmt, async_scheduling)
    return (engine, *_run(engine, stop_ids))


@pytest.mark.parametrize("fmt", ["bf16", "kv4"])
def test_async_engine_on_graphs_samples_the_synchronous_tokens(ckpt, fmt):  # noqa: F811
    _, ref, _ = _generate(ckpt, fmt, False)
    engine, got, returned = _generate(ckpt, fmt, True)
    assert engine.num_steps_ahead > 0 and engine.runner.graphs.num_replays > 0
    assert len(returned) == len(got)
    for a, b in zip(ref, got):
        assert b.output_ids == a.output_ids
        assert torch.allclose(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)


def test_async_engine_with_stops_found_a_step_late(ckpt):  # noqa: F811
    stops = tuple(range(0, 500, 37))  # ~3% of the vocabulary: most requests stop early
    _, ref, _ = _generate(ckpt, "bf16", False, stop_ids=stops)
    engine, got, returned = _generate(ckpt, "bf16", True, stop_ids=stops)
    assert any(s.finish_reason == "stop" for s in ref) and engine.num_steps_ahead > 0
    assert sorted(s.seq_id for s in returned) == sorted(s.seq_id for s in got)
    for a, b in zip(ref, got):  # batches differ after a stop, so bf16 rounding may differ: tokens still match
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason


def test_a_step_launched_ahead_does_not_wait_for_the_device(ckpt, monkeypatch):  # noqa: F811
    """CUDA's sync debug mode raises on any synchronizing call inside `Engine._launch`, here for steps
    whose input ids come from the previous step's samples on the device (as
    tests/gpu/test_engine_no_host_wait_gpu.py checks the synchronous steps)."""
    engine = _engine(ckpt, "bf16", True)
    _run(engine)  # graph capture and kernel compilation synchronize: not checked
    ahead_before = engine.num_steps_ahead
    launch = engine._launch
    ahead = []

    def checked(seqs, rows, sampled, pending_ids=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(seqs, rows, sampled, pending_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            ahead.append(pending_ids is not None)

    monkeypatch.setattr(engine, "_launch", checked)
    _run(engine)
    assert sum(ahead) == engine.num_steps_ahead - ahead_before > 0
