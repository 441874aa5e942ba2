"""Every command refuses bad input with one clear error, exit status 2, before any work: option values and
lists, output paths, templates, and prompts that do not fit the model's context. "Before any work" is
checked by making the work itself fail loudly (exit status 1) if it is ever reached."""

import importlib
import json
import logging
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from kv4rl.cli import app

runner = CliRunner()
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_ROWS = [  # from the GSM8K test split, in its file's JSON shape
    {"id": "gsm8k-test-0",
     "problem": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
                "muffins for her friends every day with four. She sells the remainder at the farmers' market "
                "daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' "
                "market?",
     "answer": "18", "source": "GSM8K", "solution": "16 - 3 - 4 = 9 eggs; 9 * 2 = $18"},
    {"id": "gsm8k-test-1",
     "problem": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does "
                "it take?",
     "answer": "3", "source": "GSM8K", "solution": "2/2 = 1 bolt of white fiber; 2 + 1 = 3"},
]


def _work_started(*args, **kwargs):
    raise AssertionError("the command started its work before refusing the input")


@pytest.fixture()
def no_work(monkeypatch):
    """Make loading a model and every benchmark or simulation body fail with exit status 1."""
    import kv4rl.engine.llm

    monkeypatch.setattr(kv4rl.engine.llm.Engine, "__init__", _work_started)
    for module, name in [("kv4rl.models.hf_weights", "check_model_folder"), ("kv4rl.bench.generate", "bench_generate"),
                         ("kv4rl.bench.learner", "bench_learner"),
                         ("kv4rl.bench.pool", "bench_pool"), ("kv4rl.bench.fidelity", "run_fidelity"),
                         ("kv4rl.bench.decode_attn", "run_decode_attn"),
                         ("kv4rl.bench.decode_forward", "run_decode_forward"), ("kv4rl.sim.clip_bias", "clip_bias"),
                         ("kv4rl.bench.iteration", "bench_iteration"), ("kv4rl.bench.rollout", "bench_rollout"),
                         ("kv4rl.sim.correction_variance", "measure")]:
        monkeypatch.setattr(importlib.import_module(module), name, _work_started)


def refused(args: list[str], *needles: str) -> str:
    """Run the command; it must exit 2 with an error naming every needle. Returns the unwrapped output."""
    res = runner.invoke(app, args)
    text = res.output.strip()
    assert res.exit_code == 2, (res.exit_code, res.exception, text)
    assert text.startswith("error:") and "\n" not in text, text  # one line, however long
    for needle in needles:
        assert needle in text, (needle, text)
    return text


@pytest.mark.parametrize(("args", "option"), [
    (["--k", "0"], "--k must be >= 1"),
    (["--n", "-1"], "--n/--num-problems must be >= 0"),
    (["--num-problems", "-1"], "--n/--num-problems must be >= 0"),
    (["trainer.lr=1e-5", "rollout.temperature=0.7"],
     "only engine.* settings apply here, got trainer.lr, rollout.temperature; use --temperature for "
     "rollout.temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature"),
    (["--template", "hello"], "--template: 'hello' has no {problem} field"),
    (["--template", "{problem} in \\boxed{}"], "--template"),
    (["--reward", "nope"], "--reward: unknown reward 'nope'"),
    (["--device", "gpu"], "--device: 'gpu'"),
    (["engine.max_model_len=0"], "engine.max_model_len must be >= 1, got 0"),  # eval took 0 as "not set"
    (["engine.max_model_len=-5"], "engine.max_model_len must be >= 1, got -5"),
])
def test_eval_refuses_a_bad_option_by_name_before_loading_the_model(no_work, args, option):
    refused(["eval", *args], option)


