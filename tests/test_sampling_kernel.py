"""The fused Gumbel-max kernel against the torch sampler: same noise bits, same tokens, torch.argmax's
tie and NaN rules, and an engine that samples the same completions with either sampler.

On CPU the kernel runs in Triton's interpreter, whose float64 log is numpy's: it may differ from torch's
CPU log in the last bit, so the uniforms are compared bit for bit and the Gumbel scores to 1e-15 (the
GPU test compares those exactly too).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kv4rl.kernels.sampling as ks  # noqa: E402
from kv4rl.config import ConfigError, load_config  # noqa: E402
from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402
from kv4rl.engine.sampler import sample, uniform_noise  # noqa: E402
from kv4rl.engine.sequence import SamplingParams  # noqa: E402
from tests.conftest import make_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launches of the fused path, so a test knows which path `sample` took."""
    calls = []
    real = ks.gumbel_argmax

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ks, "gumbel_argmax", spy)
    return calls


def _rows(gen, b, v, greedy_every=0):
    """Random logits at assorted sharpness, temperatures, seeds over the full 62-bit range (plus a
    few negative ones, which the int64 hash also accepts) and steps."""
    logits = torch.randn(b, v, generator=gen) * torch.rand(b, 1, generator=gen).mul(8).add(0.5)
    temp = torch.rand(b, generator=gen) + 0.3
    if greedy_every:
        temp[::greedy_every] = 0.0
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    seeds[:3] = torch.tensor([0, 2**62 - 1, -(2**63)])
    steps = torch.randint(0, 2**40, (b,), generator=gen)
    rows = (logits, temp, torch.zeros(b, dtype=torch.long), torch.ones(b), seeds, steps)
    return tuple(t.to(DEVICE) for t in rows)


def assert_logprobs_near(logprobs, scaled, tokens, greedy):
    """Within a few float32 roundings of the float64 log_softmax of the same float32 scaled logits at the
    token; greedy rows exactly 0."""
    ref = torch.log_softmax(scaled.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    err = (logprobs.double() - ref).abs()
    assert (err[~greedy] <= 2e-6 + 2**-20 * ref[~greedy].abs()).all(), float(err[~greedy].max())
    assert (logprobs[greedy] == 0).all()


@pytest.mark.parametrize("vocab", [97, 1000, 5003])
def test_fused_sample_equals_torch_sample(gen, kernel_calls, vocab):
    """The same tokens bit for bit; log-probs (the fused path normalises the token by the kernel's own
    log-sum-exp, the torch path takes log_softmax) each within float32 rounding of float64."""
    rows = _rows(gen, 96, vocab, greedy_every=7)
    tokens, logprobs = sample(*rows)
    fused_tokens, fused_logprobs = sample(*rows, fused=True)
    assert kernel_calls == [(96, vocab)]
    assert torch.equal(fused_tokens, tokens)
    logits, temp = rows[0], rows[1]
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, 1.0, temp)[:, None]
    assert_logprobs_near(logprobs, scaled, tokens, greedy)
    assert_logprobs_near(fused_logprobs, scaled, tokens, greedy)


@pytest.mark.parametrize("block,splits", [(256, 1), (256, 3), (1024, None)])
def test_log_norm_from_the_kernels_pass_equals_float64_logsumexp(gen, block, splits):
    """The row's log-sum-exp kept beside the Gumbel argmax, over any work layout, also for rows holding
    -inf entries and a row of -inf only (its log-sum-exp is -inf); the tokens are those without it."""
    logits, temp, _, _, seeds, steps = _rows(gen, 24, 5003)
    scores = logits / temp[:, None]
    scores[3, ::2] = float("-inf")
    scores[5] = float("-inf")
    tokens, log_norm = ks.gumbel_argmax(scores, seeds, steps, block=block, splits=splits, with_log_norm=True)
    assert torch.equal(tokens, ks.gumbel_argmax(scores, seeds, steps, block=block, splits=splits))
    ref = torch.logsumexp(scores.double(), -1)
    assert log_norm.dtype == torch.float64 and log_norm[5] == float("-inf")
    finite = torch.arange(24, device=scores.device) != 5
    assert ((log_norm - ref).abs()[finite] <= 1e-6 * (1 + ref.abs()[finite])).all()


