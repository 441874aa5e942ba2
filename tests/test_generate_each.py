"""`Engine.generate_each`: completions handed over as they finish, with a bounded number of the call's
requests in the engine, must be the completions one `generate` of every request returns (each request
has its own seed), and the eval built on it must score what it scored when it held every response."""

from __future__ import annotations

import random

import pytest

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def _engine(path, slots=3):
    return Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32",
                  max_num_seqs=slots)


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("window,group", [(4, 2), (1, 1), (5, 3)])
def test_a_windowed_call_samples_what_generate_samples_and_never_holds_more(tiny_qwen3, window, group):
    path, _ = tiny_qwen3
    prompts = _prompts(11, seed=window)
    # EOS may stop a response early, so finishes come out of input order
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    whole = _engine(path).generate(prompts, params)

    engine = _engine(path)
    got, held, order = {}, [], []

    def keep(index, completion):
        assert index not in got  # each request handed over once
        got[index] = completion
        order.append(index)
        held.append(engine.num_unfinished())

    engine.generate_each(prompts, params, keep, max_in_engine=window, group=group,
                         progress=lambda done: held.append(engine.num_unfinished()))
    assert sorted(got) == list(range(len(prompts)))
    for index, ref in enumerate(whole):
        assert got[index].token_ids == ref.token_ids
        assert got[index].logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert got[index].finish_reason == ref.finish_reason
    assert max(held) <= window and max(held) > 0
    assert not engine.has_unfinished()
    if window == 1:
        assert order == list(range(len(prompts)))  # one at a time: in input order


def test_requests_enter_in_whole_groups_in_input_order(tiny_qwen3):
    """A problem's k samples are added together (they fork one prompt prefill), and never split over two
    refills of the window."""
    path, _ = tiny_qwen3
    engine = _engine(path, slots=4)
    added = []
    real_add = engine.add_request

    def recording_add(prompt_ids, params, tag=None, sample_seed=None, resume_from=None):
        added.append((tag, engine.num_unfinished()))
        return real_add(prompt_ids, params, tag, sample_seed, resume_from)

    engine.add_request = recording_add
    prompts = [p for p in _prompts(4, seed=1) for _ in range(3)]  # 4 problems x 3 samples
    tags = [i // 3 for i in range(len(prompts))]
    engine.generate_each(prompts, SamplingParams(max_tokens=4, ignore_eos=True, seed=1), lambda i, c: None,
                         tags=tags, max_in_engine=7, group=3)
    assert [tag for tag, _ in added] == tags
    for start in range(0, len(added), 3):  # a group's three requests one after another, room for all of them
        assert [n - added[start][1] for _, n in added[start:start + 3]] == [0, 1, 2]
        assert added[start][1] + 3 <= 7


def test_an_error_in_on_finish_leaves_no_request_of_the_call_and_the_parked_ones_waiting(tiny_qwen3):
    path, _ = tiny_qwen3
    engine = _engine(path)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    owned = [engine.add_request(p, params, sample_seed=7 + i) for i, p in enumerate(_prompts(2, seed=3))]
    engine.step()

    def failing(index, completion):
        raise RuntimeError("the caller's handler fails")

    with pytest.raises(RuntimeError, match="handler fails"):
        engine.generate_each(_prompts(6, seed=4), SamplingParams(max_tokens=3, ignore_eos=True, seed=1), failing,
                             max_in_engine=2)
    assert sorted(map(id, engine.unfinished())) == sorted(map(id, owned))  # only the parked ones, still there
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert sorted(map(id, finished)) == sorted(map(id, owned))
    assert [len(s.output_ids) for s in owned] == [6, 6]


@pytest.mark.parametrize("window,group", [(0, 1), (2, 3), (4, 0)])
def test_a_window_smaller_than_a_group_is_refused_before_anything_is_parked(tiny_qwen3, window, group):
    path, _ = tiny_qwen3
    engine = _engine(path)
    waiting = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="1 <= group <= max_in_engine"):
        engine.generate_each([[1, 2]], None, lambda i, c: None, max_in_engine=window, group=group)
    assert list(engine.scheduler.waiting) == [waiting]


