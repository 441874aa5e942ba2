"""Chunked prefill (`engine.max_num_batched_tokens` with `engine.chunked_prefill`): long prompts are
split over steps and the engine samples exactly what it samples with whole prompts.

The unchunked engine with a budget larger than any step is the reference. fp32 KV in float32 (the
reference path on CPU); KV4, whose later chunks read the earlier ones' INT4 pages and INT8 window,
in float64 (as tests/test_prefix_sharing.py: in float32 a batch shape change can flip an INT4 code),
with prefix sharing and with a pool small enough to preempt and recompute.
"""

import pytest
import torch

from kv4rl.engine.block_manager import BlockManager
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.sequence import SamplingParams, Sequence

PROMPT_LENS = (3, 29, 11, 17, 40, 6)
PARAMS = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
BUDGET = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("hd32")
    make_checkpoint(path, head_dim=32, max_position_embeddings=128)
    return path


def make_engine(path, fmt, dtype, chunked, budget, sharing=False, num_blocks=None, max_num_seqs=4):
    kv = KVConfig(format=fmt, block_size=4, group_size=32, n_sink=2, n_recent=5)
    cfg = EngineConfig(kv=kv, max_model_len=64, num_kv_blocks=num_blocks, prefix_sharing=sharing,
                       max_num_batched_tokens=budget, chunked_prefill=chunked)
    return Engine(path, cfg, max_num_seqs=max_num_seqs, device="cpu", dtype=dtype)


def prompts(repeat: int = 1):
    gen = torch.Generator().manual_seed(0)
    return [p for p in (torch.randint(0, 96, (n,), generator=gen).tolist() for n in PROMPT_LENS)
            for _ in range(repeat)]


def run(engine, prompt_list):
    """Step to completion; return each request's (tokens, log-probs) and every step's record."""
    seqs = [engine.add_request(p, PARAMS, sample_seed=7 + i) for i, p in enumerate(prompt_list)]
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(dict(engine.last_step))
    return [(s.output_ids, s.output_logprobs) for s in seqs], steps


def assert_same(got, want, atol):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("fmt,dtype,atol", [("fp32", torch.float32, 1e-5), ("kv4", torch.float64, 1e-9)])
def test_chunked_prefill_samples_what_whole_prompts_sample(ckpt, fmt, dtype, atol):
    want, _ = run(make_engine(ckpt, fmt, dtype, chunked=False, budget=4096), prompts())
    got, steps = run(make_engine(ckpt, fmt, dtype, chunked=True, budget=BUDGET), prompts())
    assert_same(got, want, atol)
    assert all(s["new_tokens"] <= BUDGET for s in steps)  # 4 running slots < budget: the cap holds
    # prompts longer than the budget were split: more prefill steps than prompts, none over the cap
    assert sum(s["prefill_tokens"] > 0 for s in steps) > len(PROMPT_LENS)
    unchunked, unchunked_steps = run(make_engine(ckpt, fmt, dtype, chunked=False, budget=BUDGET), prompts())
    assert_same(unchunked, want, atol)
    assert max(s["new_tokens"] for s in unchunked_steps) == max(PROMPT_LENS)  # alone, over the cap


def test_chunked_prefill_with_prefix_sharing_and_preemption(ckpt):
    """Groups of 3 requests per prompt: the first prefills in chunks, the others wait and fork from it;
    a 22-block pool preempts and recomputes (in chunks too). Same tokens as whole, private prompts."""
    want, _ = run(make_engine(ckpt, "kv4", torch.float64, chunked=False, budget=4096), prompts(3))
    engine = make_engine(ckpt, "kv4", torch.float64, chunked=True, budget=BUDGET, sharing=True, num_blocks=22)
    got, _ = run(engine, prompts(3))
    assert_same(got, want, 1e-9)
    assert engine.scheduler.num_forks > 0 and engine.num_preemptions > 0
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_decodes_are_never_starved_by_a_long_prompt():
    """Two decoding sequences keep one token each per step while a 50-token prompt is admitted in
    chunks of the rest of the budget; only its last chunk samples."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
                      chunked_prefill=True)
    running = [Sequence([1, 2, 3], SamplingParams(max_tokens=100)) for _ in range(2)]
    for seq in running:
        sched.add(seq)
    first = sched.schedule()
    assert [s.num_step_tokens for s in first] == [3, 3]
    for seq in first:  # what the engine does after a forward
        seq.num_cached_tokens += seq.num_step_tokens
        seq.append(5, 0.0, 0)
    long = Sequence(list(range(50)), SamplingParams(max_tokens=4))
    sched.add(long)
    chunks = []
    while not long.output_ids:
        batch = sched.schedule()
        assert running[0] in batch and running[1] in batch
        assert sum(s.num_step_tokens for s in batch) <= 8
        for seq in batch:
            sampled = seq.samples_this_step
            assert sampled == (seq is not long or sum(chunks) + seq.num_step_tokens == 50)
            if seq is long:
                chunks.append(seq.num_step_tokens)
            seq.num_cached_tokens += seq.num_step_tokens
            if sampled:
                seq.append(5, 0.0, 0)
    assert chunks == [6] * 8 + [2]



def test_each_step_record_counts_the_tokens_it_computed_and_holds(ckpt):
    """`last_step` (tallied in one pass before the forward) against a recount: each scheduled row's
    new and step tokens read through `Sequence`'s own properties as the runner receives them, and
    the tokens held by the sequences running or finished after the step (the pre-tally formula),
    through chunks, prefix forks and preemptions (a pool of 14 blocks of 4 tokens)."""
    engine = make_engine(ckpt, "fp32", torch.float32, chunked=True, budget=BUDGET, sharing=True, num_blocks=14)
    for i, p in enumerate(prompts(repeat=2)):
        engine.add_request(p, PARAMS, sample_seed=3 + i)
    forward, rows = engine.runner.forward, []

    def recording_forward(seqs, pending_ids=None):
        rows[:] = [(s.num_new_tokens, s.num_step_tokens) for s in seqs]
        return forward(seqs, pending_ids)

    engine.runner.forward = recording_forward
    chunks = forks = 0
    while engine.has_unfinished():
        forks_before = engine.scheduler.num_forks
        finished = engine.step()
        step = engine.last_step
        resident = sum(len(s) for s in engine.scheduler.running) + sum(len(s) for s in finished)
        assert step["batch_size"] == len(rows)
        assert step["new_tokens"] == sum(n for _, n in rows)
        assert step["prefill_tokens"] == sum(n for new, n in rows if new > 1)
        assert step["kv_bytes"] == resident * engine.bytes_per_token
        assert step["context_mean"] == pytest.approx(resident / len(rows))
        chunks += sum(n < new for new, n in rows)
        forks += engine.scheduler.num_forks - forks_before
    assert chunks > 0 and forks > 0 and engine.num_preemptions > 0
