"""`kv4rl eval` of a run's checkpoint says where it prompts unlike the run did (its chat template, its prompt
template): an instruct model trained with its chat template answers badly without it, and eval reads only
its own options."""

import pytest

from kv4rl.cli_eval import _prompting_differences


def _run_with(tmp_path, data_yaml: str):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "iter_000002").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: r\ndata:\n{data_yaml}")
    return run / "checkpoints" / "iter_000002"


def test_a_checkpoint_of_a_chat_run_evaluated_without_the_chat_template_is_told(tmp_path):
    ckpt = _run_with(tmp_path, '  chat_template: true\n  prompt_template: "Q: {problem}\\nA:"\n')
    (chat_line, template_line) = _prompting_differences(ckpt, chat=False, template=None)
    assert chat_line.startswith("its run prompted with the tokenizer's chat template (data.chat_template: true in ")
    assert chat_line.endswith("pass --chat to evaluate it as it was trained")
    assert template_line.startswith("its run prompted with data.prompt_template 'Q: {problem}\\nA:'")
    assert _prompting_differences(ckpt, chat=True, template="Q: {problem}\nA:") == []


def test_a_run_without_the_chat_template_evaluated_with_it_and_plain_model_folders_are_told_nothing_else(tmp_path):
    ckpt = _run_with(tmp_path, "  chat_template: false\n")
    (line,) = _prompting_differences(ckpt, chat=True, template=None)
    assert "prompted without the tokenizer's chat template" in line and "pass --no-chat" in line
    assert _prompting_differences(ckpt, chat=False, template=None) == []
    assert _prompting_differences(tmp_path, chat=True, template=None) == []  # not a run's checkpoint
    broken = _run_with(tmp_path / "b", "  chat_template: [unclosed\n")
    assert _prompting_differences(broken, chat=True, template=None) == []  # unreadable: nothing to compare


def test_a_template_given_to_eval_is_compared_with_the_runs_default_template(tmp_path):
    """A run on its default template (data.prompt_template: null) evaluated with another --template was told
    nothing: only a template the run named was compared."""
    from kv4rl.data.source import BOXED_INSTRUCTION

    embedded = _run_with(tmp_path / "e", "  prompt_template: null\n")
    (line,) = _prompting_differences(embedded, chat=False, template="Q {problem}=")
    assert line.startswith("its run prompted with the default template '{problem}=' (data.prompt_template: null in ")
    assert line.endswith("--template 'Q {problem}=' prompts it otherwise")
    assert _prompting_differences(embedded, chat=False, template="{problem}=") == []
    on_files = _run_with(tmp_path / "f", "  train: math.jsonl\n")
    assert _prompting_differences(on_files, chat=False, template=BOXED_INSTRUCTION) == []
    (line,) = _prompting_differences(on_files, chat=False, template="{problem}=")
    assert "the default template 'Please" not in line and repr(BOXED_INSTRUCTION) in line


def test_eval_prompting_by_its_own_default_unlike_the_runs_default_is_told(tmp_path):
    """A run on the embedded task ('{problem}=') evaluated on a data file (eval's default there: the boxed
    instruction) was told nothing, though --template with that same text was."""
    from kv4rl.data.source import BOXED_INSTRUCTION

    embedded = _run_with(tmp_path / "e", "  prompt_template: null\n")
    (line,) = _prompting_differences(embedded, chat=False, template=None, eval_template=BOXED_INSTRUCTION)
    assert line.startswith("its run prompted with the default template '{problem}=' (data.prompt_template: null in ")
    assert f"eval prompts with its default here, {BOXED_INSTRUCTION!r}: pass --template" in line
    assert _prompting_differences(embedded, chat=False, template=None, eval_template="{problem}=") == []
    on_files = _run_with(tmp_path / "f", "  eval: math.jsonl\n")  # trained on the boxed instruction
    (line,) = _prompting_differences(on_files, chat=False, template=None, eval_template="{problem}=")
    assert repr(BOXED_INSTRUCTION) in line and "eval prompts with its default here, '{problem}='" in line


def test_a_run_template_eval_prompts_with_by_default_is_no_difference(tmp_path):
    """The run named, as its data.prompt_template, the template eval uses by default: nothing differs."""
    from kv4rl.data.source import BOXED_INSTRUCTION

    import yaml

    ckpt = _run_with(tmp_path, "")
    (tmp_path / "runs" / "r" / "config.yaml").write_text(yaml.safe_dump({"data": {"prompt_template": BOXED_INSTRUCTION}}))
    assert _prompting_differences(ckpt, chat=False, template=None, eval_template=BOXED_INSTRUCTION) == []
    (line,) = _prompting_differences(ckpt, chat=False, template=None, eval_template="{problem}=")
    assert line.startswith("its run prompted with data.prompt_template ")


