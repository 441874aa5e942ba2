"""Sampler: reported log-probs are those of the distribution actually sampled; noise is counter-based."""

import math

import pytest
import torch

from kv4rl.engine.sampler import sample, uniform_noise


def call(logits, temp=1.0, k=0, p=1.0, seeds=None, steps=None):
    b = logits.shape[0]
    return sample(
        logits,
        torch.full((b,), float(temp)),
        torch.full((b,), k, dtype=torch.long),
        torch.full((b,), float(p)),
        torch.arange(b, dtype=torch.long) * 7919 + 1 if seeds is None else seeds,
        torch.zeros(b, dtype=torch.long) if steps is None else steps,
    )


def test_logprobs_equal_log_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.randn(64, 11) * 3
    temp = torch.rand(64) * 1.5 + 0.3
    seeds = torch.arange(64, dtype=torch.long)
    tokens, lp = sample(logits, temp, torch.zeros(64, dtype=torch.long), torch.ones(64), seeds, seeds)
    ref = torch.log_softmax(logits.double() / temp.double()[:, None], -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    tokens, _ = call(probs.log()[None].repeat(n, 1))
    freq = torch.bincount(tokens, minlength=4).double() / n
    bound = 5 * torch.sqrt(probs.double() * (1 - probs.double()) / n)
    assert torch.all((freq - probs.double()).abs() < bound), freq


def test_noise_is_uniform_and_depends_only_on_seed_and_step():
    u = uniform_noise(torch.arange(2000, dtype=torch.long), torch.zeros(2000, dtype=torch.long), 50)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # same (seed, step) -> same noise regardless of row position; a different step -> different noise
    seeds = torch.tensor([5, 9, 5], dtype=torch.long)
    steps = torch.tensor([3, 3, 4], dtype=torch.long)
    v = uniform_noise(seeds, steps, 20)
    w = uniform_noise(seeds.flip(0), steps.flip(0), 20)
    assert torch.equal(v[0], w[2]) and torch.equal(v[1], w[1])
    assert torch.equal(uniform_noise(seeds[:1], steps[:1], 20)[0], v[0])
    assert not torch.equal(v[0], v[2])


def test_greedy_rows_take_argmax_and_report_zero():
    logits = torch.randn(5, 7)
    tokens, lp = call(logits, temp=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.all(lp == 0)


def test_top_k_samples_only_top_k_and_renormalises():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(2000, 1)
    tokens, lp = call(logits, k=2)
    assert set(tokens.tolist()) == {3, 4}
    p4 = math.exp(4) / (math.exp(3) + math.exp(4))
    want = torch.where(tokens == 4, torch.tensor(math.log(p4)), torch.tensor(math.log(1 - p4)))
    assert torch.allclose(lp, want.float(), atol=1e-5)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    tokens, lp = call(probs.log()[None].repeat(n, 1), p=0.7)
    # 0.5 < 0.7 so token 1 is needed; 0.5 + 0.3 >= 0.7 so tokens 2, 3 are dropped
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(lp[tokens == 0], torch.tensor(math.log(0.5 / 0.8)), atol=1e-5)
    frac0 = (tokens == 0).float().mean().item()
    assert abs(frac0 - 0.625) < 5 * math.sqrt(0.625 * 0.375 / n)


def test_a_top_p_of_one_keeps_its_whole_tail_beside_a_truncating_row():
    """float32's cumsum reaches 1.0 before a peaked step's long tail ends: a p = 1 row kept 16,524 of
    49,152 tokens when another row of the step had p = 0.5 (alone it kept all)."""
    from kv4rl.engine.sampler import truncate_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 49152, generator=gen) * 3
    logits[:, 0] += 25
    no_k = torch.zeros(2, dtype=torch.long)
    out = truncate_logits(logits, no_k, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[1], truncate_logits(logits[1:], no_k[1:], torch.tensor([0.5]))[0])
    assert torch.isfinite(out[1]).sum() == 1  # token 0 alone holds more than half the mass


def test_min_p_keeps_the_tokens_as_likely_as_its_share_of_the_likeliest_and_renormalises():
    """min-p against float64 by enumeration: a token stays where p_i >= min_p * max_j p_j; the reported log-prob is
    log(p_i / sum of the kept p); rows of other min_p (0: off) beside each other."""
    gen = torch.Generator().manual_seed(5)
    b, v = 48, 13
    logits = torch.randn(b, v, generator=gen) * 2.5
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0] * (b // 4))
    seeds = torch.arange(b, dtype=torch.long) * 17 + 3
    zeros = torch.zeros(b, dtype=torch.long)
    probs = torch.softmax(logits.double(), -1)
    kept = probs >= min_p.double()[:, None] * probs.max(-1, keepdim=True).values
    for step in range(20):
        steps = zeros + step
        tokens, lp = sample(logits, torch.ones(b), zeros, torch.ones(b), seeds, steps, min_p=min_p)
        assert kept.gather(1, tokens[:, None]).all()
        want = (probs.gather(1, tokens[:, None]).squeeze(1) / (probs * kept).sum(-1)).log()
        assert torch.allclose(lp.double(), want, atol=1e-5)
    assert kept[0].all() and kept[3].sum() == 1  # min_p 0 keeps every token, 1 only the likeliest
    off, _ = sample(logits, torch.ones(b), zeros, torch.ones(b), seeds, zeros, min_p=torch.zeros(b))
    assert torch.equal(off, sample(logits, torch.ones(b), zeros, torch.ones(b), seeds, zeros)[0])


def _vllm_order_kept(probs: list[float], min_p: float, top_k: int, top_p: float) -> set[int]:
    """vLLM's truncations by hand in float64: min-p over the whole row, then top-k, then top-p over what is left,
    renormalised (the smallest prefix of the kept tokens, likeliest first, whose mass reaches top_p)."""
    kept = [i for i, p in enumerate(probs) if p >= min_p * max(probs)]
    kept.sort(key=lambda i: -probs[i])
    kept = kept[:top_k] if top_k > 0 else kept
    total, mass, out = sum(probs[i] for i in kept), 0.0, set()
    for i in kept:
        if mass >= top_p * total and top_p < 1:
            break
        out.add(i)
        mass += probs[i]
    return out


def test_min_p_comes_before_top_k_and_top_p_as_in_vllm():
    """By hand: [.5, .3, .1, .1] at min_p 0.25 keeps {0, 1} (renormalised .625 / .375); top_p 0.6 then keeps {0}
    (transformers' order, top-p first, keeps {0, 1}). Then random rows against the float64 reference."""
    from kv4rl.engine.sampler import truncate_logits

    def kept(probs, min_p, top_k, top_p):
        n = len(probs)
        out = truncate_logits(torch.tensor(probs).log()[None], torch.tensor([top_k]), torch.tensor([top_p]),
                              torch.tensor([min_p]))
        return {i for i in range(n) if torch.isfinite(out[0, i])}

    assert kept([0.5, 0.3, 0.1, 0.1], 0.25, 0, 0.6) == {0} == _vllm_order_kept([0.5, 0.3, 0.1, 0.1], 0.25, 0, 0.6)
    assert kept([0.5, 0.3, 0.1, 0.1], 0.0, 0, 0.6) == {0, 1}
    gen = torch.Generator().manual_seed(9)
    for row in range(200):
        logits = torch.randn(12, generator=gen, dtype=torch.float64) * 2
        probs = torch.softmax(logits, -1).tolist()
        min_p, top_k, top_p = [0.0, 0.02, 0.1, 0.4][row % 4], [0, 3, 6][row % 3], [1.0, 0.5, 0.8, 0.95][row // 50]
        assert kept(probs, min_p, top_k, top_p) == _vllm_order_kept(probs, min_p, top_k, top_p), (row, probs)


def test_min_p_keeps_what_transformers_min_p_warper_keeps():
    transformers = pytest.importorskip("transformers")
    from kv4rl.engine.sampler import truncate_logits

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 200, generator=gen) * 3
    for min_p in (0.01, 0.1, 0.5, 0.9):
        ours = truncate_logits(logits, torch.zeros(64, dtype=torch.long), torch.ones(64), torch.full((64,), min_p))
        theirs = transformers.MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), min_p