@pytest.mark.parametrize(("args", "needles"), [
    (["bench", "generate", "--shape", "qwen3-tiny", "--kv-format", "bf16,kv5"], ["--kv-format", "'kv5'"]),
    (["bench", "generate", "--shape", "qwen3-tiny", "--kv-format", "bf16,kv4"],  # group 128 > head_dim 32
     ["--kv-format kv4", "head_dim=32"]),
    (["bench", "generate", "--batch-sizes", "64,0"], ["--batch-sizes", ">= 1"]),
    (["bench", "generate", "--batch-sizes", "64,x"], ["--batch-sizes", "'x'"]),
    (["bench", "generate", "--shape", "qwen9"], ["--shape", "qwen9"]),
    (["bench", "generate", "--device", "gpu"], ["--device", "'gpu'"]),
    (["bench", "pool", "--formats", "bf16,kv9"], ["--formats", "'kv9'"]),
    (["bench", "learner", "--workload", "zipf"], ["--workload", "'zipf'"]),
    (["bench", "learner", "--max-tokens", "0"], ["--max-tokens must be >= 1"]),
    (["bench", "learner", "--layouts", "padded,ragged"], ["--layouts", "'ragged'"]),
    (["bench", "learner", "--checkpointing", "maybe"], ["--checkpointing", "'maybe'"]),
    (["bench", "learner", "--shape", "qwen3-tiny", "--seq-len", "1000"], ["1000 tokens", "512 positions"]),
    (["bench", "learner", "--workload", "lognormal", "--median-len", "9000"], ["--median-len 9000"]),
    (["bench", "learner", "--shape", "qwen9"], ["--shape", "qwen9"]),
    (["bench", "pool", "--shape", "qwen9"], ["--shape", "qwen9"]),
    (["bench", "fidelity", "--formats", "bf16,kv9"], ["--formats", "'kv9'"]),
    (["bench", "fidelity", "--reference", "kv9"], ["--reference", "'kv9'"]),
    (["bench", "fidelity", "--n", "0"], ["--n must be >= 1"]),
    (["bench", "fidelity", "--max-new-tokens", "0"], ["--max-new-tokens must be >= 1"]),
    (["bench", "fidelity", "--template", "hello"], ["--template"]),
    (["bench", "fidelity", "--dtype", "fp8"], ["--dtype", "'fp8'"]),
    (["bench", "decode-attn", "--batches", "64,0"], ["--batches"]),
    (["bench", "decode-attn", "--contexts", "2k"], ["--contexts", "'2k'"]),
    (["bench", "decode-attn", "--formats", "bf16,fp4"], ["--formats", "'fp4'"]),
    (["bench", "decode-forward", "--shapes", "qwen9"], ["--shapes", "'qwen9'"]),
    (["bench", "decode-forward", "--fp8-gemm", "cutlass"], ["--fp8-gemm", "'cutlass'"]),
    (["bench", "decode-forward", "--fp8-gemm", "triton", "--no-fused-ops"], ["--fp8-gemm triton", "--fused-ops"]),
    (["bench", "iteration", "--arms", "bf16+sync,kv9+partial"], ["--arms 'kv9+partial'", "unknown: kv9"]),
    (["bench", "iteration", "--arms", "bf16+sync+partial"], ["--arms 'bf16+sync+partial'", "KV format + mode"]),
    (["bench", "iteration", "--arms", "fp8w+fp8w+kv4+sync"], ["--arms 'fp8w+fp8w+kv4+sync'"]),
    (["bench", "iteration", "--arms", "kv4+sync,kv4+sync"], ["--arms", "names one arm twice"]),
    (["bench", "iteration", "--arms", ","], ["--arms is empty"]),
    (["bench", "iteration", "--shape", "qwen9"], ["--shape", "qwen9"]),
    (["bench", "iteration", "--shape", "qwen3-tiny"], ["--prompt-len + --max-len = 8320", "512 tokens"]),
    (["bench", "iteration", "--iterations", "0"], ["--iterations must be >= 1"]),
    (["bench", "iteration", "--micro-batch-size", "0"], ["--micro-batch-size must be >= 1"]),
    (["bench", "iteration", "--max-slots", "0"], ["--max-slots must be >= 1"]),
    (["bench", "iteration", "--median-len", "9000"], ["--median-len 9000 exceeds --max-len 8192"]),
    (["bench", "iteration", "--group-size", "1"], ["--group-size must be >= 2"]),
    (["bench", "iteration", "--lr", "0"], ["--lr must be > 0"]),
    (["bench", "iteration", "--device", "gpu"], ["--device", "'gpu'"]),
    (["bench", "iteration", "engine.kv.format=fp8"], ["engine.kv.format is set by --arms"]),
    (["bench", "iteration", "engine.sleep_between_rollouts=false"], ["--sleep/--no-sleep"]),
    (["bench", "iteration", "engine.kv.group_size=48"], ["--arms kv4+partial", "group_size"]),
    (["bench", "iteration", "--attention", "ring"], ["--attention must be one of auto, sdpa, flex", "'ring'"]),
    (["bench", "rollout", "--device", "foo"], ["--device: 'foo' is not auto, cpu, cuda or cuda:N"]),
    (["bench", "pool", "engine.kv.format=fp8"], ["engine.kv.format is set by --formats"]),
    (["bench", "generate", "engine.kv.format=kv4"], ["engine.kv.format is set by --kv-format"]),
    # the engine stopped its sequences at the limit while transformers generated every token: unequal rows compared
    (["bench", "generate", "--prompt-len", "8", "--new-tokens", "4", "engine.max_model_len=10"],
     ["engine.max_model_len=10 is below --prompt-len + --new-tokens = 12"]),
    (["bench", "pool", "--context", "1"], ["exceed --context 1"]),
    (["bench", "fidelity", "--group-size", "7"], ["--group-size must be one of (32, 64, 128), got 7"]),
    (["bench", "fidelity", "--block-size", "0"], ["--block-size must be a power of two, got 0"]),
    (["bench", "iteration", "--max-tokens-per-micro-batch", "0"], ["--max-tokens-per-micro-batch must be >= 1"]),
    (["bench", "pool", "engine.num_kv_blocks=5"], ["engine.num_kv_blocks: only engine.kv.* settings"]),
    (["sim", "clip-bias", "--sweep-rho", "1,-1"], ["--sweep-rho"]),
    # torch's overflow error named no option (and, in correction-variance, blamed --engine)
    (["sim", "clip-bias", "--seed", str(2**64 - 1)], ["--seed must be in [-2**63, 2**64 - 17)"]),  # 16 sweep points
    (["sim", "clip-bias", "--seed", str(2**64 - 3), "--sweep-rho", "1,2"], ["--seed must be in [-2**63, 2**64 - 3)"]),
    (["sim", "correction-variance", "--seed", str(2**64)], ["--seed must be in [-2**63, 2**64)"]),
    (["sim", "correction-variance", "--template", "hello"], ["--template"]),
    (["sim", "correction-variance", "--device", "foo"], ["--device: 'foo' is not auto, cpu, cuda or cuda:N"]),
    (["sim", "correction-variance", "--temperature", "1e-9"], ["--temperature must be at least 1e-05"]),
    # engine keys were checked only once the model was built (the tiny one: 28 s) or loaded
    (["sim", "correction-variance", "--model", "/nonexistent", "--engine", "kv.n_sinkk=4"],
     ["unknown config key 'engine.kv.n_sinkk'"]),
    (["sim", "correction-variance", "--engine", "kv.format=kv5"], ["unknown KV format 'kv5'"]),
    (["bench", "iteration", "--arms", "bf16+sync,,kv4+partial", "--validate-only"], ["an empty item between commas"]),
])
def test_bench_and_sim_refuse_a_bad_option_before_any_work(no_work, args, needles):
    refused(args, *needles)


