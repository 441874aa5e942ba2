"""The engine as a library refuses what it cannot run before any work, and never leaves the engine in a state
that samples wrongly: token ids outside the vocabulary, a failed scoring call's requests, a weight set that
stopped part-way, stop ids given as one int. Stop ids stop besides the model's EOS ids, as in vLLM."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def _engine(path):
    return Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32")


@pytest.mark.parametrize("prompt,named", [([1, 97, 3], "token id 97"), ([-1, 2], "token id -1"),
                                          ([1, 2.0], "integer token ids"), ([1, "a"], "integer token ids")])
def test_prompt_ids_outside_the_vocabulary_are_refused_by_name_before_any_work(tiny_qwen3, prompt, named):
    """Vocabulary 97: id 97 failed ~20 frames inside the embedding (a device-side assert on CUDA), a float id
    was silently taken."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    with pytest.raises(ValueError, match=named):
        engine.generate([[4, 5], prompt], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=named):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    assert engine.checked_ids((5, torch.tensor(7).item()), "prompt") == [5, 7]


@pytest.mark.parametrize("prompts,forced,named", [
    ([[1, 2, 3], [4, 5]], [[10, 20], [500]], "token id 500"),
    ([[1, 2, 3], []], [[10, 20], [7]], "every prompt needs at least one token"),
])
def test_a_refused_scoring_call_leaves_no_request_behind(tiny_qwen3, prompts, forced, named):
    """Its requests were added one at a time and an error part-way left them in the engine: every later
    score_tokens said 'needs an idle engine', and the next step handed them back with a greedy token added."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    with pytest.raises(ValueError, match=named):
        engine.score_tokens(prompts, forced)
    assert not engine.has_unfinished()
    reference = _engine(path).score_tokens([[1, 2, 3]], [[10, 20]])[0]
    assert torch.equal(engine.score_tokens([[1, 2, 3]], [[10, 20]])[0], reference)
    out = engine.generate([[9, 9]], SamplingParams(max_tokens=2, seed=0))
    assert len(out) == 1 and engine.step() == []  # nothing stray; an idle engine's step returns nothing


def test_a_weight_set_that_stops_part_way_is_refused_until_a_whole_one_loads(tiny_qwen3):
    """The tensors before the missing ones were copied and the old version kept: the engine sampled on part old,
    part new weights under the old tag."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    engine.load_weights(_hf_weights(path), version=4)
    with pytest.raises(ValueError):
        engine.load_weights(iter([("lm_head.weight", torch.zeros(97, 64))]), version=5)
    assert engine.version == 4
    with pytest.raises(RuntimeError, match="part old, part new"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="part old, part new"):
        engine.score_tokens([[1, 2]], [[3]])
    engine.load_weights(_hf_weights(path), version=6)
    out = engine.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.versions == [6, 6] and out.token_ids == _engine(path).generate(
        [[1, 2]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_a_refused_state_dict_changes_nothing_and_the_engine_samples_on(tiny_qwen3):
    """A state dict is checked whole before any copy: one with a misshapen or missing tensor changed nothing,
    yet the engine refused to step ('part old, part new')."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    before = engine.generate([[1, 2, 3]], greedy)[0].token_ids
    bad = _hf_weights(path)
    bad["lm_head.weight"] = torch.zeros(3)
    missing = _hf_weights(path)
    del missing["model.norm.weight"]
    for weights in (bad, missing):
        with pytest.raises(ValueError):
            engine.load_weights(weights, version=1)
    assert engine.generate([[1, 2, 3]], greedy)[0].token_ids == before and engine.version == 0
    with pytest.raises(ValueError):  # a stream refused at its first tensor copied nothing either
        engine.load_weights(iter([("lm_head.weight", torch.zeros(3))]), version=1)
    assert engine.generate([[1, 2, 3]], greedy)[0].token_ids == before


def test_a_restore_that_fails_part_way_is_refused_until_a_whole_one_loads(tiny_qwen3):
    """`load_weights_state` (a resume) copies every matching tensor before torch raises on a misshapen one."""
    path, _ = tiny_qwen3
    engine = _engine(path)
    state = engine.weights_state()
    broken = {k: (torch.zeros(3) if k.endswith("norm.weight") and "layers" not in k else torch.zeros_like(v))
              for k, v in state.items()}
    with pytest.raises(RuntimeError):
        engine.load_weights_state(broken, version=2)
    with pytest.raises(RuntimeError, match="part old, part new"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2))
    engine.load_weights_state(state, version=3)
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0))[0].versions == [3, 3]


def _hf_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def test_stop_ids_stop_besides_the_models_eos(tiny_qwen3, tmp_path):
    """stop_token_ids replaced the EOS ids: a vLLM user adding one stop id got responses that ran past EOS
    to max_tokens. Reference: the unstopped greedy tokens, cut at the first EOS or stop id."""
    path, hf = tiny_qwen3
    prompt = [3, 1, 4, 1, 5]
    greedy = _engine(path).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    eos = greedy[3]
    folder = tmp_path / "model"
    shutil.copytree(path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    engine = _engine(folder)
    never = next(t for t in range(97) if t not in greedy)
    assert eos in engine.eos_ids
    cut = next(i for i, t in enumerate(greedy) if t in engine.eos_ids)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(never,)))[0]
    assert (out.token_ids, out.finish_reason) == (greedy[:cut + 1], "stop")
    early = greedy[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(early,)))[0]
    assert out.token_ids == greedy[:1]


@pytest.mark.parametrize("bad", [5, "5", (1, 2.5), (True,)])
def test_stop_ids_that_are_not_a_sequence_of_ids_are_refused(bad):
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence of token ids"):
        SamplingParams(stop_token_ids=bad).validate()


def test_sample_seeds_must_be_integers(tiny_qwen3):
    path, _ = tiny_qwen3
    with pytest.raises(ValueError, match="sample seeds must be integers, got 1.5"):
        _engine(path).generate([[1, 2]], SamplingParams(max_tokens=2), sample_seeds=[1.5])


def test_the_readme_engine_example_runs_as_written(capsys):
    """README "Using the engine from Python", copied as a user would: it runs on the embedded model and prints
    what it says (the second call's tokens carry version 1)."""
    from pathlib import Path

    import kv4rl

    readme = (Path(kv4rl.__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("# engine_example.py\n")
    exec(compile(readme[start:readme.index("```", start)], "engine_example.py", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert lines[-1].startswith("80 [1, 1] torch.Size([2, ")


def test_tensor_and_array_prompts_are_read_whole(tiny_qwen3):
    """Iterating a tensor made a 0-d tensor of each id (48 ms for 8k ids; a CUDA tensor synced per id)."""
    import numpy as np

    path, _ = tiny_qwen3
    engine = _engine(path)
    ids = [5, 7, 11, 96]
    for given in (torch.tensor(ids), np.array(ids, dtype=np.uint64), np.array(ids), tuple(ids)):
        out = engine.checked_ids(given, "prompt")
        assert out == ids and all(type(t) is int for t in out)
    for bad in (torch.tensor(3), np.zeros((2, 2), dtype=np.int64), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="integer token ids"):
            engine.checked_ids(bad, "prompt")


def test_a_step_that_only_hands_over_what_a_drain_read_says_so(tiny_qwen3):
    """With async scheduling a refresh's drain can read the last step; the next `step` then only returns its
    finished requests, and the collector traced `last_step` again as if it were a new step (a review's
    repro: 2 steps launched, 3 trace rows)."""
    path, _ = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, async_scheduling=True),
                    device="cpu", dtype="float32")
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and engine.step_was_read  # read the first token, the second launched ahead
    engine.load_weights(_hf_weights(path), version=1)  # drains: the second token is read there
    assert len(engine.take_drained_steps()) == 1
    assert engine.step() == [seq] and not engine.step_was_read


def test_a_stream_that_fails_after_only_skipped_names_changes_nothing(tiny_qwen3):
    """Rotary buffers in a stream are skipped, not copied: a stream failing after one was marked torn."""
    path, _ = tiny_qwen3
    engine = _engine(path)

    def stream():
        yield "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)
        raise RuntimeError("the learner's gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        engine.load_weights(stream(), version=1)
    assert len(engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2


class _BosTokenizer:
    """Encodes characters as ids 5.. and, by default, puts BOS (id 1) first, as Llama-3's tokenizer does."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [5 + (ord(c) % 50) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_a_text_prompt_is_encoded_with_the_tokenizers_specials_as_vllm_does(tiny_qwen3):
    """Text prompts were encoded without special tokens, so a model whose tokenizer adds a BOS never got it."""
    path, _ = tiny_qwen3
    engine = Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), device="cpu", dtype="float32",
                    tokenizer=_BosTokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=6)
    (from_text,) = engine.generate(["abc"], params)
    (from_ids,) = engine.generate([[1, 5 + 97 % 50, 5 + 98 % 50, 5 + 99 % 50]], params)
    assert from_text.prompt_ids == [1, 5 + 97 % 50, 5 + 98 % 50, 5 + 99 % 50]
    assert from_text.token_ids == from_ids.token_ids



def test_values_a_state_dict_check_missed_are_refused_before_any_copy(tiny_qwen3):
    """Names and shapes were checked, not values: a meta tensor, a numpy array or a list failed part-way
    (or in the check itself) and left the engine refusing to step; integer weights loaded silently; a float
    version tagged every later token."""
    import numpy as np

    path, _ = tiny_qwen3
    engine = _engine(path)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    before = engine.generate([[1, 2, 3]], greedy)[0].token_ids
    good = _hf_weights(path)
    key = "model.layers.0.mlp.up_proj.weight"
    for value, named in ((torch.empty(good[key].shape, device="meta"), "a meta tensor"),
                         (good[key].numpy(), "is ndarray"), (good[key].tolist(), "is list"),
                         (good[key].to(torch.int64), "a torch.int64 tensor"), (np.float32(1), "is float32")):
        with pytest.raises(ValueError, match=f"load_weights: {key} {named}" if named.startswith("is")
                           else f"load_weights: {key} is {named}"):
            engine.load_weights({**good, key: value}, version=1)
    with pytest.raises(ValueError, match="version must be an int, got 1.5"):
        engine.load_weights(good, version=1.5)
    assert engine.generate([[1, 2, 3]], greedy)[0].token_ids == before and engine.version == 0


def _engine_scheduled(path, run_ahead: bool):
    return Engine(path, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, async_scheduling=run_ahead),
                  device="cpu", dtype="float32")


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_step_that_fails_after_its_forward_leaves_the_engine_stepping(tiny_qwen3, monkeypatch, run_ahead):
    """The forward advanced every row's cache before the sampler ran: a sampler that raised (a top_k of
    2**63, Ctrl-C, out of memory) left caches ahead of tokens, and every later step failed ('cannot reshape
    tensor of 0 elements'); with async scheduling the place held for the unread token (id -1) was re-prefilled
    (IndexError for ever). The running requests are re-prefilled instead. Reference: the same request alone."""
    path, _ = tiny_qwen3
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = _engine(path).generate([[5, 7, 11]], greedy)[0].token_ids
    engine = _engine_scheduled(path, run_ahead)
    x = engine.add_request([5, 7, 11], greedy)
    engine.step()
    real, calls = engine.runner.sample, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the sampler fails once")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "sample", failing)
    with pytest.raises(RuntimeError, match="the sampler fails once"):
        engine.step()
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished == [x] and x.output_ids == alone
    with pytest.raises(ValueError, match="top_k must be below 2\\*\\*63"):
        engine.add_request([1, 2], SamplingParams(top_k=2**63, max_tokens=2))
    for min_p in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0: off\)"):
            engine.add_request([1, 2], SamplingParams(min_p=min_p, max_tokens=2))


def test_a_failed_drain_and_a_failure_after_a_requests_last_token_lose_nothing(tiny_qwen3, monkeypatch):
    """A Ctrl-C while a drain read the step in flight (load_weights, abort, unfinished... drain first) left the
    engine failing every later step; a failure after a step's tokens were read (its device sync) lost the
    request that had just finished: no step returned it. Reference: each request alone."""
    from kv4rl.engine.run_ahead import LaunchedStep

    path, _ = tiny_qwen3
    short, long = SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=6, temperature=0)
    alone = [_engine(path).generate([[5, 7, 11]], long)[0].token_ids,
             _engine(path).generate([[13, 17]], short)[0].token_ids]
    engine = _engine_scheduled(path, True)
    x = engine.add_request([5, 7, 11], long)
    engine.step()
    engine.step()
    real_read, reads = LaunchedStep.read, []

    def read_once_interrupted(self):
        reads.append(1)
        if len(reads) == 1:
            raise KeyboardInterrupt
        return real_read(self)

    monkeypatch.setattr(LaunchedStep, "read", read_once_interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.unfinished()
    while engine.has_unfinished():
        engine.step()
    assert x.output_ids == alone[0]

    engine = _engine(path)
    a, b = engine.add_request([5, 7, 11], long), engine.add_request([13, 17], short)
    engine.step()  # the prefill: one token each
    real_sync, syncs = engine.runner.synchronize, []

    def sync_once_failing():
        syncs.append(1)
        if len(syncs) == 1:
            raise RuntimeError("the device sync fails once")
        return real_sync()

    monkeypatch.setattr(engine.runner, "synchronize", sync_once_failing)
    with pytest.raises(RuntimeError, match="fails once"):
        engine.step()  # b's last token read, then the failure
    returned = []
    while engine.has_unfinished() or not returned:
        returned += engine.step()
    assert sorted(map(id, returned)) == sorted(map(id, (a, b)))
    assert a.output_ids == alone[0] and b.output_ids == alone[1]


def test_a_resumed_response_is_checked_as_a_prompt_is(tiny_qwen3):
    """`resume_from`'s lists were copied unchecked: three lengths that disagree paired log-probs with the
    wrong tokens, an id past the vocabulary failed in a later step, a float id was kept as it was."""
    from kv4rl.engine.sequence import Completion

    path, _ = tiny_qwen3
    engine = _engine(path)
    params = SamplingParams(max_tokens=4)
    for tokens, logprobs, versions, named in (([5, 5, 5], [0.0], [0], "3 tokens, 1 log-probs and 1 versions"),
                                              ([5, 999], [0.0, 0.0], [0, 0], "token id 999"),
                                              ([5, 2.7], [0.0, 0.0], [0, 0], "integer token ids")):
        done = Completion(0, [1, 2], tokens, logprobs, versions, "length")
        with pytest.raises(ValueError, match=named):
            engine.add_request([1, 2], params, resume_from=done)
    assert not engine.has_unfinished()


def test_a_second_thread_is_refused_while_one_steps_the_engine(tiny_qwen3):
    """Two threads calling generate interleaved their batches: one was handed wrong greedy tokens without an
    error. A second thread is now refused by name; the first thread's own nested calls still run."""
    import threading

    path, _ = tiny_qwen3
    engine = _engine(path)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    alone = engine.generate([[4, 5]], greedy)[0].token_ids
    errors, nested = [], []

    def other_thread():
        for call in (engine.step, lambda: engine.generate([[1, 2]], greedy)):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))

    def on_finish(index, completion):
        nested.append(engine.generate([[4, 5]], greedy)[0].token_ids)  # the same thread: allowed
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=60)

    engine.generate_each([[4, 5]], greedy, on_finish)
    assert nested == [alone]
    assert len(errors) == 2 and all("the engine is in use by another thread" in e for e in errors), errors
    assert engine.generate([[4, 5]], greedy)[0].token_ids == alone
