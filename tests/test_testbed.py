"""Testbed models: the test size builds in seconds, is cached atomically and reloads without rebuilding;
its folder names its task, which training and evaluation then use; the exact-solution probability that
stops the GPU warm-up matches a per-problem float64 computation."""

from __future__ import annotations

from pathlib import Path

import hashlib
from importlib import import_module
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.config import ConfigError, load_config
from kv4rl.data.longmul import LongMulTask, solution
from kv4rl.data.source import ProblemSource
from kv4rl.data.synthetic import ArithmeticTask
from kv4rl.models import testbed, testbed_spec, warmup
from tests.conftest import assert_plain_modes

TEST_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "testbed_longmul_test.yaml"  # any cwd

runner = CliRunner()


def test_build_writes_a_complete_folder_that_records_task_and_size(testbed_cache, tmp_path) -> None:
    cache, path = testbed_cache
    assert path == cache / f"{testbed.VERSION_TAG}-longmul-test"
    assert [p.name for p in cache.iterdir()] == [path.name]  # no staging folder left
    assert testbed.is_complete(path, testbed.SPECS["longmul-test"])
    record = testbed.read_metadata(path)
    assert (record["task"], record["size"], record["testbed"]) == ("longmul", "test", "longmul-test")
    spec = testbed.SPECS["longmul-test"]
    assert record["recipe"] == spec.recipe() and record["warmup_steps_taken"] == spec.steps
    assert testbed.task_of(path) == LongMulTask(**spec.task_settings)
    assert 0.0 <= record["sampled_accuracy"] <= 1.0 and record["solution_len_mean"] > 20
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == spec.model_shape["head_dim"]
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert [p.name for p in path.glob("*.safetensors")] == ["model.safetensors"]
    assert record["weights_sha256"] == _sha256(b"model.safetensors" + (path / "model.safetensors").read_bytes())
    assert_plain_modes(path, tmp_path)  # not the private ones of mkdtemp and safetensors


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_second_call_reloads_without_building(testbed_cache, monkeypatch) -> None:
    cache, path = testbed_cache
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    monkeypatch.setattr(testbed, "_write_model", _must_not_build)
    assert testbed.testbed_model_dir("longmul-test", cache, progress=False) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps


def _must_not_build(*args, **kwargs) -> None:
    raise AssertionError("rebuilt a testbed that was already cached")


