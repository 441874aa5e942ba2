"""`engine.async_scheduling`: the engine launches the next step before reading this one's tokens, and
samples what the synchronous engine samples (the reference: the same engine with the option off, whose
tokens equal transformers' in tests/test_engine.py). Cases: EOS stops found a step late, per-request
token limits, admissions into freed slots, a pool small enough to preempt, prefix-shared groups,
chunked prefill; and the calls that must first read the step in flight (weights, abort, unfinished)."""

import random

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine import llm
from kv4rl.engine.llm import Engine
from kv4rl.engine.run_ahead import rows_ahead
from kv4rl.engine.sequence import PENDING_TOKEN, SamplingParams

CASES = {
    "decode": {},
    "small pool (preemption)": {"kv": KVConfig(format="fp32", block_size=2), "num_kv_blocks": 40},
    "chunked prefill": {"max_num_batched_tokens": 8},
    "no prefix sharing": {"prefix_sharing": False},
}


def _requests(seed=0, n=12, groups=3):
    """Prompt groups (prefix sharing forks them) with per-request token limits."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(2, 18))] for _ in range(groups)]
    return [(prompts[i % groups], rng.randint(3, 20)) for i in range(n)]


def _run(path, async_scheduling, stop_ids, max_num_seqs=5, **cfg):
    cfg = {"kv": KVConfig(format="fp32"), "max_model_len": 48} | cfg
    engine = Engine(path, EngineConfig(async_scheduling=async_scheduling, **cfg), max_num_seqs=max_num_seqs,
                    device="cpu", dtype="float32")
    seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=n, stop_token_ids=stop_ids),
                               sample_seed=100 + i) for i, (p, n) in enumerate(_requests())]
    returned = []
    while engine.has_unfinished():
        returned += engine.step()
    return engine, seqs, returned


@pytest.mark.parametrize("case", CASES)
def test_async_engine_samples_what_the_synchronous_one_samples(tiny_qwen3, case):
    path, _ = tiny_qwen3
    # stop on a few frequent ids, so some requests stop early (found one step late when running ahead)
    stop_ids = (3, 17, 42, 58, 77)
    sync, ref, ref_returned = _run(path, False, stop_ids, **CASES[case])
    eng, got, returned = _run(path, True, stop_ids, **CASES[case])
    assert eng.num_steps_ahead > 0 and sync.num_steps_ahead == 0
    assert sorted(s.seq_id for s in returned) == sorted(s.seq_id for s in got)  # each returned once
    assert sorted(s.seq_id for s in ref_returned) == sorted(s.seq_id for s in ref)
    assert any(s.finish_reason == "stop" for s in ref) and any(s.finish_reason == "length" for s in ref)
    for a, b in zip(ref, got):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
        assert PENDING_TOKEN not in b.output_ids
        assert torch.allclose(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)
        assert b.output_versions == a.output_versions


LENGTH_STOPS = {
    # four requests of 3, 5, 7 and 9 tokens in four slots: with step k in flight the next step leaves out
    # the requests whose k-th token is their last (known before it is sampled), so steps 2-9 launch ahead
    # (8); stopping the run-ahead at each length stop would launch only steps 2, 3, 5, 7 and 9 ahead (5)
    "max_tokens": ([([5, 6, 7, i], m) for i, m in enumerate((3, 5, 7, 9))], 8, [3, 5, 7, 9]),
    # a 40-token prompt in a 48-token context stops after 8 tokens, a short one after 12 (max_tokens):
    # steps 2-12 launch ahead (11), the long request left out after step 8
    "context": ([(list(range(1, 41)), 30), ([5, 6, 7], 12)], 11, [8, 12]),
}


@pytest.mark.parametrize("case", LENGTH_STOPS)
def test_the_engine_runs_ahead_through_length_stops(tiny_qwen3, case):
    """Steps launched ahead counted by hand; each request returned by the call that reads its last token,
    with the synchronous engine's tokens and log-probs."""
    path, _ = tiny_qwen3
    requests, ahead, lengths = LENGTH_STOPS[case]
    outputs = {}
    for async_scheduling in (False, True):
        engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=48,
                                           async_scheduling=async_scheduling),
                        max_num_seqs=len(requests), device="cpu", dtype="float32")
        seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True), sample_seed=i)
                for i, (p, m) in enumerate(requests)]
        returned_at = {}
        while engine.has_unfinished():
            for seq in engine.step():
                returned_at[seq.seq_id] = len(seq.output_ids)
        assert engine.num_steps_ahead == (ahead if async_scheduling else 0)
        assert [returned_at[s.seq_id] for s in seqs] == lengths
        assert all(s.finish_reason == "length" for s in seqs)
        outputs[async_scheduling] = [(s.output_ids, s.output_logprobs) for s in seqs]
    for (ids, lps), (ref_ids, ref_lps) in zip(outputs[True], outputs[False]):
        assert ids == ref_ids and torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5)


