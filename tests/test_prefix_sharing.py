"""Prefix sharing: a GRPO group holds one copy of its prompt's KV and samples exactly what it would
with a private copy per request (the sharing-off engine is the reference).

The engines compute in float64: in float32, rounding differences between batch shapes (a 1-token
forward versus a whole prefill) occasionally flip an INT4 code and move a KV4 log-prob by ~1e-4.
"""

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.kv_formats import KV_FORMATS, get_kv_format
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams

G = 4
PROMPT_LENS = (4, 5, 7, 8)  # block size 4: prompts ending on and off block boundaries
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # crosses the 2+4 protection


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("hd32")
    return path, make_checkpoint(path, head_dim=32, max_position_embeddings=128)


def make_engine(path, fmt, sharing, num_blocks=None, max_num_seqs=16, together=True, step_tokens=16384):
    kv = KVConfig(format=fmt, block_size=4, group_size=32, n_sink=2, n_recent=4)
    cfg = EngineConfig(kv=kv, max_model_len=48, num_kv_blocks=num_blocks, prefix_sharing=sharing,
                       admit_siblings_together=together, max_num_batched_tokens=step_tokens)
    return Engine(path, cfg, max_num_seqs=max_num_seqs, device="cpu", dtype=torch.float64)


def group_prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def submit(engine, params=PARAMS, groups=None):
    """G requests per prompt, queued group after group, each with its own sampling seed."""
    prompts = group_prompts()
    return [engine.add_request(prompts[g], params, sample_seed=100 * g + j)
            for g in (groups if groups is not None else range(len(prompts))) for j in range(G)]


def run(engine, seqs, before_step=None):
    """Step to completion (`before_step(i)` runs before step i); return tokens and log-probs."""
    i = 0
    while engine.has_unfinished():
        if before_step is not None:
            before_step(i)
        engine.step()
        i += 1
    return [(s.output_ids, s.output_logprobs) for s in seqs]


def assert_same(got, want):
    assert len(got) == len(want)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)


def assert_all_free(engine):
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and engine.num_shared_blocks == 0
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))


# ---- the copies a fork needs, per format ---------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(KV_FORMATS))
def test_copy_slots_moves_exactly_the_stored_tokens(fmt):
    """After copying slots 1, 2 -> 9, 14, every slot reads back what the slot it came from held."""
    options = {"group_size": 32} if fmt in ("int4", "kv4") else {}
    options |= {"n_sink": 2, "n_recent": 2} if fmt == "kv4" else {}
    f = get_kv_format(fmt, **options)
    cache = f.allocate(16, 2, 32, "cpu", num_seq_slots=4)  # kv4: 4 x 4 protected rows, as many as slots
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(16)
    for prefix in ("k", "v"):
        f.store(cache, prefix, slots, torch.randn(16, 2, 32, generator=gen))
    for key in f.per_sequence_keys:
        cache[key].copy_(torch.randint(-100, 100, cache[key].shape, generator=gen))
    before = {key: t.clone() for key, t in cache.items()}
    f.copy_slots(cache, torch.tensor([1, 2]), torch.tensor([9, 14]))
    source = torch.arange(16)
    source[9], source[14] = 1, 2
    for prefix in ("k", "v"):
        assert torch.equal(f.load(cache, prefix, slots, torch.float32),
                           f.load(before, prefix, source, torch.float32))
    for key in f.per_sequence_keys:  # per-sequence rows are not slots, even when as many
        assert torch.equal(cache[key], before[key])


def test_kv4_copy_seq_state_copies_the_parents_protected_rows():
    f = get_kv_format("kv4", group_size=32, n_sink=2, n_recent=3)
    cache = f.allocate(8, 2, 32, "cpu", num_seq_slots=4)
    for key in f.per_sequence_keys:
        cache[key].copy_(torch.arange(cache[key].numel()).reshape(cache[key].shape))
    before = {key: t.clone() for key, t in cache.items()}
    f.copy_seq_state(cache, torch.tensor([1, 0]), torch.tensor([3, 2]))
    for key in f.per_sequence_keys:
        want = before[key].clone()
        want[15:20], want[10:15] = before[key][5:10], before[key][0:5]  # budget 5 rows per sequence
        assert torch.equal(cache[key], want)
    assert all(torch.equal(cache[k], before[k]) for k in cache if k not in f.per_sequence_keys)


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(ckpt):
    """Outputs of every request with sharing off, per KV format."""
    path, _ = ckpt
    out = {}
    for fmt in ("fp32", "kv4"):
        engine = make_engine(path, fmt, sharing=False)
        out[fmt] = run(engine, submit(engine))
        assert engine.num_prefill_tokens_saved == 0
    return out