JSON_COMMANDS = [["eval"], ["bench", "fidelity"], ["bench", "generate"], ["bench", "pool"], ["bench", "decode-attn"],
                 ["bench", "decode-forward"], ["bench", "iteration"], ["sim", "clip-bias"], ["sim", "correction-variance"]]


@pytest.mark.parametrize("command", JSON_COMMANDS, ids=" ".join)
def test_a_json_path_that_cannot_be_written_is_refused_before_any_work(no_work, command, tmp_path):
    refused([*command, "--json", str(tmp_path)], f"--json {tmp_path}", "is a directory")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    refused([*command, "--json", str(blocker / "out.json")], "--json", "cannot create its folder")


TINY_LENGTHS = ["--prompt-len", "4", "--median-len", "6", "--max-len", "24"]


@pytest.mark.parametrize(("command", "json_name", "clash"), [
    (["bench", "rollout", "--shape", "qwen3-tiny"], "x.png", "--png {d}/x.png is also --json"),
    (["bench", "iteration", "--shape", "qwen3-tiny", *TINY_LENGTHS], "x.png", "--png {d}/x.png is also --json"),
    (["bench", "iteration", "--shape", "qwen3-tiny", *TINY_LENGTHS], "x.csv",
     "the CSV beside --png {d}/x.csv is also --json"),
])
def test_a_bench_json_that_is_also_its_figure_or_csv_is_refused(no_work, tmp_path, command, json_name, clash):
    """The figure (or its CSV) was written over the JSON, both runs exiting 0."""
    refused([*command, "--device", "cpu", "--png", str(tmp_path / "x.png"), "--json", str(tmp_path / json_name)],
            clash.format(d=tmp_path))
    assert not any(tmp_path.iterdir())


