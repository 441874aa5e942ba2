"""The cached tiny model: one real build per session (~15-60 s, in a child process that starts when the
tests are collected), then checks of its files, its accuracy band, the sampling loop against
`model.generate`, and the cache's atomicity with a stand-in builder."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from kv4rl.data.char_tokenizer import build_char_tokenizer
from kv4rl.data.synthetic import PROMPT_TEMPLATE, ArithmeticTask, target_text
from kv4rl.data.types import Problem
from kv4rl.models import tiny
from tests import tiny_build


@pytest.fixture(scope="module")
def built(request, tmp_path_factory) -> dict:
    """The real build into a fresh cache: `tiny_model_dir(cache)` in a child process, which records whether
    the call left its RNG state and thread count as they were (tests/tiny_build.py); conftest starts it
    when the tests are collected, so it runs beside the tests before this module."""
    build = request.config.stash.get(tiny_build.STARTED, None) or tiny_build.start(tmp_path_factory.mktemp("tiny"))
    return build.result()


@pytest.fixture(scope="module")
def loaded(built) -> tuple[Qwen3ForCausalLM, object]:
    model = AutoModelForCausalLM.from_pretrained(built["path"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(built["path"])
    return model, tokenizer


def test_build_writes_a_complete_folder_in_place(built) -> None:
    path = built["path"]
    assert path == built["cache"] / tiny.VERSION_TAG
    assert all((path / name).is_file() for name in tiny.REQUIRED_FILES)
    assert tiny.is_complete(path)
    assert [p.name for p in built["cache"].iterdir()] == [tiny.VERSION_TAG]  # no staging left behind
    assert built["rng_untouched"] and built["threads_untouched"]
    metadata = json.loads((path / tiny.METADATA_FILE).read_text())
    assert metadata["version"] == tiny.VERSION_TAG
    assert ArithmeticTask(**metadata["task"]) == tiny.TASK
    assert metadata["warmup"]["steps"] == tiny.WARMUP_STEPS
    assert metadata["seed"] == tiny.SEED
    assert metadata["model_shape"] == tiny.MODEL_SHAPE
    weights = b"model.safetensors" + (path / "model.safetensors").read_bytes()  # its only weight file
    assert [p.name for p in path.glob("*.safetensors")] == ["model.safetensors"]
    assert metadata["weights_sha256"] == hashlib.sha256(weights).hexdigest()


def test_recorded_accuracies_leave_room_for_rl(built) -> None:
    metadata = json.loads((built["path"] / tiny.METADATA_FILE).read_text())
    sampled, greedy = metadata["sampled_accuracy"], metadata["greedy_accuracy"]
    assert 0.05 <= sampled <= 0.5
    assert greedy >= sampled + 0.1  # the gap that sharpening by RL can close
    assert greedy <= 0.9
    # about half the warm-up answers were bare: RL must also learn to box every answer
    assert 0.2 <= metadata["sampled_format_error_rate"] <= 0.8
    assert metadata["greedy_format_error_rate"] <= 0.8


def test_checkpoint_loads_with_auto_classes(built, loaded) -> None:
    model, tokenizer = loaded
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.dtype == torch.float32
    for key, value in tiny.MODEL_SHAPE.items():
        assert getattr(model.config, key) == value
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    reference = build_char_tokenizer()
    for text in ["12+7-3=", target_text("-14"), "0-10+9="]:
        assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.eos_token_id == model.config.eos_token_id


def test_loaded_model_reproduces_the_recorded_accuracy(built, loaded) -> None:
    model, tokenizer = loaded
    metadata = json.loads((built["path"] / tiny.METADATA_FILE).read_text())
    problems = tiny.TASK.problems(tiny.EVAL_PROBLEMS, seed=tiny.EVAL_SEED)
    greedy = tiny.measure_accuracy(model, tokenizer, problems, temperature=0.0, seed=tiny.EVAL_SEED)
    sampled = tiny.measure_accuracy(model, tokenizer, problems, temperature=1.0, seed=tiny.EVAL_SEED)
    assert greedy == pytest.approx(metadata["greedy_accuracy"], abs=2 / 512)
    assert sampled == pytest.approx(metadata["sampled_accuracy"], abs=2 / 512)


def test_sampled_accuracy_on_fresh_problems_is_strictly_inside_the_band(loaded) -> None:
    model, tokenizer = loaded
    problems = tiny.TASK.problems(512, seed=424_242)
    accuracy = tiny.measure_accuracy(model, tokenizer, problems, temperature=1.0, seed=7)
    assert 0.05 < accuracy < 0.9


def test_greedy_loop_matches_hf_generate(loaded) -> None:
    model, tokenizer = loaded
    # Same-length prompts, so `generate` needs no padding either; it is the independent reference here.
    prompts = [PROMPT_TEMPLATE.format(problem=p.problem) for p in tiny.TASK.problems(400, seed=9)]
    prompts = [p for p in prompts if len(p) == 7][:32]
    assert len(prompts) == 32
    ours = tiny.sample_responses(model, tokenizer, prompts, temperature=0.0, seed=0)
    input_ids = torch.tensor([tokenizer.encode(p) for p in prompts])
    generated = model.generate(
        input_ids, do_sample=False, max_new_tokens=tiny.MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id
    )
    for mine, row in zip(ours, generated[:, input_ids.shape[1] :].tolist()):
        expected = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
        assert mine.text == tokenizer.decode(expected)
        assert mine.stopped == (tokenizer.eos_token_id in row)


def test_sampling_is_seeded_and_validates_temperature(loaded) -> None:
    model, tokenizer = loaded
    prompts = [PROMPT_TEMPLATE.format(problem=p.problem) for p in tiny.TASK.problems(64, seed=1)]
    first = tiny.sample_responses(model, tokenizer, prompts, temperature=1.0, seed=5)
    assert tiny.sample_responses(model, tokenizer, prompts, temperature=1.0, seed=5) == first
    assert tiny.sample_responses(model, tokenizer, prompts, temperature=1.0, seed=6) != first
    with pytest.raises(ValueError, match="temperature"):
        tiny.sample_responses(model, tokenizer, prompts, temperature=-1.0, seed=0)
    with pytest.raises(ValueError, match="at least one problem"):
        tiny.measure_accuracy(model, tokenizer, [], temperature=1.0, seed=0)


def test_supervised_batch_masks_prompt_and_padding() -> None:
    tokenizer = build_char_tokenizer()
    short, long = Problem("1+2", "3", "a"), Problem("10-2+3", "11", "b")
    input_ids, labels = tiny.supervised_batch(tokenizer, [short, long])
    full = tokenizer.encode("1+2=\\boxed{3}") + [tokenizer.eos_token_id]
    assert input_ids.shape == labels.shape == (2, len("10-2+3=") + 5)
    assert input_ids[0].tolist() == full + [tokenizer.pad_token_id] * 4
    assert labels[0].tolist() == [-100] * 4 + full[4:] + [-100] * 4
    assert labels[1, :7].tolist() == [-100] * 7
    assert tokenizer.decode(labels[1, 7:].tolist()) == "\\boxed{11}<eos>"


def test_second_call_returns_the_cached_folder_without_building(built, monkeypatch) -> None:
    path = built["path"]
    stamps = {name: (path / name).stat().st_mtime_ns for name in tiny.REQUIRED_FILES}
    monkeypatch.setattr(tiny, "_write_model", _must_not_build)
    started = time.perf_counter()
    assert tiny.tiny_model_dir(built["cache"], progress=False) == path
    assert time.perf_counter() - started < 1.0
    assert {name: (path / name).stat().st_mtime_ns for name in tiny.REQUIRED_FILES} == stamps


def test_cache_dir_defaults_to_env(built, monkeypatch) -> None:
    monkeypatch.setenv("KV4RL_CACHE", str(built["cache"]))
    monkeypatch.setattr(tiny, "_write_model", _must_not_build)
    assert tiny.default_cache_dir() == built["cache"]
    assert tiny.tiny_model_dir(progress=False) == built["path"]
    monkeypatch.delenv("KV4RL_CACHE")
    assert tiny.default_cache_dir() == Path.home() / ".cache" / "kv4rl"


def _must_not_build(out_dir: Path, progress: bool) -> None:
    raise AssertionError("tiny_model_dir rebuilt a model that was already cached")


def _copying_builder(source: Path, calls: list[Path]):
    """Stands in for the slow build: copies a finished model, stamping it with the current recipe."""

    def write(out_dir: Path, progress: bool) -> None:
        calls.append(out_dir)
        for item in source.iterdir():  # every file a build writes (its record hashes them all)
            if item.is_file():
                shutil.copy2(item, out_dir / item.name)
        metadata = json.loads((source / tiny.METADATA_FILE).read_text())
        (out_dir / tiny.METADATA_FILE).write_text(json.dumps({**metadata, **tiny.build_recipe()}))

    return write


def test_interrupted_builds_never_count_as_complete(built, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    leftover = cache / f".{tiny.VERSION_TAG}.tmp-crashed"
    leftover.mkdir(parents=True)
    for name in tiny.REQUIRED_FILES[:-1]:  # everything but the marker written last
        shutil.copy2(built["path"] / name, leftover / name)
    assert not tiny.is_complete(leftover)
    half_done = cache / tiny.VERSION_TAG
    half_done.mkdir()
    shutil.copy2(built["path"] / "config.json", half_done / "config.json")
    assert not tiny.is_complete(half_done)

    calls: list[Path] = []
    monkeypatch.setattr(tiny, "_write_model", _copying_builder(built["path"], calls))
    assert tiny.tiny_model_dir(cache, progress=False) == half_done
    assert len(calls) == 1 and calls[0].parent == cache and calls[0] != leftover
    assert tiny.is_complete(half_done)
    assert sorted(p.name for p in cache.iterdir()) == sorted([leftover.name, tiny.VERSION_TAG])


def test_a_failing_build_leaves_nothing_that_looks_complete(built, tmp_path, monkeypatch) -> None:
    def crash_midway(out_dir: Path, progress: bool) -> None:
        shutil.copy2(built["path"] / "model.safetensors", out_dir / "model.safetensors")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_write_model", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        tiny.tiny_model_dir(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_wrong_version_or_stale_recipe_is_not_complete(built, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(built["path"], copy)
    assert tiny.is_complete(copy)
    metadata = json.loads((copy / tiny.METADATA_FILE).read_text())
    for key, stale in [("version", "tiny-arith-v0"), ("seed", tiny.SEED + 1), ("task", {"max_value": 99})]:
        (copy / tiny.METADATA_FILE).write_text(json.dumps({**metadata, key: stale}))
        assert not tiny.is_complete(copy), key
    (copy / tiny.METADATA_FILE).write_text("{truncated")
    assert not tiny.is_complete(copy)


def test_a_stale_cached_folder_is_replaced(built, tmp_path, monkeypatch) -> None:
    stale = tmp_path / tiny.VERSION_TAG
    shutil.copytree(built["path"], stale)
    monkeypatch.setattr(tiny, "WARMUP_STEPS", tiny.WARMUP_STEPS + 1)  # an edit without a version bump
    assert not tiny.is_complete(stale)
    calls: list[Path] = []
    monkeypatch.setattr(tiny, "_write_model", _copying_builder(built["path"], calls))
    assert tiny.tiny_model_dir(tmp_path, progress=False) == stale
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [tiny.VERSION_TAG]