@pytest.mark.parametrize("fmt", ["fp32", "kv4"])
def test_groups_sample_the_same_with_and_without_sharing(ckpt, reference, fmt):
    path, hf = ckpt
    engine = make_engine(path, fmt, sharing=True)
    seqs = submit(engine)
    got = run(engine, seqs)
    assert_same(got, reference[fmt])
    assert engine.scheduler.num_forks == (G - 1) * len(PROMPT_LENS)
    assert engine.num_prefill_tokens_saved == (G - 1) * sum(n - 1 for n in PROMPT_LENS)
    assert_all_free(engine)
    if fmt == "fp32":  # and both agree with a full recomputation by transformers
        for s in seqs:
            with torch.no_grad():
                logits = hf(torch.tensor([s.token_ids])).logits[0, len(s.prompt_ids) - 1 : -1].double()
            want = logits.log_softmax(-1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.output_logprobs, dtype=torch.float64), want, atol=1e-4,
                                       rtol=0)


def test_groups_admitted_as_slots_free_sample_the_same_and_fork_more_when_admitted_whole(ckpt, fmt="kv4"):
    """32 slots, 30 of them taken by requests of other prompts that end at staggered lengths, then four
    groups of four: slots free a few at a time, as in partial rollout. Whether groups enter a slot at a
    time or whole (a run counts up to 32 / 8 = 4), every response equals the sharing-off engine's with
    all requests at once; whole, every follower forks, a slot at a time some prefill their prompt again."""
    path, _ = ckpt
    gen = torch.Generator().manual_seed(1)
    fillers = [torch.randint(0, 96, (3,), generator=gen).tolist() for _ in range(30)]
    prompts = group_prompts()
    requests = [(p, 1 + i % 12, 1000 + i) for i, p in enumerate(fillers)]
    requests += [(prompts[g], 12, 100 * g + j) for g in range(len(prompts)) for j in range(G)]

    def outputs(engine):
        seqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True), sample_seed=seed)
                for p, n, seed in requests]
        return run(engine, seqs)

    want = outputs(make_engine(path, fmt, sharing=False, max_num_seqs=len(requests)))
    saved = {}
    for together in (False, True):
        engine = make_engine(path, fmt, sharing=True, max_num_seqs=32, together=together)
        assert_same(outputs(engine), want)
        saved[together] = engine.num_prefill_tokens_saved
        assert_all_free(engine)
    assert saved[True] == (G - 1) * sum(n - 1 for n in PROMPT_LENS)  # every follower forked
    assert saved[False] < saved[True]


def test_peak_blocks_drop_by_the_shared_prompt_blocks(ckpt):
    """One group of 4, prompt 8, block size 4, 4 tokens each; counted by hand.

    Off: each request grows to 11 tokens = 3 blocks, all at once: peak 4 * 3 = 12.
    On: the leader prefills alone; a step later the 3 followers share its block 0 (positions 0-3) and
    each take a private block 1 (positions 4-7, 4-6 copied). At the followers' second step the leader
    holds 3 blocks and each follower 1 shared + 2 private: peak 3 + 3 * 2 = 9 = 12 - (G - 1) * 1.
    """
    path, _ = ckpt
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    peaks, traces = {}, {}
    for sharing in (False, True):
        engine = make_engine(path, "fp32", sharing)
        submit(engine, params, groups=[3])
        trace = []
        while engine.has_unfinished():
            engine.step()
            trace.append(engine.last_step)
        peaks[sharing], traces[sharing] = max(t["kv_blocks"] for t in trace), trace
        assert_all_free(engine)
    assert (peaks[False], peaks[True]) == (12, 9)
    fork_step = traces[True][1]
    assert fork_step["shared_blocks"] == 1 and fork_step["prefill_tokens_saved"] == 3 * 7
    assert fork_step["new_tokens"] == 1 + 3  # the leader's decode and each follower's last prompt token


@pytest.mark.parametrize("fmt", ["fp32", "kv4"])
def test_small_pool_preempts_and_still_matches(ckpt, reference, fmt, monkeypatch):
    """The victim is the most recently admitted sequence, so followers holding shared blocks are
    preempted (dropping one reference) while their leader runs on; leaders are covered by the
    abort and recompute_all tests."""
    path, _ = ckpt
    engine = make_engine(path, fmt, sharing=True, num_blocks=20)
    sched, preempt = engine.scheduler, engine.scheduler._preempt
    held_shared = []  # per preemption: did the victim hold a block it shares with others?

    def record_and_preempt(seq):
        held_shared.append(any(sched.blocks.ref_count(b) > 1 for b in seq.block_table))
        preempt(seq)

    monkeypatch.setattr(sched, "_preempt", record_and_preempt)
    seqs = submit(engine)
    assert_same(run(engine, seqs), reference[fmt])
    assert sched.num_forks > 0 and any(held_shared)
    assert_all_free(engine)