def test_eval_json_into_a_missing_folder_creates_it(tmp_path):
    out = tmp_path / "not" / "yet" / "eval.json"
    res = runner.invoke(app, ["eval", "--n", "3", "--k", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["num_problems"] == 3 and r["data"] == "embedded" and r["reward"] == "exact"


@pytest.fixture()
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return path


def boxed_prompt_length(row) -> int:
    from kv4rl.models.tiny import tiny_model_dir

    return len(AutoTokenizer.from_pretrained(tiny_model_dir()).encode(row["problem"] + INSTRUCTION))


def test_eval_names_a_prompt_longer_than_the_models_context_before_generating(gsm8k_file, monkeypatch):
    import kv4rl.engine.llm

    monkeypatch.setattr(kv4rl.engine.llm.Engine, "__init__", _work_started)
    length = boxed_prompt_length(GSM8K_ROWS[0])
    assert length > 64
    refused(["eval", "--data", str(gsm8k_file)], "prompt 0 (id gsm8k-test-0: 'Janet\u2019s ducks lay 16 eggs",
            f"is {length} tokens", "context is 64 positions", "2 of 2 prompts")


def test_bench_fidelity_names_a_prompt_longer_than_the_models_context(gsm8k_file, monkeypatch):
    monkeypatch.setattr(importlib.import_module("kv4rl.bench.fidelity"), "run_fidelity", _work_started)
    refused(["bench", "fidelity", "--data", str(gsm8k_file)], "id gsm8k-test-0",
            f"is {boxed_prompt_length(GSM8K_ROWS[0])} tokens", "64 positions")


def test_a_truncated_weight_file_is_named_in_one_line_before_any_work(tmp_path, monkeypatch):
    """Not safetensors' traceback: the file named, and the likely cause (an interrupted copy)."""
    import kv4rl.engine.llm
    from kv4rl.models.tiny import tiny_model_dir

    monkeypatch.setattr(kv4rl.engine.llm.Engine, "__init__", _work_started)
    folder = shutil.copytree(tiny_model_dir(progress=False), tmp_path / "model")
    os.truncate(folder / "model.safetensors", 50)
    needles = (f"{folder / 'model.safetensors'}: not a readable safetensors file", "is the copy complete?")
    refused(["eval", "--model", str(folder)], *needles)
    refused(["train", f"model.path={folder}", f"out_dir={tmp_path / 'runs'}", "device=cpu", "--no-progress"],
            *needles)


def test_a_tokenizer_file_cut_short_is_named_before_the_learner_loads(tmp_path, monkeypatch):
    """transformers' JSONDecodeError ("Expecting property name ...: line 46 column 4") named no file, and train
    met it only after the learner had loaded (minutes at 8B)."""
    import kv4rl.engine.llm
    import kv4rl.loop
    from kv4rl.models.tiny import tiny_model_dir

    monkeypatch.setattr(kv4rl.engine.llm.Engine, "__init__", _work_started)
    monkeypatch.setattr(kv4rl.loop, "build_learner", _work_started)
    folder = shutil.copytree(tiny_model_dir(progress=False), tmp_path / "model")
    os.truncate(folder / "tokenizer.json", 200)
    needles = (f"{folder}: the tokenizer files do not load (JSONDecodeError: ", "is the copy complete?")
    refused(["eval", "--model", str(folder)], *needles)
    refused(["train", f"model.path={folder}", f"out_dir={tmp_path / 'runs'}", "device=cpu", "--no-progress"],
            *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.jsonl"))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_warned_about_at_load(tmp_path, caplog):
    import logging

    from kv4rl.models.hf_weights import load_tokenizer
    from kv4rl.models.tiny import tiny_model_dir

    size = len(load_tokenizer(tiny_model_dir(progress=False)))
    with caplog.at_level(logging.WARNING):
        load_tokenizer(tiny_model_dir(progress=False), vocab_size=size)
        assert not caplog.messages
        load_tokenizer(tiny_model_dir(progress=False), vocab_size=size - 3)
    (line,) = caplog.messages
    assert f"the tokenizer has {size} tokens but config.json's vocab_size is {size - 3}" in line


def test_print_config_prints_the_resolved_config_and_touches_nothing(tmp_path, monkeypatch):
    """A user porting a config checks it without training (the config was saved only after an iteration)."""
    import yaml

    import kv4rl.loop
    from kv4rl.config import load_config, to_dict

    monkeypatch.setattr(kv4rl.loop, "train", _work_started)
    monkeypatch.chdir(tmp_path)
    args = [f"out_dir={tmp_path / 'runs'}", "trainer.lr=2e-5", "rollout.group_size=4"]
    res = runner.invoke(app, ["train", "--print-config", *args])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(res.stdout) == to_dict(load_config(overrides=args))
    assert yaml.safe_load(res.stdout)["trainer"]["lr"] == 2e-5 and list(tmp_path.iterdir()) == []
    refused(["train", "--print-config", "trainer.lrr=1"], "unknown config key 'trainer.lrr'; did you mean trainer.lr?")
    refused(["train", "--print-config", "--seeds", "1,2"], "--print-config prints one run's config")


def tiny_setup(overrides):
    from kv4rl.config import load_config
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource
    from kv4rl.models.tiny import tiny_model_dir

    cfg = load_config(None, overrides)
    source = ProblemSource(cfg.data.train, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size)
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_model_dir()),
                                cfg.data.prompt_template or source.default_template)
    return cfg, source, formatter


def test_train_names_a_prompt_longer_than_the_models_context(gsm8k_file):
    from kv4rl.rollout.build import max_model_len

    cfg, source, formatter = tiny_setup([f"data.train={gsm8k_file}"])
    with pytest.raises(ValueError) as info:
        max_model_len(cfg, source, formatter, 64)
    message = str(info.value)
    assert f"data.train {gsm8k_file}: prompt 0 (id gsm8k-test-0" in message
    assert f"is {boxed_prompt_length(GSM8K_ROWS[0])} tokens" in message and "64 positions" in message


def test_train_warns_once_when_max_new_tokens_runs_past_the_context(caplog):
    from kv4rl.rollout.build import max_model_len

    cfg, source, formatter = tiny_setup(["rollout.max_new_tokens=100000"])
    with caplog.at_level(logging.WARNING, logger="kv4rl.loop"):
        assert max_model_len(cfg, source, formatter, 64) == 64
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "rollout.max_new_tokens=100000" in record.getMessage() and "64 positions" in record.getMessage()
    caplog.clear()
    cfg, source, formatter = tiny_setup(["rollout.max_new_tokens=16"])
    with caplog.at_level(logging.WARNING, logger="kv4rl.loop"):
        assert max_model_len(cfg, source, formatter, 64) < 64
    assert not caplog.records


def test_an_engine_max_model_len_that_is_given_is_checked_as_the_models_context_is(gsm8k_file, caplog):
    """A given engine.max_model_len skipped every check: beyond the model's positions it crashed in RoPE with an
    IndexError, below a prompt it failed in the first rollout without naming the key, and it cut responses
    without the warning."""
    from kv4rl.config import ConfigError
    from kv4rl.rollout.build import max_model_len

    cfg, source, formatter = tiny_setup(["engine.max_model_len=200"])
    with pytest.raises(ConfigError, match="engine.max_model_len=200 exceeds the model's context of 64 positions"):
        max_model_len(cfg, source, formatter, 64)
    cfg, source, formatter = tiny_setup([f"data.train={gsm8k_file}", "engine.max_model_len=60"])
    with pytest.raises(ValueError, match=f"data.train {gsm8k_file}: prompt 0 .* but engine.max_model_len is 60 positions"):
        max_model_len(cfg, source, formatter, 64)
    cfg, source, formatter = tiny_setup(["engine.max_model_len=12", "rollout.max_new_tokens=16"])
    with caplog.at_level(logging.WARNING):
        assert max_model_len(cfg, source, formatter, 64) == 12
    assert "exceed engine.max_model_len of 12 positions" in caplog.text


def test_eval_warns_when_max_new_tokens_runs_past_the_context_and_records_the_cut(tmp_path):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in range(3)))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", "--data", str(data), "--template", "{problem}=", "--reward", "exact", "--k", "1",
                              "--max-new-tokens", "100", "--json", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert text.count("exceed the model's context") == 1 and "--max-new-tokens 100" in text and "64 positions" in text
    r = json.loads(out.read_text())
    assert (r["max_new_tokens"], r["max_model_len"], r["template"], r["reward"]) == (100, 64, "{problem}=", "exact")


