"""The `kv4rl` command: eval on the embedded model, and bad input reported before any work."""

import json

from typer.testing import CliRunner

from kv4rl.cli import app

runner = CliRunner()


def test_eval_reports_mean_and_pass_at_k(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", "--data", str(data), "--k", "4", "--reward", "exact",
                              "--template", "{problem}=", "--max-new-tokens", "12", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["num_problems"] == 16 and r["k"] == 4
    assert 0 <= r["mean@4"] <= r["pass@2"] <= r["pass@4"] <= 1 and r["pass@1"] == r["mean@4"]


def test_malformed_dataset_row_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    res = runner.invoke(app, ["train", f"data.train={data}", f"out_dir={tmp_path}", "--no-progress"])
    assert res.exit_code == 2
    assert "bad.jsonl:2" in res.output and "answer" in res.output


def test_missing_model_folder_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["train", f"model.path={tmp_path / 'nope'}", f"out_dir={tmp_path}", "--no-progress"])
    assert res.exit_code == 2 and "nope" in res.output


def test_unknown_kv_format_and_unknown_key(tmp_path):
    res = runner.invoke(app, ["train", "engine.kv.format=int3", f"out_dir={tmp_path}", "--no-progress"])
    assert res.exit_code == 2 and "engine.kv.format" in res.output
    res = runner.invoke(app, ["train", "trainer.lrr=1", f"out_dir={tmp_path}"])
    assert res.exit_code == 2 and "trainer.lrr" in res.output


def test_kv_pool_too_small_for_one_request(tmp_path):
    res = runner.invoke(app, ["train", "engine.num_kv_blocks=1", "engine.kv.block_size=4", f"out_dir={tmp_path}",
                              "--no-progress"])
    assert res.exit_code == 2 and "KV pool too small" in res.output
    assert not (tmp_path / "tiny-arith" / "checkpoints").exists()


def test_eval_accepts_engine_kv_settings(tmp_path):
    out = tmp_path / "r.json"
    args = ["eval", "--n", "8", "--k", "2", "--json", str(out), "engine.kv.format=kv4", "engine.kv.group_size=32",
            "engine.kv.n_sink=2", "engine.kv.n_recent=6"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["num_problems"] == 8
    res = runner.invoke(app, ["eval", "--n", "4", "engine.kv.format=kv4"])
    assert res.exit_code == 2 and "engine.kv." in res.output  # the defaults do not fit this tiny model
    res = runner.invoke(app, ["eval", "--n", "4", "trainer.lr=1"])
    assert res.exit_code == 2 and "engine" in res.output


def test_every_help_text_shows_as_written():
    """Typer renders help through rich markup: a '[@...]' or '[word]' span would vanish from --help (the
    `--arms` help lost its '@slots' syntax that way). Escaped brackets ('\\[') show as '['."""
    import typer
    from rich.markup import render

    from kv4rl.cli import app

    stack, hidden = [("kv4rl", typer.main.get_command(app))], []
    while stack:
        path, command = stack.pop()
        stack += [(f"{path} {name}", sub) for name, sub in getattr(command, "commands", {}).items()]
        for name, text in [("", command.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in command.params]:
            if render(text).plain != text.replace("\\[", "["):
                hidden.append(f"{path} {name}")
    assert not hidden


def test_ctrl_c_says_so_and_names_the_json_that_holds_part_of_the_results(tmp_path, monkeypatch, capsys):
    """typer turned Ctrl-C into a silent exit 130, while the --json file held only the rows finished so far."""
    import sys

    import pytest

    from importlib import import_module
    from kv4rl.cli import main

    def interrupted(plan, progress=None, on_result=None):
        on_result({"complete": False, "results": [{"format": "bf16", "mode": "sync", "rollout_s": 1.0}]})
        raise KeyboardInterrupt

    monkeypatch.setattr(import_module("kv4rl.bench.rollout"), "bench_rollout", interrupted)
    out = tmp_path / "r.json"
    out.write_text('{"mine": 1}\n')
    monkeypatch.setattr(sys, "argv", ["kv4rl", "bench", "rollout", "--shape", "qwen3-tiny", "--device", "cpu",
                                      "--json", str(out)])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 130
    assert f'interrupted (Ctrl-C): {out} holds the rows finished before it ("complete": false)' in capsys.readouterr().err
    assert json.loads(out.read_text())["complete"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # written whole, through a temporary file


def test_a_sigterm_to_a_bench_says_which_json_holds_part_of_its_rows(tmp_path, monkeypatch, capsys):
    """A scheduler's time limit (SIGTERM) ended eval and the benches at once (exit 143), with nothing said of the
    partial --json they keep, where Ctrl-C names it."""
    import os
    import signal
    import sys
    import time

    import pytest

    from importlib import import_module
    from kv4rl.cli import main

    def terminated(plan, progress=None, on_result=None):
        on_result({"complete": False, "results": [{"format": "bf16", "mode": "sync", "rollout_s": 1.0}]})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises out of it
        raise AssertionError("the SIGTERM did not stop the command")

    monkeypatch.setattr(import_module("kv4rl.bench.rollout"), "bench_rollout", terminated)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["kv4rl", "bench", "rollout", "--shape", "qwen3-tiny", "--device", "cpu",
                                      "--json", str(out)])
    # a `kv4rl train` run in this process earlier holds SIGTERM for its start-up (`catch_early`): a command
    # process starts with the default action
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as stopped:
            main()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the command's handler is gone with it
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert f'terminated (SIGTERM): {out} holds the rows finished before it ("complete": false)' in capsys.readouterr().err
    assert json.loads(out.read_text())["complete"] is False


def test_every_option_of_every_command_says_what_it_does():
    """`--help` listed options with no text at all (e.g. `--seed`, `--device`, `eval --temperature`)."""
    import click
    import typer

    from kv4rl.cli import app

    missing = []

    def walk(command, path):
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, [*path, name])
        for param in getattr(command, "params", []):
            if isinstance(param, click.Option) and not param.help:
                missing.append(f"{' '.join(path)} {param.opts[0]}")

    walk(typer.main.get_command(app), ["kv4rl"])
    assert not missing, missing
