"""Mismatch attribution: one source switched on at a time moves only its own term; the terms always add
up to learner - recorded log-prob, which a float64 forward of the HF model checks independently."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.scoring import Sampling
from kv4rl.engine.sequence import SamplingParams
from kv4rl.telemetry.attribution import MismatchAttribution, decompose, summarize
from kv4rl.telemetry.mismatch_curves import SOURCES
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner

TEMPERATURE = 0.8
NOISE = 1e-5  # fp32 floor on CPU: HF vs engine decoder, decode steps vs one prefill
PROMPTS = [[5, 17, 3, 40, 8], [22, 9, 61], [70, 2, 2, 33, 12, 4, 90], [1, 50, 7, 7]]


def learner_for(path):
    return Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=8, updates_per_batch=1, temperature=TEMPERATURE, device=torch.device("cpu"))


def rollout(path, config: EngineConfig, top_k: int = 0, dtype: str = "auto", min_p: float = 0.0):
    """An engine of `config` and a batch of its responses (version 0, 10 tokens each)."""
    engine = Engine(path, config, max_num_seqs=4, device="cpu", dtype=dtype)
    params = SamplingParams(temperature=TEMPERATURE, top_k=top_k, min_p=min_p, max_tokens=10, ignore_eos=True, seed=3)
    done = engine.generate(PROMPTS, params)
    batch = build_batch(PROMPTS, [c.token_ids for c in done], [c.logprobs for c in done],
                        [c.versions for c in done], [0.0] * len(done), pad_id=0)
    return engine, batch


def float64_total(path_or_model, batch) -> torch.Tensor:
    """learner - recorded log-prob per attributed token, from an unpadded float64 HF forward."""
    model = path_or_model if not isinstance(path_or_model, str) else \
        AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float64)
    model = model.double()
    out = []
    for i in range(len(batch)):
        n = int(batch.attention_mask[i].sum())
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids[i: i + 1, :n]).logits[0, :-1]
        logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, batch.input_ids[i, 1:n, None]).squeeze(1)
        mask = batch.response_mask[i, : n - 1] > 0
        out.append(logp[mask] - batch.behavior_logprobs[i, : n - 1][mask].double())
    return torch.cat(out)


def attribute(engine, learner, batch, iteration=0, top_k=0, keep=None, min_p=0.0):
    att = MismatchAttribution(engine, learner, every=1, samples=len(batch),
                              sampling=Sampling(TEMPERATURE, top_k, min_p=min_p),
                              horizon=1)
    att.weights.update(keep or {})
    terms, skipped = att.token_terms(iteration, batch)
    assert skipped == 0 and terms is not None
    assert len(terms["total"]) == int(batch.response_mask.sum())
    torch.testing.assert_close(sum(terms[s] for s in SOURCES), terms["total"], rtol=0, atol=1e-12)
    return terms


def moved(terms, *sources):
    """The named sources carry the mismatch; every other term stays at the fp32 floor (or exactly 0)."""
    for s in SOURCES:
        size = float(terms[s].abs().mean())
        if s in sources:
            assert size > 30 * NOISE, (s, size)
        else:
            assert size < NOISE, (s, size)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: a second OpenMP thread buys nothing and stalls when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def reference_kernels_only(monkeypatch):
    """The engines here run the torch reference path on the CPU, whatever another test module set up:
    `tests/test_fast_path_cpu.py` turns on Triton's interpreter at import, which would move the CPU
    engines onto the kernels (whose interpreter rounding is not the GPU's) and change the `kernels` term.
    The GPU test (`tests/gpu/test_attribution_gpu.py`) covers attribution on the real kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny Qwen3 with head_dim 32 (the smallest INT4 group)."""
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("attribution")
    make_checkpoint(path, head_dim=32)
    return str(path)


@pytest.fixture(scope="module")
def learner(checkpoint):
    return learner_for(checkpoint)


def test_no_source_on_leaves_only_fp32_numerics(checkpoint, learner):
    path = checkpoint
    engine, batch = rollout(path, EngineConfig())
    terms = attribute(engine, learner, batch)
    moved(terms)
    for s in ("staleness", "kv_cache", "weights", "truncation"):  # the same computation, reused
        assert bool((terms[s] == 0).all()), s
    torch.testing.assert_close(terms["total"], float64_total(path, batch), rtol=0, atol=NOISE)


def test_staleness_only_moves_the_staleness_term(checkpoint):
    path = checkpoint
    engine, batch = rollout(path, EngineConfig())
    learner = learner_for(path)
    version0 = {k: v.clone() for k, v in learner.state_dict().items()}
    with torch.no_grad():  # the learner moves on to "iteration 1"; the batch was sampled by version 0
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    terms = attribute(engine, learner, batch, iteration=1, keep={0: version0})
    moved(terms, "staleness")
    torch.testing.assert_close(terms["total"], float64_total(learner.model, batch), rtol=0, atol=NOISE)


def test_kv4_only_moves_the_kv_term(checkpoint, learner):
    path = checkpoint
    kv = KVConfig(format="kv4", group_size=32, n_sink=1, n_recent=2)
    engine, batch = rollout(path, EngineConfig(kv=kv))
    moved(attribute(engine, learner, batch), "kv_cache")


def test_nvfp4_is_scored_with_the_engines_calibrated_scale(checkpoint, learner):
    """NVFP4 calibrates one scale per layer on the engine's first prefill; the scoring cache calibrated
    afresh on each scored response, and the difference (~0.08 a token) showed up as `kernels`."""
    path = checkpoint
    engine, batch = rollout(path, EngineConfig(kv=KVConfig(format="nvfp4")))
    moved(attribute(engine, learner, batch), "kv_cache")


def test_fp8_weights_only_move_the_weights_term(checkpoint, learner):
    path = checkpoint
    engine, batch = rollout(path, EngineConfig(weight_format="fp8"))
    moved(attribute(engine, learner, batch), "weights")


def test_a_bf16_engine_with_fp8_weights_is_scored_with_its_own_codes(checkpoint, learner):
    """The engine quantized its start-up weights from the checkpoint cast to bf16, not from the learner's
    fp32 tensors; re-quantizing those would put a spurious weights difference into the kernels term."""
    kernels = {}
    for fmt in ("auto", "fp8"):
        engine, batch = rollout(checkpoint, EngineConfig(weight_format=fmt), dtype="bfloat16")
        att = MismatchAttribution(engine, learner, every=1, samples=4, sampling=Sampling(TEMPERATURE), horizon=1)
        terms, _ = att.token_terms(0, batch)
        kernels[fmt] = float(terms["kernels"].abs().mean())
        torch.testing.assert_close(sum(terms[s] for s in SOURCES), terms["total"], rtol=0, atol=1e-12)
    assert kernels["fp8"] < 3 * kernels["auto"], kernels  # bf16 decode-vs-prefill rounding only


def test_top_k_only_moves_the_truncation_term(checkpoint, learner):
    path = checkpoint
    engine, batch = rollout(path, EngineConfig(), top_k=5)
    moved(attribute(engine, learner, batch, top_k=5), "truncation")


def test_min_p_only_moves_the_truncation_term(checkpoint, learner):
    """The engine's min-p reaches its sampler (the engine's log-probs are of the cut distribution) and the
    attribution's scoring cuts alike (nothing is left in the kernels term)."""
    engine, batch = rollout(checkpoint, EngineConfig(), min_p=0.2)
    moved(attribute(engine, learner, batch, min_p=0.2), "truncation")