@pytest.mark.parametrize("template", ["Solve it.", "{problem} and put it in \\boxed{}", "{problem} {answer}"])
def test_config_refuses_a_prompt_template_that_would_not_format(template):
    from kv4rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.prompt_template"):
        load_config(base={"data": {"prompt_template": template}})


@pytest.mark.parametrize(("template", "shown"), [("{problem:.10}\nPlease box.", "{problem:.10}"),
                                               ("{problem!r}", "{problem!r}"),
                                               ("{problem} then {problem:>40}", "{problem:>40}")])
def test_a_template_that_changes_the_problems_text_is_refused(template, shown):
    """`{problem:.10}` cut every problem at 10 characters and `{problem!r}` quoted it, without a word."""
    from kv4rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(base={"data": {"prompt_template": template}})
    assert f"changes the problem's text with {shown}; write the field as plain {{problem}}" in str(info.value)
    refused(["eval", "--template", template], f"--template: {template!r} changes the problem's text with {shown}")


@pytest.mark.parametrize(("args", "needles"), [
    (["bench", "generate", "--batch-sizes", "64,64"], ["--batch-sizes '64,64'", "'64' is given twice"]),
    (["bench", "generate", "--no-hf", "--kv-format", "kv4", "--shape", "qwen3-tiny", "--prompt-len", "2",
      "--new-tokens", "3"], ["protected positions exceed --prompt-len + --new-tokens = 5"]),  # named a key not set
    (["bench", "generate", "--kv-format", "bf16,"], ["--kv-format 'bf16,'", "empty item"]),
    (["bench", "pool", "--formats", "bf16,,kv4"], ["--formats", "empty item"]),
    (["bench", "fidelity", "--allocations", "4+12,4+12"], ["--allocations", "'4+12' is given twice"]),
    (["sim", "clip-bias", "--sweep-rho", "1,1.0"], ["--sweep-rho", "given twice"]),
    (["sim", "clip-bias", "--sweep-rho", "1,inf"], ["--sweep-rho", "'inf' is not a finite number"]),
    (["bench", "generate", "--shape", "qwen3-tiny", "--prompt-len", "500", "--new-tokens", "13"],
     ["--prompt-len + --new-tokens = 513", "context of 512 tokens"]),
    (["eval", "--json", "same.json", "--samples", "./same.json"], ["--samples same.json is also --json"]),
    (["eval", "--data", "d.jsonl", "--samples", "./d.jsonl"], ["--samples d.jsonl is also --data",
                                                              "would replace that file"]),
    (["eval", "--data", "d.jsonl", "--json", "d.jsonl"], ["--json d.jsonl is also --data"]),
    (["bench", "fidelity", "--data", "d.jsonl", "--json", "d.jsonl"], ["--json d.jsonl is also --data"]),
    (["sim", "correction-variance", "--data", "d.jsonl", "--json", "d.jsonl"], ["--json d.jsonl is also --data"]),
    (["sim", "clip-bias", "--png", "clip.txt"], ["--png clip.txt", "cannot write a '.txt' figure", "png"]),
    (["bench", "iteration", "--png", "it.txt"], ["--png it.txt", "'.txt' figure"]),
    (["train", "--seeds", "1,2", "seed=5"], ["--seeds sets each run's seed; leave seed= out"]),
    (["train", "name=."], ["name='.'", "must be a folder name"]),
    (["train", "name=.."], ["name='..'", "must be a folder name"]),
    (["train", "trainer.lr=.inf"], ["trainer.lr: expected a finite number"]),
    (["sim", "clip-bias", "--eps", "1.5"], ["--eps must be in [0, 1), got 1.5"]),
    (["sim", "clip-bias", "--samples", "1"], ["--samples must be >= 2"]),
    (["sim", "correction-variance", "--engine", "engine.kv.format=kv4"], ["give the key without 'engine.'",
                                                                          "'kv.format=kv4'"]),
    (["bench", "fidelity", "--group-size", "0"], ["--group-size must be >= 1"]),
    (["bench", "fidelity", "--random-layers", "2"], ["--random-layers", "give --random-init too"]),
    (["bench", "learner", "--num-seqs", "0"], ["--num-seqs must be >= 1"]),
    (["bench", "learner", "--shape", "qwen3-tiny", "--workload", "uniform"], ["512 positions", "lower --seq-len"]),
])
def test_repeats_empty_items_non_finite_numbers_and_clashing_paths_are_refused(no_work, args, needles, tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(args, *needles)
    assert not list(tmp_path.iterdir())  # nothing written, no folder made


@pytest.mark.parametrize("args", [
    ["bench", "pool", "--memory-gib", "inf"], ["bench", "pool", "--memory-gib", "nan"],
    ["eval", "--temperature", "nan"], ["sim", "clip-bias", "--sigma", "inf"], ["plot", "curves", "--ema", "nan"],
])
def test_a_float_option_refuses_inf_and_nan_as_it_parses(no_work, args):
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "is not a finite number" in res.output and args[-2] in res.output, res.output


def test_an_error_message_keeps_square_brackets(tmp_path):
    """Error lines are printed as text: a path like math[v2].jsonl is not rich markup."""
    refused(["eval", "--data", str(tmp_path / "math[v2].jsonl")], "math[v2].jsonl")
    refused(["sim", "clip-bias", "--png", str(tmp_path / "[x]" / "clip.txt")], "[x]")


def test_train_into_an_out_dir_under_a_file_is_refused_before_any_work(no_work, tmp_path):
    (tmp_path / "afile").write_text("keep")
    refused(["train", f"out_dir={tmp_path / 'afile'}"], "cannot create the run folder", f"{tmp_path / 'afile'} is a file")
    refused(["train", "--seeds", "0,1", f"out_dir={tmp_path / 'afile' / 'sub'}"], "is a file")
    assert (tmp_path / "afile").read_text() == "keep"


def test_a_cache_or_model_path_that_is_a_file_or_a_run_folder_is_named(no_work, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("keep")
    refused(["build-model", "--size", "test", "--cache-dir", str(tmp_path / "afile" / "sub")],
            f"--cache-dir {tmp_path / 'afile' / 'sub'}: cannot be created", f"{tmp_path / 'afile'} is a file")
    monkeypatch.setenv("KV4RL_CACHE", str(tmp_path / "afile"))
    refused(["build-model", "--size", "test"], "($KV4RL_CACHE)", "is a file")
    assert (tmp_path / "afile").read_text() == "keep"


def test_a_model_path_that_is_a_file_or_a_run_folder_says_what_to_give(tmp_path):
    from kv4rl.models.hf_weights import ModelFolderError, read_model_args

    (tmp_path / "afile").write_text("")
    with pytest.raises(ModelFolderError, match="is a file; give the folder holding config.json"):
        read_model_args(tmp_path / "afile")
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_000004").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter_000004\n")
    with pytest.raises(ModelFolderError, match="is a run folder, not a model folder") as info:
        read_model_args(run)
    assert str(run / "checkpoints" / "iter_000004") in str(info.value)


def test_cached_build_refuses_a_cache_under_a_file_before_building(tmp_path):
    from kv4rl.models.cache_install import cached_build

    (tmp_path / "afile").write_text("keep")
    built = []
    with pytest.raises(ValueError, match="is a file"):
        cached_build(tmp_path / "afile" / "cache", "tag", built.append, lambda p: False, "a test build")
    assert not built and (tmp_path / "afile").read_text() == "keep"


def test_a_refusal_leaves_no_json_folder_behind(no_work, tmp_path):
    """Each of these refused only after `--json`'s missing folder had been made, leaving it empty."""
    import torch

    from kv4rl.kernels import kernels_usable

    cases = [["bench", "generate", "--shape", "qwen3-tiny", "--scheduling", "auto,sync"],
             ["bench", "iteration", "--shape", "qwen3-tiny", "--max-len", "24", "--median-len", "6",
              "--attention", "flex"],
             ["sim", "correction-variance", "--n-prompts", "0"]]
    if not torch.cuda.is_available():
        cases += [["bench", "decode-attn"], ["bench", "decode-forward"]]
        if not kernels_usable("cpu"):
            cases.append(["bench", "iteration", "--shape", "qwen3-tiny", "--max-len", "24", "--median-len", "6",
                          "--fused-logprobs"])
    for i, args in enumerate(cases):
        refused([*args, "--json", str(tmp_path / f"out{i}" / "r.json")])
    assert not list(tmp_path.iterdir())


def test_a_home_path_in_a_config_key_is_expanded(monkeypatch, tmp_path):
    """`model.path=~/x` is one word to the shell, which leaves its `~` alone: the folder was "not found"."""
    from kv4rl.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(overrides=["model.path=~/models/m", "data.train=~/d.jsonl", "data.eval=~/e.jsonl",
                                 "out_dir=~/runs"])
    assert (cfg.model.path, cfg.data.train, cfg.data.eval, cfg.out_dir) == (
        f"{tmp_path}/models/m", f"{tmp_path}/d.jsonl", f"{tmp_path}/e.jsonl", f"{tmp_path}/runs")
    monkeypatch.chdir(tmp_path)  # only a leading ~ (the path is then made absolute, from the working folder)
    assert load_config(overrides=["data.train=gsm8k~x.jsonl"]).data.train == f"{tmp_path}/gsm8k~x.jsonl"


def test_library_warnings_read_like_the_clis_own(capsys):
    """`train` printed a library warning as `kv4rl.rollout.build: ...` where `eval` printed `warning: ...`."""
    import logging

    from kv4rl.cli_common import _LogLines

    record = logging.LogRecord("kv4rl.rollout.build", logging.WARNING, __file__, 1, "cut to %d tokens", (8,), None)
    assert _LogLines().format(record) == "warning: cut to 8 tokens"
    record = logging.LogRecord("kv4rl.engine.llm", logging.INFO, __file__, 1, "engine plan", (), None)
    assert _LogLines().format(record) == "kv4rl.engine.llm: engine plan"


def test_an_unquoted_template_override_is_told_to_be_quoted():
    """`data.prompt_template=Problem: {problem}` is YAML for a mapping; the error showed the mapping only."""
    from kv4rl.config import ConfigError, load_config

    import re
    import shlex

    for value in ("Problem: {problem}", "{problem}"):
        with pytest.raises(ConfigError, match=r"data\.prompt_template: .* quote it") as refused:
            load_config(overrides=[f"data.prompt_template={value}"])
        # the hint's command-line form, as the shell hands it over, is then read as the text it shows
        typed = re.search(r'on the command line (".*?")', str(refused.value)).group(1)
        assert load_config(overrides=shlex.split(typed)).data.prompt_template == "Q: {problem}"
        assert "in a config file prompt_template: 'Q: {problem}'" in str(refused.value)
    assert load_config(overrides=["data.prompt_template='Q: {problem}'"]).data.prompt_template == "Q: {problem}"
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=["trainer.lr=[1]"])
    assert "quote it" not in str(refused.value)  # a number key is not told to quote