def test_min_p_samples_follow_the_renormalised_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # min_p 0.25 keeps p >= 0.125: the first three
    n = 20000
    logits = probs.log()[None].repeat(n, 1)
    tokens, _ = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                       torch.arange(n, dtype=torch.long) * 7919 + 1, torch.zeros(n, dtype=torch.long),
                       min_p=torch.full((n,), 0.25))
    freq = torch.bincount(tokens, minlength=4).double() / n
    want = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95
    assert freq[3] == 0
    assert torch.all((freq - want).abs() < 5 * torch.sqrt(want * (1 - want) / n) + 1e-12), freq


def test_host_known_flags_change_no_token_or_log_prob():
    """`greedy_rows=False` / `unit_temperature=True` (what the runner knows from the parameters) skip the
    unused argmax and the division by 1: the same tokens and log-probs, bit for bit, as the full path,
    on the torch sampler and (where it runs) the fused one; and with greedy rows or other temperatures
    in the batch, flags that say so change nothing either."""
    torch.manual_seed(3)
    b, v = 12, 97
    logits = torch.randn(b, v) * 4
    seeds = torch.arange(b, dtype=torch.long) * 31 + 5
    steps = torch.arange(b, dtype=torch.long) % 4
    off_k, off_p = torch.zeros(b, dtype=torch.long), torch.ones(b)
    batches = {  # temperatures, greedy rows?, unit temperature?
        "unit": (torch.ones(b), False, True),
        "unit and greedy": (torch.where(torch.arange(b) % 3 == 0, 0.0, 1.0), True, True),
        "other temperatures": (torch.rand(b) + 0.5, False, False),
    }
    for fused in (False, True):
        for label, (temp, greedy, unit) in batches.items():
            full = sample(logits, temp, off_k, off_p, seeds, steps, fused=fused)
            told = sample(logits, temp, off_k, off_p, seeds, steps, fused=fused, truncated=False,
                          greedy_rows=greedy, unit_temperature=unit)
            assert torch.equal(full[0], told[0]) and torch.equal(full[1], told[1]), (label, fused)