def test_decompose_by_hand():
    levels = [torch.tensor([v]) for v in (-1.0, -1.5, -1.25, -2.0, -2.0, -2.5, -3.0)]
    terms = decompose(levels)
    assert {s: float(terms[s]) for s in SOURCES} == {"learner": 0.5, "staleness": -0.25, "kv_cache": 0.75,
                                                     "weights": 0.0, "truncation": 0.5, "kernels": 0.5}
    assert float(terms["total"]) == 2.0


def test_summary_by_hand():
    d = torch.tensor([0.5, -0.5, 0.0, 1.0], dtype=torch.float64)
    out = summarize({"kernels": d})
    assert out["mismatch/kernels_abs_mean"] == pytest.approx(0.5)
    assert out["mismatch/kernels_mean"] == pytest.approx(0.25)
    k3 = (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5 + math.e - 2.0) / 4
    assert out["mismatch/kernels_k3"] == pytest.approx(k3)


class FakeEngine:
    version = 0
    plan = SimpleNamespace(weights=SimpleNamespace(value="auto"))


class FakeLearner:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"w": torch.tensor([float(self.step)])}


def test_weights_are_kept_only_for_coming_attributions_and_dropped_past_the_horizon():
    engine, learner = FakeEngine(), FakeLearner()
    att = MismatchAttribution(engine, learner, every=3, samples=1, sampling=Sampling(1.0), horizon=2)
    held = []
    for it in range(9):
        learner.step = it
        engine.version = it if it != 4 else 3  # iteration 4's refresh was skipped
        att.keep_weights(it)
        held.append(sorted(att.weights))
        assert all(float(w["w"]) == v for v, w in att.weights.items())  # each copy is its version's
    # due at 2, 5, 8; a copy of version v serves the due iterations in (v, v + 2]
    assert held == [[0], [0, 1], [0, 1], [1, 3], [3], [3], [6], [6, 7], [6, 7]]


def test_an_iteration_that_only_copies_weights_reports_the_copy_as_attribution_time(monkeypatch):
    """The copy (~32 GB of fp32 at 8B) ran inside observe() but was reported only on attribution iterations,
    so on the others the loop counted it as update time."""
    import kv4rl.telemetry.attribution as attribution

    engine, learner = FakeEngine(), FakeLearner()
    att = MismatchAttribution(engine, learner, every=3, samples=1, sampling=Sampling(1.0), horizon=2)
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(attribution.time, "perf_counter", lambda: next(clock))
    engine.version = 0
    assert att.observe(0, batch=None) == {"mismatch/time_s": 1.0}  # copied for iteration 2: one tick
    engine.version = 6  # the attribution at 8 may need version 6
    assert att.observe(6, batch=None) == {"mismatch/time_s": 1.0}
    engine.version = 9
    att.horizon = 0  # nothing coming needs version 9's weights: no copy, nothing to report
    assert att.observe(9, batch=None) == {}