@pytest.mark.parametrize("block,splits", [(256, 1), (256, 3), (1024, 2), (4096, None)])
def test_tokens_do_not_depend_on_the_work_layout(gen, block, splits):
    logits, temp, _, _, seeds, steps = _rows(gen, 24, 5003)
    logprobs_all = (logits / temp[:, None]).log_softmax(-1)
    want = (logprobs_all.double() - torch.log(-torch.log(uniform_noise(seeds, steps, 5003)))).argmax(-1)
    assert torch.equal(ks.gumbel_argmax(logprobs_all, seeds, steps, block=block, splits=splits), want)


def test_noise_bits_and_scores_match_the_torch_formula(gen):
    logits, temp, _, _, seeds, steps = _rows(gen, 16, 1000)
    logprobs_all = (logits / temp[:, None]).log_softmax(-1)
    tokens, u, scores = ks.gumbel_scores(logprobs_all, seeds, steps, block=256, splits=2)
    ref_u = uniform_noise(seeds, steps, 1000)
    ref_scores = logprobs_all.double() + -torch.log(-torch.log(ref_u))
    assert torch.equal(u, ref_u)  # the integer hash and the uniform's float64 formula, bit for bit
    if CUDA:
        assert torch.equal(scores, ref_scores)
    else:  # numpy's log against torch's: equal up to the last bit of each term (lp + g can cancel)
        gumbel = -torch.log(-torch.log(ref_u))
        bound = 1e-14 * (logprobs_all.double().abs() + gumbel.abs() + 1e-300)
        assert ((scores - ref_scores).abs() <= bound).all()
    assert torch.equal(tokens, ref_scores.argmax(-1))