@pytest.mark.parametrize("slots,k", [(2, 5), (2, 4), (3, 2), (4, 1)])
def test_the_eval_window_keeps_more_than_twice_the_slots_in_the_engine_until_the_last_problem_is_in(
        tiny_qwen3, slots, k):
    """A window of one problem (k >= 2 x slots) emptied the engine between problems: each problem's slowest
    samples ran alone. Reference: before every step, while problems are still to come, more requests are in
    the engine than twice its slots, so a slot that frees finds one queued."""
    from kv4rl.eval.runner import in_engine_window

    path, _ = tiny_qwen3
    engine = _engine(path, slots=slots)
    window = in_engine_window(slots, k)
    assert window % k == 0
    n = window + 3 * k  # problems still to come after the first window
    added, before_steps = [], []
    real_add, real_step = engine.add_request, engine.step
    engine.add_request = lambda *args, **kwargs: added.append(1) or real_add(*args, **kwargs)
    engine.step = lambda: before_steps.append((len(added), engine.num_unfinished())) or real_step()
    engine.generate_each([[1 + i // k, 2, 3] for i in range(n)], SamplingParams(max_tokens=6, seed=2),
                         lambda i, c: None, max_in_engine=window, group=k)
    assert len(added) == n
    assert max(unfinished for _, unfinished in before_steps) <= window
    waiting_to_come = [unfinished for count, unfinished in before_steps if count < n]
    assert waiting_to_come and min(waiting_to_come) > 2 * slots


def test_an_eval_in_a_small_window_scores_what_it_scored_holding_every_response(tmp_path):
    """`sample_problems` on the embedded task: a window of one problem against all of them at once."""
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource
    from kv4rl.eval.runner import sample_problems
    from kv4rl.models.tiny import tiny_model_dir
    from kv4rl.rewards import get_reward
    from transformers import AutoTokenizer

    model = tiny_model_dir()
    source = ProblemSource(None, None, 3)
    problems = source.eval_problems(6)
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(model), source.default_template, False)
    runs = []
    for window in (None, 4):
        engine = Engine(model, EngineConfig(max_model_len=64), device="cpu", max_num_seqs=8)
        with get_reward(source.default_reward) as reward:
            runs.append(sample_problems(engine, formatter, problems, [0, 2, 3, 5], reward, k=4, temperature=1.0,
                                        max_new_tokens=16, seed=9, max_in_engine=window))
    (all_at_once, stats_all), (windowed, stats_windowed) = runs
    assert windowed == all_at_once and stats_windowed == stats_all
    assert [r.index for r in windowed] == [0, 2, 3, 5]
    assert len({t for r in windowed for t in r.texts}) > 1  # sampled: a real comparison


def test_an_eval_on_a_training_engine_decodes_each_response_once_and_templates_each_problem_once():
    """A training run's engine has the tokenizer and decodes each completion's text; the eval takes that
    text (it decoded every response a second time: ~56 s of host a 30 x 1,024 x 8k eval) and builds each
    problem's prompt once, not k times. Scores and texts are those of an engine without a tokenizer."""
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource
    from kv4rl.eval.runner import sample_problems
    from kv4rl.models.tiny import tiny_model_dir
    from kv4rl.rewards import get_reward
    from transformers import AutoTokenizer

    model = tiny_model_dir()
    source = ProblemSource(None, None, 3)
    problems = source.eval_problems(6)
    tokenizer = AutoTokenizer.from_pretrained(model)
    formatter = PromptFormatter(tokenizer, source.default_template, False)
    decodes, templated = [0], [0]
    decode, ids = tokenizer.decode, formatter.ids

    def counted_decode(*args, **kwargs):
        decodes[0] += 1
        return decode(*args, **kwargs)

    def counted_ids(problem):
        templated[0] += 1
        return ids(problem)

    tokenizer.decode, formatter.ids = counted_decode, counted_ids
    runs = []
    for with_tokenizer in (False, True):
        decodes[0] = templated[0] = 0
        engine = Engine(model, EngineConfig(max_model_len=64), device="cpu", max_num_seqs=8,
                        tokenizer=tokenizer if with_tokenizer else None)
        with get_reward(source.default_reward) as reward:
            runs.append(sample_problems(engine, formatter, problems, [0, 2, 3], reward, k=4, temperature=1.0,
                                        max_new_tokens=16, seed=5))
        assert decodes[0] == 12 and templated[0] == 3
    assert runs[0] == runs[1]
    assert len({t for r in runs[1][0] for t in r.texts}) > 1


def test_a_prompt_that_cannot_fit_is_refused_before_any_request_runs(tiny_qwen3):
    """With a window the last prompts are added late: one too long for the context was refused after steps
    had run and completions had been handed over (an eval lost at its end). Reference: no step, no finish."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    finished, steps = [], []
    real_step = engine.step
    engine.step = lambda: steps.append(1) or real_step()
    prompts = _prompts(8, seed=2) + [[5] * 70]  # max_model_len is 64
    with pytest.raises(ValueError, match="prompt of 70 tokens does not fit max_model_len=64"):
        engine.generate_each(prompts, SamplingParams(max_tokens=4), lambda i, c: finished.append(i), max_in_engine=2)
    assert (finished, steps) == ([], [])
    assert not engine.has_unfinished()