def test_eval_makes_no_output_folder_when_its_data_is_refused(tmp_path):
    """`--json sub/x.json` with a data file missing a field: the error came after `sub/` was made."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1", "answer": "2"}\n')
    refused(["eval", "--data", str(rows), "--json", str(tmp_path / "sub" / "x.json"),
             "--samples", str(tmp_path / "other" / "s.jsonl")], "missing field 'problem'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


@pytest.mark.parametrize("local_rank, printed", [("0", True), ("1", False), ("3", False)])
def test_under_torchrun_a_config_error_is_printed_by_each_hosts_first_rank_only(monkeypatch, local_rank, printed):
    """Every rank finds the same bad key; four copies of one line hid the launcher's own summary."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    result = runner.invoke(app, ["train", "trainer.no_such_key=1"])
    assert result.exit_code == 2
    assert ("no_such_key" in result.output) is printed
    assert ("error" in result.output) is printed


@pytest.mark.parametrize("setting", ["engine.sampler=triton", "engine.attention_backend=triton",
                                     "engine.prefill_backend=triton", "engine.fused_ops=true"])
def test_train_refuses_a_kernel_setting_that_cannot_run_here_before_loading_the_model(no_work, monkeypatch, setting,
                                                                                      tmp_path):
    """On a CPU without the Triton interpreter: refused only once the engine was built, after the learner had
    loaded the model (minutes at 8B)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    refused(["train", f"out_dir={tmp_path}", "device=cpu", setting, "--no-progress"],
            f"{setting} cannot run here: it needs Triton and a CUDA device")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("setting", ["engine.num_kv_blocks=1000000000000", "engine.kv.block_size=1073741824"])
def test_a_kv_pool_larger_than_memory_is_one_error_naming_its_settings(tmp_path, setting):
    """It was the allocator's traceback ("DefaultCPUAllocator: can't allocate memory: you tried to allocate
    549755813888 bytes"), naming no setting."""
    text = refused(["train", f"out_dir={tmp_path}", "device=cpu", "rollout.quota_groups=2", "rollout.group_size=2",
                    setting, "--no-progress"], "does not fit in cpu memory: lower engine.num_kv_blocks")
    assert "blocks x" in text and not any(tmp_path.iterdir())