def test_the_engine_runs_ahead_while_a_group_waits_for_its_slots(tiny_qwen3, monkeypatch):
    """Partial rollout's usual state: slots free one by one while the next GRPO group waits for room for
    all its siblings (`admit_siblings_together`). Nothing can be admitted then, so steps launch ahead
    (before, any waiting request stopped it); tokens stay the synchronous engine's, and the group is
    still admitted whole, forked from one prefill."""
    path, _ = tiny_qwen3
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 96) for _ in range(rng.randint(3, 9))] for _ in range(10)]
    requests = [(prompts[g], rng.randint(3, 20)) for g in range(10) for _ in range(4)]  # 10 groups of 4
    outputs = {}
    for async_scheduling in (False, True):
        engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=48,
                                           async_scheduling=async_scheduling),
                        max_num_seqs=32, device="cpu", dtype="float32")  # runs of up to 32 / 8 = 4 siblings
        seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True),
                                   sample_seed=i) for i, (p, m) in enumerate(requests)]
        ahead_while_waiting = 0

        def counted(sched, step):  # the engine's run-ahead decision, seen with the queue it was made on
            nonlocal ahead_while_waiting
            rows = rows_ahead(sched, step)
            ahead_while_waiting += rows is not None and bool(sched.waiting) and len(sched.running) < 32
            return rows

        monkeypatch.setattr(llm, "rows_ahead", counted)
        while engine.has_unfinished():
            engine.step()
        if async_scheduling:
            assert ahead_while_waiting > 0 and engine.scheduler.num_sibling_waits > 0
        outputs[async_scheduling] = [(s.output_ids, s.output_logprobs) for s in seqs]
        # each group after the first eight prefilled its prompt once: 8 + 2 prompts computed in all
        assert engine.num_prefill_tokens_saved == sum(len(p) - 1 for p in prompts) * 3
    for (ids, lps), (ref_ids, ref_lps) in zip(outputs[True], outputs[False]):
        assert ids == ref_ids and torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5)


def test_a_step_in_flight_is_read_before_weights_load_and_its_tokens_keep_the_old_version(tiny_qwen3):
    path, hf = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=48, async_scheduling=True),
                    max_num_seqs=4, device="cpu", dtype="float32")
    seqs = [engine.add_request([5, 6, 7, i], SamplingParams(max_tokens=12, ignore_eos=True), sample_seed=i)
            for i in range(4)]
    for _ in range(4):  # the prefill, then decodes that run ahead
        engine.step()
    assert engine.num_steps_ahead > 0 and engine._inflight is not None
    before = [len(s.output_ids) for s in seqs]
    engine.load_weights(hf.state_dict(), version=1)  # reads the step in flight first
    assert engine._inflight is None
    held = [len(s.output_ids) for s in seqs]
    assert held == [n + 1 for n in before]  # the step in flight added its token, sampled under version 0
    while engine.has_unfinished():
        engine.step()
    for s, n in zip(seqs, held):
        assert s.output_versions == [0] * n + [1] * (12 - n)


def test_abort_and_unfinished_see_no_pending_token(tiny_qwen3):
    path, _ = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=48, async_scheduling=True),
                    max_num_seqs=4, device="cpu", dtype="float32")
    seqs = [engine.add_request([9, 8, i], SamplingParams(max_tokens=10, ignore_eos=True), sample_seed=i)
            for i in range(3)]
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None
    assert all(PENDING_TOKEN not in s.output_ids for s in engine.unfinished())
    engine.abort(seqs[0])
    returned = []
    while engine.has_unfinished():
        returned += engine.step()
    assert seqs[0] not in returned and seqs[0].finish_reason == "abort"
    assert sorted(s.seq_id for s in returned) == sorted(s.seq_id for s in seqs[1:])
    assert all(len(s.output_ids) == 10 and PENDING_TOKEN not in s.output_ids for s in seqs[1:])


def test_async_scheduling_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="engine.async_scheduling.*tensor_parallel=2"):
        EngineConfig(async_scheduling=True, tensor_parallel=2).validate()


def test_generate_hands_none_of_its_requests_to_the_caller_and_leaves_no_step_in_flight(tiny_qwen3):
    """An error while `generate` steps: aborting its first request read the step in flight, and a request of
    the call that stopped in it was left for the caller's next `step`. And a `generate` whose last requests
    stopped at EOS left a step launched ahead: `has_unfinished()` on an idle engine, and the caller's next
    step (its trace) was the eval's. Reference: the synchronous engine, which has neither."""
    path, _ = tiny_qwen3

    class Stop(Exception):
        pass

    def stop_after_one(done):
        if done >= 1:
            raise Stop

    stops = list(range(0, 97, 4))  # a quarter of the vocabulary ends a request: stops land in drains
    escaped = 0
    for trial in range(12):
        engine = Engine(path, EngineConfig(async_scheduling=True, kv=KVConfig(format="fp32", block_size=4),
                                           max_model_len=64), max_num_seqs=4, device="cpu", dtype="float32")
        params = SamplingParams(temperature=1.0, max_tokens=30, stop_token_ids=stops)
        prompts = [[5, 6, 7, i] for i in range(4)]
        with pytest.raises(Stop):
            engine.generate(prompts, params, tags=[("eval", i) for i in range(4)], progress=stop_after_one,
                            sample_seeds=[1000 * trial + i for i in range(4)])
        escaped += len(engine._backlog)
        assert not engine.has_unfinished()  # nothing of the call left to a later `step`
        out = engine.generate(prompts, params, sample_seeds=[1000 * trial + 7 + i for i in range(4)])
        assert len(out) == 4 and not engine.has_unfinished()  # no step left in flight after a normal return
    assert escaped == 0
