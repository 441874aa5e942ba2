"""Correction variance (A-9c) on a random tiny checkpoint: log-prob plumbing and the pooled variances.

References are independent of the module: log π by an unpadded float64 forward per response, F_t^H by
explicit loops, variances with numpy.
"""

import numpy as np
import pytest
import torch

from kv4rl.sim.correction_variance import (
    Behavior,
    BehaviorUnavailableError,
    Settings,
    behavior_engine_config,
    measure,
    parse_behavior,
    parse_horizons,
)
from kv4rl.sim.reference_policies import stale_policy

HORIZONS = [1, 3, None]
TEMPERATURE = 0.9


def arith_checkpoint(path):
    """A random Qwen3 over the arithmetic task's char tokenizer, saved with that tokenizer."""
    from kv4rl.data.char_tokenizer import build_char_tokenizer
    from tests.conftest import make_checkpoint

    tokenizer = build_char_tokenizer(path)
    make_checkpoint(path, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id, head_dim=32,
                    pad_token_id=tokenizer.pad_token_id)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return arith_checkpoint(tmp_path_factory.mktemp("arith-ckpt"))


def settings(path, behavior, **overrides):
    base = {"model_dir": path, "behavior": parse_behavior(behavior), "horizons": HORIZONS, "n_prompts": 3,
            "samples_per_prompt": 3, "max_new_tokens": 7, "temperature": TEMPERATURE, "seed": 5,
            "device": "cpu", "stale_lr": 3e-3, "stale_batch_size": 4}
    return Settings(**(base | overrides))


@pytest.fixture(scope="module")
def stale2(checkpoint):
    return measure(settings(checkpoint, "stale:2"))


def float64_logprobs(model, prompt, response):
    """log softmax(logits/τ) of each response token, one unpadded float64 forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return [float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(response)]


def independent_log_ratios(model, m):
    """Per response: c_t = (float64 log π) − (engine log μ), as float64 numpy arrays."""
    rows = []
    for i, (prompt, response) in enumerate(zip(m.prompt_ids, m.response_ids, strict=True)):
        ref = np.array(float64_logprobs(model, prompt, response))
        rows.append(ref - m.behavior_logprobs[i, : len(response)].numpy())
    return rows


def brute_force_credit(rows, horizon):
    values = []
    for c in rows:
        for t in range(len(c)):
            end = len(c) if horizon is None else min(t + horizon, len(c))
            total = 0.0
            for k in range(t, end):
                total += c[k]
            values.append(total)
    return np.array(values)


def hf_float64(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def test_stale_variances_match_independent_computation(checkpoint, stale2):
    m = stale2
    summary = m.summary
    assert [r["horizon"] for r in summary["horizons"]] == [1, 3, "full"]
    assert summary["n_responses"] == 9 and summary["n_tokens"] == int(m.mask.sum())
    rows = independent_log_ratios(hf_float64(checkpoint), m)
    for i, c in enumerate(rows):
        ref = (m.reference_logprobs[i, : len(c)] - m.behavior_logprobs[i, : len(c)]).numpy()
        np.testing.assert_allclose(ref, c, atol=1e-5)  # the module's fp32 log π matches float64
    by_h = {r["horizon"]: r for r in summary["horizons"]}
    np.testing.assert_allclose(by_h[1]["var"], np.var(np.concatenate(rows)), rtol=1e-4)
    for horizon, label in ((3, 3), (None, "full")):
        expected = brute_force_credit(rows, horizon)
        np.testing.assert_allclose(by_h[label]["var"], np.var(expected), rtol=1e-4)
        np.testing.assert_allclose(by_h[label]["mean"], expected.mean(), rtol=1e-4, atol=1e-9)
    assert all(r["var"] >= 0 for r in summary["horizons"])
    assert by_h[1]["var"] > 1e-6  # two AdamW steps at 3e-3 really moved μ away from π


def test_engine_sampled_from_the_stale_policy(checkpoint, stale2):
    """The behaviour log-probs are those of the K-step policy, recomputed here in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource

    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    source = ProblemSource(None, None, seed=5)
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(checkpoint), source.default_template)
    # the problems after the 3 measured ones, 4 a step (batch(1 + k, 4) would be 4..11: with more measured
    # prompts than a step's batch, the measured ones were trained on)
    batches = [[source.problem_at(3 + 4 * k + j) for j in range(4)] for k in range(2)]
    assert not {p.id for b in batches for p in b} & {p.id for p in source.batch(0, 3)}
    mu = stale_policy(policy, batches, formatter, lr=3e-3).double()
    again = stale_policy(policy, batches, formatter, lr=3e-3)
    for a, b in zip(mu.parameters(), again.parameters(), strict=True):
        assert torch.equal(a.float(), b)  # deterministic
    for i, (prompt, response) in enumerate(zip(stale2.prompt_ids, stale2.response_ids, strict=True)):
        expected = float64_logprobs(mu, prompt, response)
        np.testing.assert_allclose(stale2.behavior_logprobs[i, : len(response)].numpy(), expected, atol=1e-4)