def test_runner_passes_flags_that_match_its_rows():
    """The runner derives `greedy_rows` / `unit_temperature` from the rows' parameters: on batches of
    only temperature 1, with greedy rows, and with other temperatures (one differing row is enough to
    need the division), its tokens and log-probs equal `sample` left to work everything out."""
    from types import SimpleNamespace

    from kv4rl.engine.runner import ModelRunner
    from kv4rl.engine.sequence import SamplingParams, Sequence

    torch.manual_seed(5)
    runner = SimpleNamespace(device=torch.device("cpu"), sampler="torch")
    for temps in ([1.0] * 6, [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.7, 1.0, 1.0, 1.0], [0.0] * 6):
        seqs = [Sequence([1, 2, 3], SamplingParams(temperature=t), sample_seed=17 * i + 1) for i, t in enumerate(temps)]
        logits = torch.randn(len(seqs), 50) * 3
        got = ModelRunner.sample(runner, seqs, logits)
        want = sample(logits, torch.tensor(temps), torch.zeros(6, dtype=torch.long), torch.ones(6),
                      torch.tensor([s.sample_seed for s in seqs]), torch.zeros(6, dtype=torch.long))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), temps


def test_the_top_hash_value_is_no_uniform_of_one_and_a_cut_token_is_never_drawn():
    """Seed -1824253640832042361 at step 5 hashes vocabulary index 3 to the top 53-bit value, whose
    (bits + 0.5) * 2^-53 rounds to 1: noise +inf, NaN on the masked logit, which argmax took (the seed was
    found by inverting splitmix64)."""
    seed, step = torch.tensor([-1824253640832042361]), torch.tensor([5])
    u = uniform_noise(seed, step, 5)
    assert float(u[0, 3]) == 1.0 - 2.0**-52 and float(u.max()) < 1.0
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0, -3.0]])
    token, lp = sample(logits, torch.ones(1), torch.tensor([2]), torch.ones(1), seed, step)
    assert int(token) in (0, 1) and math.isfinite(float(lp))
    want = torch.log_softmax(logits[0, :2].double(), -1)[int(token)]
    assert abs(float(lp) - float(want)) < 1e-6


def test_request_seeds_of_nearby_run_seeds_never_share_a_stream():
    """A linear seed * 1_000_003 + index gave seed 1's request 0 the stream of seed 0's request 1_000_003."""
    from kv4rl.engine.sampler import request_seed, stream_seed

    indices = list(range(2000)) + [k * 1_000_003 + d for k in range(1, 4) for d in range(-3, 4)]
    seeds = {request_seed(s, i) for s in range(8) for i in indices}
    assert len(seeds) == 8 * len(indices)
    assert all(0 <= x < 2**62 for x in seeds)
    # the evaluation stream of run seed s at iteration it is shared by no other (seed, iteration), and by
    # no request seed of any run
    evals = {stream_seed(s, 0, it) for s in range(8) for it in range(500)}
    assert len(evals) == 8 * 500 and not evals & seeds


def test_non_integer_counts_and_seeds_are_refused():
    import pytest

    from kv4rl.engine.sequence import SamplingParams

    for bad in ({"top_k": 2.5}, {"top_k": float("nan")}, {"max_tokens": 2.5}, {"max_tokens": float("inf")},
                {"seed": 1.5}, {"seed": "x"}, {"max_tokens": True}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            SamplingParams(**bad).validate()
    SamplingParams(top_k=3, max_tokens=4, seed=-2).validate()