@triton.jit
def _noise_kernel(bits_ptr, f32_ptr, f64_ptr, n, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    bits = tl.load(bits_ptr + offs, mask=live, other=0).to(tl.uint64, bitcast=True)
    tl.store(f32_ptr + offs, ks._gumbel_f32(bits), mask=live)
    tl.store(f64_ptr + offs, ks._gumbel_f64(bits, LIBDEVICE), mask=live)


def test_float32_noise_stays_well_inside_the_screens_margin():
    """The screen skips a block's float64 noise when its float32 scores trail the best by more than the
    margin, which is safe only while the float32 noise is within it: checked at the uniform's extremes
    (u near 0, near 1/2 where the formula switches, near 1 - 2^-8 where the series starts, near 1 with
    float64's rounding of bits + 0.5, and the top bits 2^53 - 1, taken as 2^53 - 2) and at random bits."""
    top = 2**53
    edges = [c + d for c in (0, 2**52, top - 2**45, top) for d in range(-2000, 2000) if 0 <= c + d < top]
    bits = torch.tensor(edges + torch.randint(0, top, (100_000,)).tolist(), dtype=torch.long, device=DEVICE)
    f32 = torch.empty(len(bits), device=DEVICE)
    f64 = torch.empty(len(bits), dtype=torch.float64, device=DEVICE)
    _noise_kernel[(triton.cdiv(len(bits), 1024),)](bits, f32, f64, len(bits), LIBDEVICE=CUDA, BLOCK=1024)
    assert bool(torch.isfinite(f64).all()) and bool(torch.isfinite(f32).all())  # bits 2^53 - 1 too
    top_bits = f64[bits == top - 1]
    assert len(top_bits) == 1 and float(top_bits) == pytest.approx(-math.log(-math.log(1.0 - 2.0**-52)), rel=1e-12)
    err = (f32.double() - f64).abs()
    assert float(err.max()) <= ks._SCREEN_ABS / 16, float(err.max())


@pytest.mark.parametrize("block,splits", [(256, 1), (256, 4), (1024, None)])
def test_near_ties_are_decided_in_float64(gen, block, splits):
    """Rows whose two best scores differ by less than float32 can tell apart (one float32 rounding of the
    logit): the screen must send both to float64, and the tokens are still the torch sampler's. Both
    candidates win in some rows, so deciding in float32 (or always taking either) fails."""
    b, v = 64, 5003
    logits, _, _, _, seeds, steps = _rows(gen, b, v)
    noise = (-torch.log(-torch.log(uniform_noise(seeds.cpu(), steps.cpu(), v)))).to(DEVICE)
    first = torch.randint(0, v, (b,), generator=gen).to(DEVICE)
    second = (first + torch.randint(1, v, (b,), generator=gen).to(DEVICE)) % v
    second[::4] = (first[::4] + 3) % v  # some pairs share a block
    rows = torch.arange(b, device=DEVICE)
    logits[rows, first] = 200.0  # far above every other score
    logits[rows, second] = (200.0 + noise[rows, first] - noise[rows, second]).float()
    ones = torch.ones(b, device=DEVICE)
    want, _ = sample(logits, ones, torch.zeros_like(seeds), ones, seeds, steps)
    assert set(want.tolist()) <= set(first.tolist()) | set(second.tolist())
    assert (want == first).any() and (want == second).any()
    assert torch.equal(ks.gumbel_argmax(logits, seeds, steps, block=block, splits=splits), want)


def test_ties_nan_and_all_minus_inf_rows_follow_torch_argmax():
    v = 700  # 11 blocks of 64 over up to 5 splits: ties inside a block, across blocks and splits
    x = torch.randn(9, v, dtype=torch.float64)
    x[0] = 1.5  # a constant row: index 0
    x[1, [650, 400, 130, 129, 64]] = 9.0  # the maximum five times, in different blocks and splits
    x[2, [699, 130, 66]] = 9.0  # 66 and 130 share a lane of the running best
    x[3] = float("-inf")  # every score -inf: index 0
    x[4] = float("-inf")
    x[4, 301] = -1e300
    x[5, [500, 230]] = float("nan")  # NaN wins over everything, the first one
    x[5, 10] = float("inf")
    x[6, 699] = float("nan")
    x[7, [3, 5]] = float("inf")
    x[8] = -0.0
    x[8, 345] = 0.0  # +0 == -0: still index 0
    x = x.to(DEVICE)
    want = x.argmax(-1)
    for splits in (1, 2, 5, None):
        assert torch.equal(ks.rows_argmax(x, block=64, splits=splits), want), splits
    assert torch.equal(ks.rows_argmax(x.float(), block=128, splits=3), x.float().argmax(-1))


def test_truncated_batches_keep_the_torch_path(gen, kernel_calls):
    logits, temp, top_k, top_p, seeds, steps = _rows(gen, 8, 97)
    for k, p in ((top_k.clone().fill_(5), top_p), (top_k, top_p.clone().fill_(0.9))):
        k[1:], p[1:] = 0, 1.0  # one truncated row is enough
        fused = sample(logits, temp, k, p, seeds, steps, fused=True)
        plain = sample(logits, temp, k, p, seeds, steps)
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    min_p = torch.zeros_like(top_p)
    min_p[0] = 0.3  # a min-p row truncates too
    fused = sample(logits, temp, top_k, top_p, seeds, steps, fused=True, min_p=min_p)
    plain = sample(logits, temp, top_k, top_p, seeds, steps, min_p=min_p)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert kernel_calls == []


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampler")
    make_checkpoint(path, vocab=301)
    return path


def test_engine_triton_sampler_generates_the_torch_samplers_tokens(ckpt, kernel_calls):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
    outs = {}
    for sampler in ("torch", "triton"):
        cfg = EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, sampler=sampler)
        engine = Engine(ckpt, cfg, max_num_seqs=4, device=DEVICE, dtype="float32")
        assert f"sampler {sampler}" in engine.summary
        outs[sampler] = engine.generate(prompts, SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True,
                                                                seed=11))
    assert len(kernel_calls) >= 10
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.skipif(CUDA, reason="the kernels can run on this machine")
def test_engine_triton_sampler_fails_at_start_without_kernels(ckpt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, sampler="triton")
    with pytest.raises(ValueError, match="engine.sampler=triton"):
        Engine(ckpt, cfg, max_num_seqs=2, device="cpu", dtype="float32")


def test_config_knows_the_sampler():
    assert load_config().engine.sampler == "auto"
    assert load_config(overrides=["engine.sampler=triton"]).engine.sampler == "triton"
    assert load_config(overrides=["engine.sampler=torch"]).engine.sampler == "torch"
    with pytest.raises(ConfigError, match=r"engine\.sampler"):
        load_config(overrides=["engine.sampler=fast"])


def test_engine_with_a_truncated_request_keeps_the_torch_path_every_step(ckpt, kernel_calls):
    """The runner tells the sampler from the requests' own parameters that a row truncates (no read
    of the device tensors): while a top-k request is in the batch the kernel never runs, and every
    request samples the torch sampler's tokens."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    plain = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True)
    truncating = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, top_k=4)
    outs = {}
    for sampler in ("torch", "triton"):
        engine = Engine(ckpt, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, sampler=sampler),
                        max_num_seqs=4, device=DEVICE, dtype="float32")
        seqs = [engine.add_request(p, truncating if i == 1 else plain, sample_seed=20 + i)
                for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        outs[sampler] = [(s.output_ids, s.output_logprobs) for s in seqs]
    assert kernel_calls == []  # the top-k request runs to the end alongside the others
    assert outs["torch"] == outs["triton"]