def test_zero_steps_gives_zero_correction(checkpoint):
    m = measure(settings(checkpoint, "stale:0"))
    c = (m.reference_logprobs - m.behavior_logprobs)[m.mask]
    assert float(c.abs().max()) < 1e-4
    for row in m.summary["horizons"]:
        assert 0 <= row["var"] < 1e-8


def test_parsers_reject_bad_input():
    assert parse_behavior("stale:16") == Behavior(kind="stale", steps=16)
    assert parse_horizons("1, 4,full") == [1, 4, None]
    for bad in ("stale:", "stale:-1", "stale:x", "fp16", "", "stale:\u00b2"):  # ², which isdigit() takes, int() not
        with pytest.raises(ValueError, match="--behavior"):
            parse_behavior(bad)
    for bad in ("0", "1,abc", "2,2", "", " ", "\u0663"):  # U+0663: an Arabic-Indic 3, which int() reads
        with pytest.raises(ValueError, match="--horizons"):
            parse_horizons(bad)
    with pytest.raises(ValueError, match="--horizons is empty"):
        parse_horizons("")
    with pytest.raises(ValueError, match="--temperature"):
        settings("unused", "stale:1", temperature=0.0).validate()
    with pytest.raises(ValueError, match="engine.kv.nosuch"):
        behavior_engine_config(Behavior(kind="stale", steps=1), 64, ["kv.nosuch=1"])


def test_a_data_file_too_short_for_distinct_prompts_and_stale_batches_is_refused(checkpoint, tmp_path):
    """The stale batches follow the measured prompts in the file, and the source wraps around past its end: a file
    of fewer rows measured repeated prompts and trained μ on the ones it measured, without a word."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"problem": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(10)))
    with pytest.raises(ValueError, match=r"10 problems, fewer than the 11 distinct ones .*3 measured, then 8 that "
                                         r"stale:2 trains"):
        measure(settings(checkpoint, "stale:2", data=data, template="{problem}="))
    with pytest.raises(ValueError, match=r"this measurement takes \(12 measured\): prompts would repeat; lower"):
        measure(settings(checkpoint, "stale:0", data=data, template="{problem}=", n_prompts=12))  # nothing trained


def test_missing_kv4_format_is_named(monkeypatch):
    from kv4rl.engine import kv_formats

    monkeypatch.delitem(kv_formats.KV_FORMATS, "kv4", raising=False)
    with pytest.raises(BehaviorUnavailableError, match="KV_FORMATS"):
        behavior_engine_config(Behavior(kind="kv4"), 64)


def test_fp8_weights_need_engine_support():
    import dataclasses

    from kv4rl.engine.config import EngineConfig

    if "weight_format" in {f.name for f in dataclasses.fields(EngineConfig)}:
        assert behavior_engine_config(Behavior(kind="fp8"), 64).weight_format == "fp8"
    else:
        with pytest.raises(BehaviorUnavailableError, match="weight_format"):
            behavior_engine_config(Behavior(kind="fp8"), 64)


def test_kv4_behavior_when_the_engine_has_it(checkpoint):
    from kv4rl.engine.kv_formats import KV_FORMATS

    if "kv4" not in KV_FORMATS:
        pytest.skip("the engine has no KV4 cache format registered yet")
    # head_dim is 32 and contexts are ~16 tokens: a small group and protected budget leave INT4 positions
    overrides = ["kv.group_size=32", "kv.n_sink=2", "kv.n_recent=4"]
    m = measure(settings(checkpoint, "kv4", n_prompts=2, engine_overrides=overrides))
    rows = independent_log_ratios(hf_float64(checkpoint), m)
    by_h = {r["horizon"]: r for r in m.summary["horizons"]}
    expected = np.var(brute_force_credit(rows, None))
    np.testing.assert_allclose(by_h["full"]["var"], expected, rtol=1e-4, atol=1e-12)
    assert by_h[1]["var"] > 0  # a 4-bit cache does change the sampled distribution
