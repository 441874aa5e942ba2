"""Engine against full recomputation with transformers: paged KV, continuous batching, preemption."""

import random

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def greedy_reference(model, prompt, n):
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 1) for _ in range(rng.randint(1, 20))] for _ in range(n)]


@pytest.mark.parametrize("block_size,num_blocks", [(16, None), (4, None), (2, 40)])
def test_greedy_paged_decoding_equals_full_recompute(tiny_qwen3, block_size, num_blocks):
    path, hf = tiny_qwen3
    cfg = EngineConfig(kv=KVConfig(format="fp32", block_size=block_size), num_kv_blocks=num_blocks,
                       max_model_len=64)
    engine = Engine(path, cfg, max_num_seqs=6, device="cpu", dtype="float32")
    ps = prompts(10, 97, seed=block_size)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, c in zip(ps, outs):
        assert c.token_ids == greedy_reference(hf, p, 12)
        assert c.finish_reason == "length"
    if num_blocks is not None:
        assert engine.num_preemptions > 0  # the small pool really exercised preempt + recompute


def test_sampled_logprobs_match_transformers(tiny_qwen3):
    path, hf = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32")
    ps = prompts(6, 97, seed=1)
    outs = engine.generate(ps, SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True, seed=3))
    for p, c in zip(ps, outs):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].double()
        ref = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-4)
        assert c.versions == [0] * len(c.token_ids)


def test_eos_stops_and_versions_follow_load_weights(tiny_qwen3):
    path, hf = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32")
    ps = prompts(4, 97, seed=2)
    first = greedy_reference(hf, ps[0], 3)
    out = engine.generate([ps[0]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(first[2],)))[0]
    assert out.token_ids[-1] == first[2] and out.finish_reason == "stop" and len(out.token_ids) <= 3
    engine.load_weights(hf.state_dict(), version=5)
    out = engine.generate([ps[1]], SamplingParams(max_tokens=4, ignore_eos=True, seed=0))[0]
    assert out.versions == [5, 5, 5, 5]


def test_load_weights_changes_the_policy(tiny_qwen3, tmp_path):
    from tests.conftest import make_checkpoint

    path, _ = tiny_qwen3
    other = make_checkpoint(tmp_path, seed=1)
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32")
    p = prompts(1, 97, seed=4)[0]
    engine.load_weights(other.state_dict(), version=1)
    out = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == greedy_reference(other, p, 8)


def test_bf16_cache_runs(tiny_qwen3):
    path, _ = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="bf16"), max_model_len=64), device="cpu", dtype="float32")
    out = engine.generate(prompts(3, 97, seed=5), SamplingParams(max_tokens=5, ignore_eos=True, seed=0))
    assert all(len(c.token_ids) == 5 for c in out)
    assert engine.bytes_per_token == 2 * 2 * 2 * 16 * 2  # K+V x layers x kv heads x head_dim x 2 bytes


def test_sampling_is_independent_of_batching_and_preemption(tiny_qwen3):
    """Counter-based noise: a request samples the same tokens alone, in a batch, or when preempted."""
    path, _ = tiny_qwen3
    ps = prompts(8, 97, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11)

    def run(num_blocks, max_seqs, order):
        cfg = EngineConfig(kv=KVConfig(format="fp32", block_size=2), num_kv_blocks=num_blocks, max_model_len=40)
        engine = Engine(path, cfg, max_num_seqs=max_seqs, device="cpu", dtype="float32")
        seqs = [engine.add_request(ps[i], params, sample_seed=1000 + i) for i in order]
        while engine.has_unfinished():
            engine.step()
        return {s.sample_seed: (s.output_ids, s.output_logprobs) for s in seqs}, engine.num_preemptions

    alone, _ = run(None, 1, range(8))
    batched, _ = run(None, 8, reversed(range(8)))
    squeezed, preempted = run(30, 8, range(8))
    assert preempted > 0
    for key in alone:
        assert alone[key][0] == batched[key][0] == squeezed[key][0]
        assert torch.allclose(torch.tensor(alone[key][1]), torch.tensor(squeezed[key][1]), atol=1e-5)


def _engine(path, max_model_len=64):
    return Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=max_model_len), device="cpu",
                  dtype="float32")


def test_a_resumed_response_that_already_stops_generates_nothing(tiny_qwen3):
    """The resumed tokens are checked against the stop conditions before any step, as each sampled token is."""
    from kv4rl.engine.sequence import Completion

    path, _ = tiny_qwen3
    engine = _engine(path, max_model_len=20)

    def resume(prompt, tokens, params):
        part = Completion(seq_id=0, prompt_ids=prompt, token_ids=tokens, logprobs=[-0.5] * len(tokens),
                          versions=[0] * len(tokens), finish_reason="length")
        seq = engine.add_request(prompt, params, resume_from=part)
        returned = []
        while engine.has_unfinished():
            returned += engine.step()
        assert returned == [seq]  # returned by a step, as a request that stopped there would be
        return seq

    greedy = {"temperature": 0, "ignore_eos": True}
    full = resume([1, 2, 3], [10, 11, 12, 13], SamplingParams(max_tokens=4, **greedy))  # max_tokens reached
    at_limit = resume(list(range(10)), list(range(10, 20)), SamplingParams(max_tokens=30, **greedy))  # 20 tokens
    stopped = resume([1, 2, 3], [7, 42], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(42,)))
    assert (full.output_ids, full.finish_reason) == ([10, 11, 12, 13], "length")
    assert (len(at_limit), at_limit.finish_reason) == (20, "length")
    assert (stopped.output_ids, stopped.finish_reason) == ([7, 42], "stop")
    going_on = resume([1, 2, 3], [7, 42], SamplingParams(max_tokens=4, **greedy))  # no stop: two more tokens
    assert going_on.output_ids[:2] == [7, 42] and len(going_on.output_ids) == 4