def test_eval_takes_a_reward_plug_in_through_plugins(tmp_path, monkeypatch):
    """A run trained with a plug-in reward is evaluated with it: `--plugins` imports the module, as train's
    algo.plugins does. Its reward scores every sample 1, so mean@2 is 1 (the tiny model's own is below)."""
    import json

    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.rewards import base

    (tmp_path / "half_reward.py").write_text(
        "from kv4rl.rewards import RewardResult, register_reward\n"
        "register_reward('all_right')(lambda: lambda responses, golds: RewardResult([1.0] * len(responses), {}))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["eval", "--plugins", "half_reward", "--reward", "all_right", "--n", "8", "--k", "2",
                              "--json", "out.json"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.json").read_text())["mean@2"] == 1.0
    res = runner.invoke(app, ["eval", "--plugins", "no_such_plugin_module", "--n", "2"])
    assert res.exit_code == 2 and "--plugins: cannot import 'no_such_plugin_module'" in " ".join(res.output.split())
    # the option repeated: each module imported (the last alone was, the earlier dropped without a word)
    res = runner.invoke(app, ["eval", "--plugins", "no_such_plugin_module", "--plugins", "half_reward", "--n", "2"])
    assert res.exit_code == 2 and "--plugins: cannot import 'no_such_plugin_module'" in " ".join(res.output.split())
    sys_modules = __import__("sys").modules
    sys_modules.pop("half_reward", None)


def test_greedy_eval_with_several_samples_is_told_they_are_one(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kv4rl.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["eval", "--temperature", "0", "--k", "2", "--n", "2"])
    assert res.exit_code == 0 and "a problem's 2 samples are the same, so pass@j equals pass@1" in " ".join(
        res.output.split()), res.output
    res = runner.invoke(app, ["eval", "--temperature", "0", "--k", "1", "--n", "2"])
    assert res.exit_code == 0 and "samples greedily" not in res.output


def test_eval_of_a_runs_latest_file_evaluates_the_checkpoint_it_names(tmp_path):
    """`checkpoints/latest`, which the README calls the newest checkpoint, was refused as 'a file'."""
    import json
    import shutil

    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.models.hf_weights import ModelFolderError, read_model_args
    from kv4rl.models.tiny import tiny_model_dir

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    shutil.copytree(tiny_model_dir(), ckpts / "iter_000002")
    (ckpts / "latest").write_text("iter_000002")
    out = tmp_path / "out.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(ckpts / "latest"), "--n", "2", "--k", "1",
                                   "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    written = json.loads(out.read_text())
    assert written["model"] == str(ckpts / "iter_000002")
    from importlib import metadata  # eval's JSON is written apart from the benches': it records them too

    assert written["versions"]["torch"] == metadata.version("torch")
    with pytest.raises(ModelFolderError, match=r"names a run's newest checkpoint; give the checkpoint: .*iter_000002"):
        read_model_args(ckpts / "latest")  # as model.path of a run: the checkpoint named in the error


@pytest.mark.parametrize("prunes", [1, 3])
def test_eval_of_latest_loads_the_newest_again_when_the_run_prunes_the_one_it_was_loading(tmp_path, monkeypatch,
                                                                                        prunes):
    """A run that keeps its last checkpoints (`checkpoint.keep_last`) removed the one `latest` named while
    `kv4rl eval --model .../latest` loaded it: 'model folder ... does not exist', '... no *.safetensors weight
    files' or a Hugging Face repo-id error, by the moment. Here each load sees the run save the next
    checkpoint, repoint `latest` and delete the old one (as its saves do) before reading: the eval takes
    the newest, or after three such loads says what happened."""
    import json
    import shutil

    from typer.testing import CliRunner

    import kv4rl.cli_eval as cli_eval
    from kv4rl.cli import app
    from kv4rl.models.tiny import tiny_model_dir

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    shutil.copytree(tiny_model_dir(), ckpts / "iter_000002")
    (ckpts / "latest").write_text("iter_000002")
    real_load, loads = cli_eval._load, []

    def pruned_while_loading(engine_cfg, ranks, model, *args):
        loads.append(model.name)
        if len(loads) <= prunes:  # the run's next save
            newest = ckpts / f"iter_{2 + 2 * len(loads):06d}"
            shutil.copytree(model, newest)
            (ckpts / "latest").write_text(newest.name)
            shutil.rmtree(model)
        return real_load(engine_cfg, ranks, model, *args)

    monkeypatch.setattr(cli_eval, "_load", pruned_while_loading)
    out = tmp_path / "out.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(ckpts / "latest"), "--n", "2", "--k", "1",
                                   "--device", "cpu", "--json", str(out)])
    text = " ".join(res.output.split())
    if prunes == 1:
        assert res.exit_code == 0, res.output
        assert loads == ["iter_000002", "iter_000004"]
        assert json.loads(out.read_text())["model"] == str(ckpts / "iter_000004")
        assert "iter_000002 was removed by the run writing it (checkpoint.keep_last)" in text
    else:
        assert res.exit_code == 2 and not out.exists(), res.output
        assert loads == ["iter_000002", "iter_000004", "iter_000006"]
        assert "iter_000006 was removed while it loaded: the run writing" in text and "keep_last" in text, text