def test_eval_gives_math_verify_the_reward_timeout_and_records_it(tmp_path, monkeypatch):
    """`kv4rl eval` always ran math_verify with its default 5 s while training used reward.timeout_s, so a
    run's checkpoint could score otherwise than its in-training eval; `--reward-timeout` gives the run's."""
    import kv4rl.rewards

    real, built = kv4rl.rewards.get_reward, []

    def spy(name, **options):
        built.append((name, options))
        return real(name, **options)

    monkeypatch.setattr(kv4rl.rewards, "get_reward", spy)
    data = tmp_path / "sums.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n')
    refused(["eval", "--data", str(data), "--reward-timeout", "0"], "--reward-timeout must be > 0, got 0")
    out = tmp_path / "out.json"
    res = runner.invoke(app, ["eval", "--data", str(data), "--template", "{problem}=", "--k", "1", "--max-new-tokens",
                              "2", "--device", "cpu", "--reward-timeout", "0.5", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert built == [("math_verify", {"timeout_s": 0.5})]
    assert json.loads(out.read_text())["reward_timeout_s"] == 0.5
    built.clear()
    res = runner.invoke(app, ["eval", "--data", str(data), "--template", "{problem}=", "--k", "1", "--max-new-tokens",
                              "2", "--device", "cpu", "--reward", "exact", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert built == [("exact", {})] and "reward_timeout_s" not in json.loads(out.read_text())


def test_a_bad_eval_file_is_named_before_the_embedded_model_is_built(tmp_path, monkeypatch):
    """Without a model given, `data.eval` (train without data.train) and `eval --data` were read only after the
    embedded model was built (~30 s on an empty cache)."""
    monkeypatch.setattr(importlib.import_module("kv4rl.loop"), "resolve_model_dir", _work_started)
    monkeypatch.setattr(importlib.import_module("kv4rl.models.tiny"), "tiny_model_dir", _work_started)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    refused(["train", f"out_dir={tmp_path / 'runs'}", "device=cpu", f"data.eval={bad}", "--no-progress"],
            f"{bad}:2: missing field 'answer'")
    refused(["eval", "--data", str(bad), "--device", "cpu"], f"{bad}:2: missing field 'answer'")
    assert not (tmp_path / "runs").exists()


def test_sim_clip_bias_draws_past_memory_are_one_error_naming_samples(tmp_path):
    """It was the allocator's traceback (800 GB asked for)."""
    refused(["sim", "clip-bias", "--samples", "100000000000", "--json", str(tmp_path / "c.json")],
            "--samples 100000000000: the draws do not fit in this machine's memory")
    assert not any(tmp_path.iterdir())


def test_eval_says_when_n_is_past_the_files_problems(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n')
    res = runner.invoke(app, ["eval", "--data", str(data), "--template", "{problem}=", "--k", "1", "--n", "5",
                              "--max-new-tokens", "2", "--device", "cpu", "--reward", "exact"])
    assert res.exit_code == 0, res.output
    assert f"warning: --n 5: {data} holds 2 problems; evaluating all 2" in " ".join(res.output.split())


@pytest.mark.parametrize("args, said", [
    (["sim", "clip-bias", "--rho", "nan"], "error: Invalid value for '--rho': Value error, 'nan' is not a finite number "
                                            "(python -m kv4rl.cli sim clip-bias --help shows its usage)"),
    (["train", "--bogus"], "error: No such option: --bogus"),
    (["eval", "--k", "x"], "error: Invalid value for '--k'"),
])
def test_an_option_the_command_line_parser_refuses_is_one_error_line(args, said):
    """The `kv4rl` command (main): typer's boxed usage block (five lines) is one `error:` line, exit 2, as every
    other refused input is; a run's Ctrl-C and its exit statuses are unchanged (tests/test_signals.py)."""
    import subprocess
    import sys
    from pathlib import Path

    import kv4rl

    env = dict(os.environ, PYTHONPATH=str(Path(kv4rl.__file__).parents[1]))
    res = subprocess.run([sys.executable, "-m", "kv4rl.cli", *args], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), res.stderr
    ok = subprocess.run([sys.executable, "-m", "kv4rl.cli", "sim", "--help"], env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "clip-bias" in ok.stdout


@pytest.mark.parametrize("group, lists", [([], "train"), (["sim"], "clip-bias"), (["bench"], "decode-attn"),
                                           (["plot"], "rollout-trace")])
def test_a_command_group_alone_prints_its_help_and_no_empty_error_line(group, lists):
    """`kv4rl` and each of its groups alone print their commands, as `git` does (the root and `plot` said
    'Missing command' while `bench` and `sim` printed their help)."""
    import subprocess
    import sys
    from pathlib import Path

    import kv4rl

    env = dict(os.environ, PYTHONPATH=str(Path(kv4rl.__file__).parents[1]))
    res = subprocess.run([sys.executable, "-m", "kv4rl.cli", *group], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and lists in res.stdout and "error" not in res.stderr, res.stderr



@pytest.mark.parametrize("args", [["plot", "curves", "runs/a", "--out", "c.png"],
                                  ["sim", "clip-bias", "--png", "c.png"]])
def test_a_figure_without_matplotlib_is_one_error_naming_the_package(args, monkeypatch, tmp_path):
    """A broken install without matplotlib met a ModuleNotFoundError traceback in the option check."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec and import now see no such package
    refused(args, f"{args[-2]} c.png: figures need matplotlib, which is not installed (pip install matplotlib)")
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal for want of a CUDA device")
def test_bench_decode_attn_without_triton_says_it_needs_cuda(monkeypatch):
    """The CPU torch wheel brings no triton: the command's import of the kernels was a traceback, where
    the other kernel benches say they need a CUDA device."""
    for name in [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "kv4rl.kernels", "kv4rl.bench"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    refused(["bench", "decode-attn", "--shapes", "qwen3-8b", "--batches", "1", "--contexts", "64", "--formats", "bf16"],
            "error: this benchmark times GPU kernels and needs a CUDA device")


def test_version_names_kv4rl_and_the_libraries_it_runs_with():
    from importlib import metadata

    import kv4rl

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"kv4rl {kv4rl.__version__} python ")
    assert f"torch {metadata.version('torch')}" in res.output
    assert f"transformers {metadata.version('transformers')}" in res.output


def test_a_json_result_records_the_software_versions(tmp_path):
    """Only two benches recorded torch's version; a number from another torch or triton release could not be
    told apart. Reference: the installed distributions' metadata."""
    from importlib import metadata

    out = tmp_path / "c.json"
    res = runner.invoke(app, ["sim", "clip-bias", "--samples", "200", "--json", str(out)])
    assert res.exit_code == 0, res.output
    versions = json.loads(out.read_text())["versions"]
    assert versions["torch"] == metadata.version("torch") and versions["transformers"] == metadata.version("transformers")


def test_a_recipe_outside_the_source_tree_is_named_as_the_source_trees(tmp_path, monkeypatch):
    """The README's `--config recipes/...` works from a checkout's root; from elsewhere (an installed wheel)
    the error said only 'not found'."""
    monkeypatch.chdir(tmp_path)
    refused(["train", "--config", "recipes/baseline_clean.yaml", "--print-config"],
            "config file not found: recipes/baseline_clean.yaml (the recipes are in kv4rl's source tree, not in "
            "an installed package")
    refused(["train", "--config", "mine.yaml", "--print-config"], "config file not found: mine.yaml")