@pytest.mark.parametrize("fmt", ["fp32", "kv4"])
@pytest.mark.parametrize("abort_before", [1, 2, 5])
def test_aborting_leaders_keeps_followers_right(ckpt, reference, fmt, abort_before):
    """Before step 1 the followers wait for their leader's prefill; from step 2 they share its blocks."""
    path, _ = ckpt
    engine = make_engine(path, fmt, sharing=True)
    seqs = submit(engine)
    leaders = seqs[::G]

    def abort(i):
        if i == abort_before:
            if i >= 2:
                assert engine.num_shared_blocks > 0
            for s in leaders:
                engine.abort(s)

    got = run(engine, seqs, before_step=abort)
    kept = [i for i in range(len(seqs)) if i % G]
    assert_same([got[i] for i in kept], [reference[fmt][i] for i in kept])
    assert all(s.finish_reason == "abort" for s in leaders)
    assert_all_free(engine)


@pytest.mark.parametrize("fmt", ["fp32", "kv4"])
def test_recompute_all_keeps_results(ckpt, reference, fmt):
    path, _ = ckpt
    engine = make_engine(path, fmt, sharing=True)
    seqs = submit(engine)
    got = run(engine, seqs, before_step=lambda i: engine.recompute_all() if i in (1, 2, 6) else None)
    assert_same(got, reference[fmt])
    # before step 1 only the 4 leaders run (followers wait for them); recomputed leaders hold more than
    # their prompt, so before step 2 the first followers have prefilled instead: 8; before step 6 all 16
    assert engine.num_preemptions == 4 + 8 + 16
    assert_all_free(engine)


def test_requests_after_a_weight_update_compute_their_prompt_under_the_new_weights(ckpt, tmp_path):
    """Followers wait one step for the leader's prefill; if new weights arrive in between, they prefill
    under the new weights like requests submitted after the update (never fork stale prompt KV)."""
    from tests.conftest import make_checkpoint

    path, _ = ckpt
    new = make_checkpoint(tmp_path, seed=1, head_dim=32, max_position_embeddings=128).state_dict()
    engine = make_engine(path, "fp32", sharing=True)
    seqs = submit(engine, groups=[0])
    engine.step()
    engine.load_weights(new, version=1)
    got = run(engine, seqs)
    ref = make_engine(path, "fp32", sharing=False)
    prompt = group_prompts()[0]
    ref_seqs = [ref.add_request(prompt, PARAMS, sample_seed=0)]
    ref.step()
    ref.load_weights(new, version=1)
    ref_seqs += [ref.add_request(prompt, PARAMS, sample_seed=j) for j in range(1, G)]
    assert_same(got, run(ref, ref_seqs))
    assert [s.output_versions[0] for s in seqs] == [0, 1, 1, 1]


def test_a_prompt_prefilling_in_chunks_across_a_weight_update_starts_over_under_the_new_weights(ckpt, tmp_path):
    """The leader's first chunk ran under the old weights; kept (keep_kv), its last ran under the new, a
    follower forked that mixed prompt KV, and the leader's response carried the new version over an older
    prompt. Now the update restarts an unfinished prompt: every response, the leader's too, is sampled
    over prompt KV of the new weights alone. Reference: the sharing-off engine, whose leader restarts the
    same way, the followers submitted after the update."""
    from tests.conftest import make_checkpoint

    path, _ = ckpt
    new = make_checkpoint(tmp_path, seed=1, head_dim=32, max_position_embeddings=128).state_dict()
    engine = make_engine(path, "fp32", sharing=True, step_tokens=3)  # the 8-token prompt in chunks of 3
    seqs = submit(engine, groups=[3])
    engine.step()
    assert seqs[0].num_cached_tokens == 3
    engine.load_weights(new, version=1)
    assert seqs[0].num_cached_tokens == 0  # back in the queue, its old chunk dropped
    got = run(engine, seqs)
    assert engine.scheduler.num_forks >= 1 and engine.scheduler.num_preemptions == 0
    ref = make_engine(path, "fp32", sharing=False, step_tokens=3)
    prompt = group_prompts()[3]
    ref_seqs = [ref.add_request(prompt, PARAMS, sample_seed=300)]
    ref.step()
    ref.load_weights(new, version=1)
    ref_seqs += [ref.add_request(prompt, PARAMS, sample_seed=300 + j) for j in range(1, G)]
    assert_same(got, run(ref, ref_seqs))
    fresh = make_engine(path, "fp32", sharing=False)  # the leader alone, the new weights from the start
    fresh.load_weights(new, version=1)
    alone = fresh.add_request(prompt, PARAMS, sample_seed=300)
    assert_same(got[:1], run(fresh, [alone]))
    assert [s.output_versions[0] for s in seqs] == [1, 1, 1, 1]


def test_score_tokens_shares_repeated_prompts(ckpt):
    path, _ = ckpt
    prompt = group_prompts()[2]
    forced = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    scores = {}
    for sharing in (False, True):
        engine = make_engine(path, "kv4", sharing)
        scores[sharing] = engine.score_tokens([prompt] * 3, forced)
        assert engine.num_prefill_tokens_saved == (2 * (len(prompt) - 1) if sharing else 0)
    for a, b in zip(scores[False], scores[True]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