def test_generate_refuses_tags_that_do_not_match_the_prompts(tiny_qwen3):
    path, _ = tiny_qwen3
    with pytest.raises(ValueError, match="1 tags for 3 prompts"):
        _engine(path).generate(prompts(3, 97, seed=0), SamplingParams(max_tokens=2), tags=["a"])


def test_abort_of_a_finished_request_keeps_its_finish_reason(tiny_qwen3):
    path, _ = tiny_qwen3
    engine = _engine(path)
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.abort(seq)
    assert seq.finish_reason == "length" and seq.output_ids and not engine.has_unfinished()


def test_any_int_is_a_sampling_seed_and_seeds_in_range_keep_their_stream(tiny_qwen3):
    from kv4rl.engine.sampler import as_int64, request_seed

    assert as_int64(2**64 + 5) == 5 and as_int64(2**63) == -(2**63) and as_int64(-7) == -7
    # seeds are taken modulo 2**64, and any int works (10**13 * 1_000_003 overflowed int64: it raised)
    assert request_seed(2**64 + 5, 3) == request_seed(5, 3) == request_seed(5 - 2**64, 3)
    assert 0 <= request_seed(10**13, 3) < 2**62 and 0 <= request_seed(-(10**30), 2**70) < 2**62
    path, _ = tiny_qwen3
    engine = _engine(path)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    big = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True, seed=10**13))[0]
    assert len(big.token_ids) == 3
    a = engine.add_request([1, 2, 3], params, sample_seed=2**64 + 11)
    b = engine.add_request([1, 2, 3], params, sample_seed=11)
    while engine.has_unfinished():
        engine.step()
    assert a.output_ids == b.output_ids  # the same stream (log-probs: two rows of one batch, equal to rounding)
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, 1e-45, 1e-6])
def test_temperatures_the_engine_cannot_sample_at_are_refused(temperature):
    """NaN sampled token 0 at every step with NaN log-probs, and 1e-45 overflowed the scaled logits."""
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or at least 1e-05"):
        SamplingParams(temperature=temperature).validate()
    for fine in (0.0, 1e-5, 2.0):
        SamplingParams(temperature=fine).validate()


def test_generate_leaves_requests_already_in_the_engine_waiting_and_hands_each_back_once(tiny_qwen3):
    """A periodic eval calls generate while a collector's partial responses are in flight: they must neither be
    advanced by its steps (that moved the rollout's batch boundaries) nor finished and dropped (groups lost)."""
    path, _ = tiny_qwen3
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)

    def run(interrupt):
        engine = _engine(path)
        owned = [engine.add_request(p, params, sample_seed=50 + i) for i, p in enumerate(prompts(3, 97, seed=3))]
        returned = []
        for _ in range(2):
            returned += engine.step()
        lengths = [len(s.output_ids) for s in owned]
        if interrupt:
            out = engine.generate(prompts(4, 97, seed=9), SamplingParams(max_tokens=3, ignore_eos=True, seed=1))
            assert [len(c.token_ids) for c in out] == [3] * 4
            assert [len(s.output_ids) for s in owned] == lengths  # not advanced while parked
        while engine.has_unfinished():
            returned += engine.step()
        return owned, returned

    plain, plain_returned = run(False)
    parked, parked_returned = run(True)
    assert sorted(map(id, parked_returned)) == sorted(map(id, parked))  # each exactly once, no stranger
    assert [s.output_ids for s in parked] == [s.output_ids for s in plain]
    assert [s.finish_reason for s in parked] == ["length"] * 3


def test_a_request_that_stopped_before_generate_is_handed_back_by_the_step_after_it(tiny_qwen3):
    """Stopped in the step in flight (async scheduling), it waited in the backlog, which generate's own first
    step emptied into nowhere."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()  # it stops at its first token and is returned here
    engine._backlog.append(seq)  # as a drain would have kept it, had the step been in flight
    engine.generate([[4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [seq]


def test_generation_config_eos_ids_also_stop(tiny_qwen3, tmp_path):
    """A chat checkpoint may name its second stop token only in generation_config.json (Qwen3 does); the
    engine stops there too (on the union of both files' ids: transformers.generate takes generation_config's
    alone where it names any). Reference: the unstopped greedy tokens."""
    import json
    import shutil

    path, hf = tiny_qwen3
    folder = tmp_path / "model"
    shutil.copytree(path, folder)
    prompt = prompts(1, 97, seed=5)[0]
    greedy = greedy_reference(hf, prompt, 8)
    stop = next(t for t in greedy if t != 96)  # 96 is config.json's eos; pick a token it does not already stop at
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [96, stop]}))
    engine = Engine(folder, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu",
                    dtype="float32")
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    cut = next(i for i, t in enumerate(greedy) if t in (96, stop))
    assert out.token_ids == greedy[: cut + 1] and out.finish_reason == "stop"


def test_add_request_samples_with_the_params_seed_as_generates_first_request(tiny_qwen3):
    path, _ = tiny_qwen3
    prompt = prompts(1, 97, seed=6)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11)
    outs = []
    for _ in range(2):  # two engines: their own random generators must not matter
        engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu",
                        dtype="float32")
        seq = engine.add_request(prompt, params)
        done = []
        while not done:
            done = engine.step()
        assert done == [seq]
        outs.append(list(seq.output_ids))
    assert outs[0] == outs[1] == engine.generate([prompt], params)[0].token_ids