def test_a_failing_build_leaves_nothing_behind_and_a_stale_recipe_rebuilds(testbed_cache, tmp_path,
                                                                           monkeypatch) -> None:
    _, built = testbed_cache

    def crash(spec, out_dir, progress, device) -> None:
        shutil.copy2(built / "config.json", out_dir / "config.json")
        raise KeyboardInterrupt

    monkeypatch.setattr(testbed, "_write_model", crash)
    with pytest.raises(KeyboardInterrupt):
        testbed.testbed_model_dir("longmul-test", tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []

    # a finished folder of another recipe is not served: it is rebuilt
    final = tmp_path / built.name
    shutil.copytree(built, final)
    record = json.loads((final / testbed.METADATA_FILE).read_text())
    record["recipe"]["steps"] += 1
    (final / testbed.METADATA_FILE).write_text(json.dumps(record))
    calls = _build_by_copying(built, monkeypatch)
    assert testbed.testbed_model_dir("longmul-test", tmp_path, progress=False) == final
    assert len(calls) == 1 and testbed.is_complete(final, testbed.SPECS["longmul-test"])


def _build_by_copying(built: Path, monkeypatch) -> list:
    """Make a testbed build copy the session's built folder (seconds saved); returns the list of its staging folders."""
    calls = []

    def copy(spec, out_dir, progress, device) -> None:
        calls.append(out_dir)
        for item in built.iterdir():
            shutil.copy2(item, out_dir / item.name)

    monkeypatch.setattr(testbed, "_write_model", copy)
    return calls


def test_a_cached_build_whose_weights_no_longer_match_its_record_is_rebuilt(testbed_cache, tmp_path,
                                                                            monkeypatch) -> None:
    """A weights file cut short (a crash, a full disk) kept its folder "complete": build-model reported it with the
    record's fingerprint and every run that loaded it failed. Its hash against the record now says otherwise."""
    _, built = testbed_cache
    final = tmp_path / built.name
    shutil.copytree(built, final)
    spec = testbed.SPECS["longmul-test"]
    assert testbed.is_complete(final, spec)
    with (final / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    assert not testbed.is_complete(final, spec)
    calls = _build_by_copying(built, monkeypatch)
    assert testbed.testbed_model_dir("longmul-test", tmp_path, progress=False) == final
    assert len(calls) == 1 and testbed.is_complete(final, spec)
    assert (final / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()


@pytest.mark.parametrize("edit", ["config.json", "tokenizer.json"])
def test_a_cached_build_whose_config_or_tokenizer_was_edited_is_rebuilt_and_says_so(testbed_cache, tmp_path,
                                                                                    monkeypatch, caplog, edit) -> None:
    """An edited config.json (another rope_theta, more positions) was taken for the build: runs trained on another
    architecture and recorded the build's fingerprint. An emptied tokenizer.json was kept too, and eval then failed.
    The record keeps each file's hash now, and a rebuild says why the cached folder was not taken."""
    _, built = testbed_cache
    final = tmp_path / built.name
    shutil.copytree(built, final)
    spec = testbed.SPECS["longmul-test"]
    assert testbed.is_complete(final, spec)
    if edit == "config.json":
        config = json.loads((final / edit).read_text())
        config["max_position_embeddings"] = 4096
        (final / edit).write_text(json.dumps(config))
    else:
        (final / edit).write_text("{}")
    assert not testbed.is_complete(final, spec)
    calls = _build_by_copying(built, monkeypatch)
    assert testbed.testbed_model_dir("longmul-test", tmp_path, progress=False) == final
    assert len(calls) == 1 and (final / edit).read_bytes() == (built / edit).read_bytes()
    assert any(f"the cached {final} is not its build" in m for m in caplog.messages), caplog.messages
    record = json.loads((built / testbed.METADATA_FILE).read_text())
    assert set(record["files_sha256"]) >= {"config.json", "tokenizer.json", "tokenizer_config.json"}


def test_build_model_keeps_its_json_out_of_the_model_and_names_a_failed_write(testbed_cache, tmp_path,
                                                                              monkeypatch) -> None:
    """`--json <cache>/<testbed>/config.json` replaced the built model's config; a build that cannot write (a full
    disk) printed a traceback instead of one line naming it."""
    cache, built = testbed_cache
    config = (built / "config.json").read_bytes()
    res = runner.invoke(app, ["build-model", "--task", "longmul", "--size", "test", "--device", "cpu",
                              "--cache-dir", str(cache), "--json", str(built / "config.json")])
    assert res.exit_code == 2 and "is a file of the testbed's model folder" in res.output, res.output
    assert (built / "config.json").read_bytes() == config

    def full_disk(spec, out_dir, progress, device) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(testbed, "_write_model", full_disk)
    res = runner.invoke(app, ["build-model", "--task", "longmul", "--size", "test", "--device", "cpu",
                              "--cache-dir", str(tmp_path / "c")])
    assert res.exit_code == 2 and "No space left on device" in res.output and "nothing was installed" in res.output
    assert "Traceback" not in res.output and list((tmp_path / "c").iterdir()) == []


def test_solution_probability_matches_a_float64_sum_per_problem(testbed_cache) -> None:
    _, path = testbed_cache
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = testbed.SPECS["longmul-test"].make_task()
    problems = task.problems(6, seed=4)
    encode = warmup.CharEncoder(tokenizer)
    got = warmup.solution_probability(model, encode, task, problems, tokenizer.pad_token_id,
                                      tokenizer.eos_token_id, torch.device("cpu"), batch_size=4)
    expected = []
    for p in problems:
        prompt = tokenizer.encode(f"{p.problem}=")
        response = tokenizer.encode(solution(*map(int, p.problem.split("*")))) + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        total = sum(logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(response))
        expected.append(float(torch.exp(total)))
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-4, abs=1e-12)


def test_a_testbed_folder_gives_training_its_task(testbed_cache) -> None:
    _, path = testbed_cache
    source = ProblemSource(None, None, seed=0, pool_size=0, task=testbed.task_of(path))
    problems = source.batch(0, 8) + source.eval_problems(8)
    assert all(p.id.startswith("longmul") and "*" in p.problem for p in problems)
    assert source.default_template == "{problem}=" and source.default_reward == "exact"
    pooled = ProblemSource(None, None, seed=0, pool_size=16, task=testbed.task_of(path))
    assert not {p.problem for p in pooled.train} & {p.problem for p in pooled.eval_problems(16)}
    assert ProblemSource(None, None, seed=0).embedded_task == ArithmeticTask()


def test_config_names_a_testbed_or_a_path_not_both() -> None:
    assert load_config(None, ["model.testbed=longmul-gpu"]).model.testbed == "longmul-gpu"
    with pytest.raises(ConfigError, match="unknown testbed 'longmul-huge'.*longmul-gpu"):
        load_config(None, ["model.testbed=longmul-huge"])
    with pytest.raises(ConfigError, match="model.path and model.testbed"):
        load_config(None, ["model.testbed=longmul-test", "model.path=/x"])


def test_a_testbed_run_below_the_response_limit_its_build_measured_is_warned(testbed_cache, tmp_path) -> None:
    """`model.testbed=longmul-test` alone kept the embedded task's 16 new tokens: every response was cut before its
    answer, and the only hint came after the first iteration. The build's own limit is named before any work; a
    run that reaches it, one on a data file, and the embedded model are told nothing."""
    from kv4rl.run_setup import short_response_warning

    _, path = testbed_cache
    need = testbed.read_metadata(path)["eval_max_new_tokens"]
    said = short_response_warning(load_config(None, []), path)
    assert said is not None and f"below the {need} tokens" in said and "testbed longmul-test" in said
    assert f"rollout.max_new_tokens={need}" in said
    assert short_response_warning(load_config(None, [f"rollout.max_new_tokens={need}"]), path) is None
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert short_response_warning(load_config(None, [f"data.train={data}"]), path) is None
    from kv4rl.models.tiny import tiny_model_dir

    assert short_response_warning(load_config(None, []), tiny_model_dir()) is None


@pytest.mark.slow
def test_train_on_the_test_testbed_recipe(testbed_cache, tmp_path, monkeypatch) -> None:
    cache, _ = testbed_cache
    monkeypatch.setenv("KV4RL_CACHE", str(cache))
    res = runner.invoke(app, ["train", "--config", str(TEST_RECIPE), f"out_dir={tmp_path}",
                              "trainer.iterations=1", "rollout.max_new_tokens=96", "checkpoint.save_every=1",
                              "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "testbed-longmul-test" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["response_len_mean"] > 16  # longer than the arithmetic task allows
    # its checkpoint keeps the task: evaluated or trained from, it is a longmul model, not the arithmetic one
    (checkpoint,) = (tmp_path / "testbed-longmul-test" / "checkpoints").glob("iter_*")
    task = testbed.task_of(checkpoint)
    assert isinstance(task, LongMulTask) and task == testbed.task_of(testbed_cache[1])
    assert testbed.read_metadata(checkpoint)["checkpoint_of"] == str(testbed_cache[1])


@pytest.mark.parametrize(("args", "needle"), [
    (["--task", "sudoku", "--size", "test"], "--task: unknown task 'sudoku'"),
    (["--task", "longmul", "--size", "huge"], "unknown testbed 'longmul-huge'"),
    (["--task", "longmul", "--size", "tiny"], "unknown testbed 'longmul-tiny'"),
    (["--task", "longmul", "--size", "test", "--device", "tpu"], "--device"),
])
def test_build_model_refuses_bad_options_before_any_work(args, needle, tmp_path) -> None:
    res = runner.invoke(app, ["build-model", *args, "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2 and needle in " ".join(res.output.split())
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("task", "built"), [("arith", "arith-tiny"), ("longmul", "longmul-gpu")])
def test_build_model_without_a_size_takes_the_tasks_own_default(task, built, tmp_path, monkeypatch) -> None:
    """`--task arith` alone asked for arith-gpu, which does not exist ("unknown testbed 'arith-gpu'")."""
    asked = []

    def stop(name, *args, **kwargs):
        asked.append(name)
        raise ValueError("stopped here")

    monkeypatch.setattr(import_module("kv4rl.models.testbed"), "testbed_model_dir", stop)
    res = runner.invoke(app, ["build-model", "--task", task, "--device", "cpu", "--cache-dir", str(tmp_path / "c")])
    assert asked == [built] and "stopped here" in res.output


def test_build_model_reports_a_cached_build(testbed_cache, tmp_path) -> None:
    cache, path = testbed_cache
    out = tmp_path / "build.json"
    res = runner.invoke(app, ["build-model", "--task", "longmul", "--size", "test", "--cache-dir", str(cache),
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    assert record["path"] == str(path) and record["built now"] is False and record["testbed"] == "longmul-test"
    assert record["weights_sha256"] == _sha256(b"model.safetensors" + (path / "model.safetensors").read_bytes())


def test_a_checkpoint_carries_the_task_but_not_the_starting_models_fingerprint(tmp_path) -> None:
    """The carried record held the testbed's weights_sha256, which a run from the checkpoint then recorded as its
    own starting model's fingerprint (plot curves could not tell it from a run on the testbed)."""
    import torch
    from safetensors.torch import save_file

    from kv4rl.models.fingerprint import model_fingerprint, weights_sha256

    base, checkpoint = tmp_path / "base", tmp_path / "iter_000003"
    for folder, value in ((base, 0.0), (checkpoint, 1.0)):
        folder.mkdir()
        save_file({"w": torch.full((4,), value)}, folder / "model.safetensors")
    record = {"task": "longmul", "weights_sha256": weights_sha256(base)}
    (base / testbed.METADATA_FILE).write_text(json.dumps(record))
    testbed.carry_record(base, checkpoint)
    carried = testbed.read_metadata(checkpoint)
    assert carried["task"] == "longmul" and carried["checkpoint_of"] == str(base) and "weights_sha256" not in carried
    assert model_fingerprint(checkpoint) == weights_sha256(checkpoint) != model_fingerprint(base)


def test_build_model_says_built_now_for_a_fresh_build_however_fast(tmp_path) -> None:
    """`arith-test` builds in under a second, which the old rule (more than 1 s elapsed) reported as cached."""
    out = tmp_path / "build.json"
    args = ["build-model", "--task", "arith", "--size", "test", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["built now"] is True
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and json.loads(out.read_text())["built now"] is False


def test_a_changed_prompt_template_or_warm_up_optimizer_makes_the_cached_build_stale(testbed_cache, monkeypatch):
    """The recipe that keys the cache left out what lives in code (the template, the solution format, AdamW's
    settings): a changed template reused the stale build, where the tiny model rebuilt."""
    _, path = testbed_cache
    spec = testbed.SPECS["longmul-test"]
    assert testbed.is_complete(path, spec)
    monkeypatch.setattr(testbed_spec, "PROMPT_TEMPLATE", "Q: {problem}\nA:")
    assert not testbed.is_complete(path, spec)
    monkeypatch.undo()
    monkeypatch.setattr(testbed_spec, "WARMUP_OPTIMIZER", {**testbed_spec.WARMUP_OPTIMIZER, "grad_clip": 0.5})
    assert not testbed.is_complete(path, spec)


@pytest.mark.slow
def test_eval_of_a_testbed_defaults_to_the_limit_its_build_measured_with(testbed_cache, tmp_path) -> None:
    """The longmul default of 2,048 new tokens overran the test size's 512 positions and warned on every call."""
    _, path = testbed_cache
    out = tmp_path / "eval.json"
    res = runner.invoke(app, ["eval", "--model", str(path), "--n", "2", "--k", "1", "--device", "cpu",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "warning" not in res.output
    record = json.loads(out.read_text())
    assert record["max_new_tokens"] == testbed.read_metadata(path)["eval_max_new_tokens"]
    assert record["data"] == "testbed task longmul-test"  # it said "embedded" of longmul problems
