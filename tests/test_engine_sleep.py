"""Engine sleep/wake: the pool's tensors are really freed, and nothing the engine samples changes."""

import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from kv4rl.config import ConfigError, load_config
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from kv4rl.loop import train
from tests.test_engine import prompts


def make_engine(path, fmt="fp32", num_blocks=None, sleep=True):
    cfg = EngineConfig(kv=KVConfig(format=fmt, block_size=4),
                       num_kv_blocks=num_blocks, max_model_len=48, sleep_between_rollouts=sleep)
    return Engine(path, cfg, max_num_seqs=6, device="cpu", dtype="float32")


@pytest.mark.parametrize("fmt", ["fp32", "nvfp4"])
def test_sleep_frees_every_pool_tensor_and_wake_samples_as_before(tiny_qwen3, fmt):
    path, _ = tiny_qwen3
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    ps = prompts(8, 97, seed=1)
    ref = make_engine(path, fmt, sleep=False).generate(ps, params)

    engine = make_engine(path, fmt)
    pool_bytes, pool_tokens = engine.pool_bytes, engine.pool_tokens
    assert f"KV pool {pool_bytes / 2**10:.1f} KiB awake, 0 asleep" in engine.summary
    refs = [weakref.ref(t) for cache in engine.runner.caches for t in cache.values()]
    assert refs and all(r() is not None for r in refs)
    engine.sleep()
    gc.collect()
    assert engine.runner.caches is None and engine.runner.cache_bytes == 0
    assert all(r() is None for r in refs), "a pool tensor outlived sleep(): its memory was not freed"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(ps, params)  # queued while asleep, but stepping needs the pool
    for seq in engine.unfinished():
        engine.abort(seq)
    engine.wake()
    assert (engine.pool_bytes, engine.pool_tokens) == (pool_bytes, pool_tokens)  # CPU: the same size
    out = engine.generate(ps, params)
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def run_with_sleep(path, fmt, ps, params, sleep_after, check=None):
    """Generate `ps` (request i seeded 100 + i), sleeping and waking after step `sleep_after` (None: never);
    `check(engine, seqs, when)` runs just before the sleep and just after it. Returns the engine and requests."""
    engine = make_engine(path, fmt, sleep=sleep_after is not None)
    seqs = [engine.add_request(p, params, sample_seed=100 + i) for i, p in enumerate(ps)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == sleep_after:
            if check is not None:
                check(engine, seqs, "before")
            engine.sleep()
            if check is not None:
                check(engine, seqs, "asleep")
            engine.wake()
    return engine, seqs


def test_nvfp4_keeps_its_calibrated_scales_across_sleep(tiny_qwen3):
    """NVFP4 calibrates one scale per layer and K/V on the first write and keeps it for the engine's life.
    A wake that re-calibrated it on the recompute prefill (other data) changed every later token's KV."""
    path, _ = tiny_qwen3
    ps, params = prompts(4, 97, seed=0), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [run_with_sleep(path, "nvfp4", ps, params, sleep_after) for sleep_after in (None, 4)]
    (plain, plain_seqs), (slept, slept_seqs) = runs
    scales = [[(float(c["k_tensor_scale"]), float(c["v_tensor_scale"])) for c in e.runner.caches] for e, _ in runs]
    assert all(k > 0 and v > 0 for k, v in scales[0]) and scales[1] == scales[0]
    assert [s.output_ids for s in slept_seqs] == [s.output_ids for s in plain_seqs]


def test_requests_in_flight_survive_sleep_by_recompute(tiny_qwen3):
    """Sleep mid-generation: running sequences are preempted (KV dropped), re-prefilled after wake,
    and finish with the tokens of an uninterrupted run (log-probs equal up to the prefill's rounding)."""
    path, _ = tiny_qwen3
    ps = prompts(6, 97, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)

    def check(engine, seqs, when):
        if when == "before":
            assert all(s.num_cached_tokens > 0 for s in engine.scheduler.running)
        else:
            assert not engine.scheduler.running and all(not s.block_table for s in seqs)

    engine, plain = run_with_sleep(path, "fp32", ps, params, None)
    none = engine.num_preemptions
    engine, slept = run_with_sleep(path, "fp32", ps, params, 5, check)
    preempted = engine.num_preemptions
    assert none == 0 and preempted == len(ps)
    for a, b in zip(plain, slept):
        assert a.output_ids == b.output_ids and a.output_versions == b.output_versions
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)


def test_sleep_and_wake_refuse_the_wrong_order(tiny_qwen3):
    engine = make_engine(tiny_qwen3[0])
    with pytest.raises(RuntimeError, match="awake"):
        engine.wake()
    engine.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep()


def test_sleep_with_carried_kv_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="rollout.carry=recompute"):
        load_config(overrides=["engine.sleep_between_rollouts=true", "rollout.mode=partial"])
    load_config(overrides=["engine.sleep_between_rollouts=true", "rollout.mode=sync"])  # nothing is carried


@pytest.mark.slow
def test_training_that_sleeps_every_iteration_equals_training_that_does_not(tmp_path):
    """Partial rollout carrying responses across updates, with a lag: the sleeping engine drops their KV
    before each update and the non-sleeping one at each refresh (`carry: recompute`), and both re-prefill
    under the new weights before the next step, so on CPU fp32 every token, metric and weight is equal
    bit for bit."""
    common = ["device=cpu", "trainer.iterations=3", "checkpoint.save_every=3", "rollout.mode=partial",
              "rollout.max_slots=12", "rollout.quota_groups=2", "rollout.group_size=4", "rollout.carry=recompute",
              "staleness.lag=1"]
    runs = {}
    for name, sleep in (("awake", "false"), ("sleeps", "true")):
        cfg = load_config(overrides=[f"name={name}", f"out_dir={tmp_path}", *common,
                                     f"engine.sleep_between_rollouts={sleep}"])
        train(cfg, show_progress=False)
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (rows, load_file(cfg.run_dir / "checkpoints" / "iter_000003" / "model.safetensors"))
    (awake, w_awake), (slept, w_slept) = runs["awake"], runs["sleeps"]
    assert [r["time_sleep_wake"] for r in awake] == [0.0] * 3 and all(r["time_sleep_wake"] > 0 for r in slept)
    assert any(r["staleness_max"] > 1 for r in awake), "no response was carried across an update"
    untimed = lambda r: {k: v for k, v in r.items() if not k.startswith("time_") and k != "tokens_per_s"}
    assert [untimed(r) for r in awake] == [untimed(r) for r in slept]
    assert w_awake.keys() == w_slept.keys()
    for k in w_awake:
        assert torch.equal(w_awake[k], w_slept[k]), k