def test_eval_of_a_latest_that_names_a_missing_checkpoint_says_so(tmp_path):
    """`latest` naming a folder that is gone (deleted by hand, a copy without it): the eval said three times
    that the run pruned it while it loaded, and to run again, which failed the same way."""
    import shutil

    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.models.tiny import tiny_model_dir

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    shutil.copytree(tiny_model_dir(), ckpts / "iter_000002")
    (ckpts / "latest").write_text("iter_000009")
    res = CliRunner().invoke(app, ["eval", "--model", str(ckpts / "latest"), "--n", "2", "--k", "1",
                                   "--device", "cpu"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert f"{ckpts / 'latest'} names iter_000009, which is not in {ckpts} (deleted or moved?)" in text, text
    assert "removed" not in text and "keep_last" not in text


def test_eval_outputs_may_not_land_in_the_model_or_a_runs_files(tmp_path):
    """`--json <model>/config.json` replaced the evaluated model's config, `--json <run>/metrics.jsonl` a run's
    training log and `--samples <run>/checkpoints/latest` its pointer: each is refused before any work, the files
    unchanged. Files that are none of theirs are fine to name."""
    import shutil

    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.models.tiny import tiny_model_dir

    run = tmp_path / "runs" / "r"
    ckpts = run / "checkpoints"
    shutil.copytree(tiny_model_dir(), ckpts / "iter_000002")
    (ckpts / "latest").write_text("iter_000002")
    (run / "config.yaml").write_text("trainer: {}\n")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), model)
    before = {p: p.read_bytes() for p in (model / "config.json", run / "metrics.jsonl", ckpts / "latest")}
    for args, said in (
        (["--model", str(model), "--json", str(model / "config.json")], "is a file of the model folder --model"),
        (["--model", str(model), "--samples", str(model / "new.safetensors")], "is a file of the model folder --model"),
        (["--model", str(ckpts / "latest"), "--json", str(run / "metrics.jsonl")], "is the metrics.jsonl of the run"),
        (["--model", str(model), "--samples", str(ckpts / "latest")], "inside the checkpoints/ of run"),
    ):
        res = CliRunner().invoke(app, ["eval", "--n", "2", "--k", "1", "--device", "cpu", *args])
        assert res.exit_code == 2 and said in res.output, (args, res.output)
    assert {p: p.read_bytes() for p in before} == before and not (model / "new.safetensors").exists()
    # beside a run's files, beside the model's (which loads only its own), a run file's name in a folder that holds
    # no run (a project's own config.yaml, no metrics.jsonl), twice in the working directory: fine
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("trainer: {}\n")
    for out in (run / "eval.json", model / "eval.json", project / "rollout_trace.jsonl", tmp_path / "metrics.jsonl",
                tmp_path / "metrics.jsonl"):
        res = CliRunner().invoke(app, ["eval", "--model", str(model), "--n", "2", "--k", "1", "--device", "cpu",
                                       "--json", str(out)])
        assert res.exit_code == 0 and out.is_file(), (out, res.output)


def test_eval_refuses_one_data_file_given_twice_and_says_a_gguf_file_needs_converting(tmp_path):
    """`--data a.jsonl --data ./a.jsonl` counted its problems twice; a GGUF file as --model got the plain 'is a file'."""
    from typer.testing import CliRunner

    from kv4rl.cli import app

    data = tmp_path / "a.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    res = CliRunner().invoke(app, ["eval", "--data", str(data), "--data", str(tmp_path / "." / "a.jsonl"), "--n", "1",
                                   "--k", "1", "--device", "cpu"])
    assert res.exit_code == 2 and "is given twice" in res.output, res.output
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    res = CliRunner().invoke(app, ["eval", "--model", str(gguf), "--n", "1", "--k", "1", "--device", "cpu"])
    assert res.exit_code != 0 and "GGUF file is not read directly" in res.output, res.output


def test_a_failing_reward_in_eval_is_one_line_and_its_traceback_on_request(tmp_path, monkeypatch):
    """eval printed a reward's KeyError as one line pointing at `kv4rl train -v`, an option eval has not, and hid
    the traceback even with KV4RL_TRACEBACK=1: the line now names the variable, which brings the traceback back."""
    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.rewards import base

    (tmp_path / "bad_reward_mod.py").write_text(
        "from kv4rl.rewards import register_reward\n"
        "register_reward('bad_reward')(lambda: lambda responses, golds: {}['missing'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delenv("KV4RL_TRACEBACK", raising=False)
    args = ["eval", "--plugins", "bad_reward_mod", "--reward", "bad_reward", "--n", "2", "--k", "1"]
    res = CliRunner().invoke(app, args)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "reward 'bad_reward' raised KeyError scoring" in text and "KV4RL_TRACEBACK=1" in text
    monkeypatch.setenv("KV4RL_TRACEBACK", "1")
    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, base.RewardFailed) and isinstance(res.exception.__cause__, KeyError)
    __import__("sys").modules.pop("bad_reward_mod", None)