def test_mixed_version_and_unkept_responses_are_skipped(checkpoint, learner):
    engine, batch = rollout(checkpoint, EngineConfig())
    batch.versions[0, batch.response_mask[0] > 0] = 0
    cols = (batch.response_mask[0] > 0).nonzero().flatten()
    batch.versions[0, cols[-1]] = 1  # row 0 continued under version 1
    batch.versions[1, batch.response_mask[1] > 0] = 2  # row 1 sampled by version 2, whose weights are gone
    att = MismatchAttribution(engine, learner, every=1, samples=4, sampling=Sampling(TEMPERATURE), horizon=1)
    out = att.attribute(0, batch)
    assert out["mismatch/skipped_responses"] == 2
    assert out["mismatch/attributed_tokens"] == int(batch.response_mask[2:].sum())
    assert out["mismatch/staleness_abs_mean"] == 0.0
    one = MismatchAttribution(engine, learner, every=1, samples=1, sampling=Sampling(TEMPERATURE), horizon=1)
    assert one.attribute(0, batch)["mismatch/attributed_tokens"] == 10  # one response of the two left


def test_training_loop_logs_attribution_that_matches_the_learners_mismatch(tmp_path):
    """Lag 1: iteration 0 sees no staleness, later ones a batch of the previous version (whose weights
    the loop kept). Every response is attributed, so the total equals the learner's own mismatch."""
    from kv4rl.config import load_config
    from kv4rl.data.char_tokenizer import build_char_tokenizer
    from kv4rl.loop import train
    from tests.conftest import make_checkpoint

    model_dir = tmp_path / "model"
    tokenizer = build_char_tokenizer(model_dir)
    make_checkpoint(model_dir, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id, head_dim=32,
                    pad_token_id=tokenizer.pad_token_id)
    cfg = load_config(overrides=[
        f"model.path={model_dir}", f"out_dir={tmp_path}", "name=att", "device=cpu", "trainer.iterations=3",
        "rollout.quota_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "staleness.lag=1",
        "trainer.lr=0.01", "trainer.warmup_iters=0", "advantage.baseline_noise=1",
        "telemetry.attribution_every=1",
        "telemetry.attribution_samples=4", "logging.tensorboard=false", "checkpoint.save_every=100"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/skipped_responses"] == 0
        assert r["mismatch/attributed_tokens"] == r["num_tokens"]
        assert r["mismatch/total_abs_mean"] == pytest.approx(r["mismatch_abs_mean"], abs=1e-6)
        assert r["mismatch/total_k3"] == pytest.approx(r["mismatch_k3"], abs=1e-6)
        assert sum(r[f"mismatch/{s}_mean"] for s in SOURCES) == pytest.approx(r["mismatch/total_mean"], abs=1e-12)
        for s in ("kv_cache", "weights", "truncation"):
            assert r[f"mismatch/{s}_abs_mean"] == 0.0
    assert rows[0]["mismatch/staleness_abs_mean"] == 0.0 and rows[0]["staleness_mean"] == 0
    for r in rows[1:]:
        assert r["staleness_mean"] == 1 and r["mismatch/staleness_abs_mean"] > 1e-3
        assert r["mismatch/staleness_abs_mean"] == pytest.approx(r["mismatch/total_abs_mean"], rel=1e-3)


def test_a_response_whose_token_the_reference_truncation_leaves_out_is_skipped(checkpoint, learner, monkeypatch):
    """The fast path and the reference may order near-tied logits at the top-k cut differently: the sampled
    token then has a truncated log-prob of -inf under the reference, and its terms (+inf, -inf) made the
    means infinite, logged as null."""
    path = checkpoint
    engine, batch = rollout(path, EngineConfig(), top_k=5)
    real = MismatchAttribution._engine_levels

    def one_token_cut(self, iteration, responses):
        real(self, iteration, responses)
        responses[1].levels["E4"] = responses[1].levels["E4"].clone()
        responses[1].levels["E4"][3] = float("-inf")

    monkeypatch.setattr(MismatchAttribution, "_engine_levels", one_token_cut)
    att = MismatchAttribution(engine, learner, every=1, samples=len(batch), sampling=Sampling(TEMPERATURE, 5),
                              horizon=1)
    out = att.attribute(0, batch)
    assert out["mismatch/skipped_responses"] == 1
    assert out["mismatch/attributed_tokens"] == int(batch.response_mask.sum()) - 10
    assert all(math.isfinite(v) for k, v in out.items() if k.endswith(("_abs_mean", "_mean", "_k3")))
