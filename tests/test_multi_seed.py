"""`kv4rl train --seeds`: one folder per seed with its own seed and log, every folder checked before any
seed starts, and a non-zero exit with a table when a seed fails."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kv4rl.cli import app
from tests.small_runs import tree_state

TEST_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "testbed_longmul_test.yaml"  # any cwd

pytestmark = pytest.mark.slow  # the seeds are child processes (~10 s each to start on 2 cores)
runner = CliRunner()
TINY = ["--config", str(TEST_RECIPE), "trainer.iterations=1", "rollout.max_new_tokens=32",
        "data.eval_size=2", "name=ms"]


def seeds_cli(out_dir, *args: str):
    return runner.invoke(app, ["train", *TINY, f"out_dir={out_dir}", *args])


def test_two_seeds_run_into_their_own_folders(testbed_cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KV4RL_CACHE", str(testbed_cache[0]))
    res = seeds_cli(tmp_path, "--seeds", "0,1", "--parallel", "2")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ms-s0", "ms-s1"]  # logs moved into the folders
    seeds = [yaml.safe_load((tmp_path / f"ms-s{s}" / "config.yaml").read_text())["seed"] for s in (0, 1)]
    assert seeds == [0, 1]
    for s in (0, 1):
        assert (tmp_path / f"ms-s{s}" / "metrics.jsonl").read_text().count("\n") == 1
        assert "run " in (tmp_path / f"ms-s{s}" / "train.log").read_text()  # the child's own summary table
    text = " ".join(res.output.split())
    assert text.count("finished") >= 2 and "2 seeds, 2 at a time" in text


def test_an_existing_run_for_one_seed_stops_every_seed_before_any_work(tmp_path) -> None:
    held = tmp_path / "ms-s1"
    held.mkdir()
    (held / "config.yaml").write_text("seed: 1\n")
    (held / "metrics.jsonl").write_text('{"iteration": 0}\n')
    before = tree_state(tmp_path)
    res = seeds_cli(tmp_path, "--seeds", "0,1")
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert f"{held} already holds a run" in text
    # the sweep's hint, seed by seed (a --resume of both failed: seed 0 has no folder, seed 1 no checkpoint)
    assert "start seed 0 with the command that started the sweep (not --resume), given --seeds 0" in text
    assert "seed 1 has a run but no checkpoint: start it again with the command that started the sweep, --seeds 1 and --overwrite" in text
    assert tree_state(tmp_path) == before  # seed 0 did not start either


def test_a_failing_seed_fails_the_command_with_a_table(testbed_cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KV4RL_CACHE", str(testbed_cache[0]))
    res = seeds_cli(tmp_path, "--seeds", "3,4", "--parallel", "2", "engine.num_kv_blocks=1", "engine.kv.block_size=4")
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert text.count("failed (exit 2)") >= 2 and "seeds 3, 4 failed" in text
    # what each failed seed's folder allows, as after a stop (a seed killed past a checkpoint: --resume)
    assert "then: start seeds 3,4 with the command that started the sweep (not --resume), given --seeds 3,4" in text
    # neither started, so no folder; each log stays beside and says why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ms-s3.log", "ms-s4.log"]
    assert "num_kv_blocks" in (tmp_path / "ms-s3.log").read_text()


def test_a_name_yaml_would_cut_at_a_comment_names_each_seeds_folder_whole(tmp_path) -> None:
    """`name: "exp #1"` in a config: the sweep's own name override was read as `exp` plus a comment (both seeds
    into runs/exp before the comment check; refused with a hint the user could not follow after it)."""
    from kv4rl import multi_seed

    config = tmp_path / "c.yaml"
    config.write_text(f'name: "exp #1"\nout_dir: {tmp_path / "runs"}\n')
    runs = multi_seed.plan_runs([0, 1], config, [], None, False, [])
    assert [r.cfg.run_dir for r in runs] == [tmp_path / "runs" / "exp #1-s0", tmp_path / "runs" / "exp #1-s1"]


def test_bad_seed_options_are_refused_before_any_work(tmp_path) -> None:
    for args, needle in [(["--seeds", "0,x"], "--seeds: 'x' is not an integer"),
                         (["--seeds", "1,1"], "'1' is given twice"),
                         (["--seeds", "-1"], "--seeds: every value must be >= 0"),
                         (["--seeds", "0,1", "--parallel", "0"], "--parallel must be >= 1"),
                         (["--parallel", "2"], "give --seeds too"),
                         (["--seeds", "0", "--resume", str(tmp_path / "ms")], "ms-s0: no such folder")]:
        res = seeds_cli(tmp_path, *args) if "--resume" not in args else \
            runner.invoke(app, ["train", *args])
        assert res.exit_code == 2, (args, res.output)
        assert needle in " ".join(res.output.split()), (args, res.output)
    assert list(tmp_path.iterdir()) == []


def test_seeds_sharing_a_gpu_each_get_a_share_counted_against_their_own_memory(monkeypatch) -> None:
    """On CUDA, N seeds at once: each gets gpu_memory_fraction / N with gpu_memory_scope=process, so the
    ones that start last do not count the others' memory as their own; on the CPU nothing is added."""
    from kv4rl import multi_seed
    from kv4rl.config import load_config

    def runs(device):
        return [multi_seed.SeedRun(s, load_config(None, [f"device={device}", "engine.gpu_memory_fraction=0.6"]),
                                   [f"seed={s}"], None) for s in range(3)]

    monkeypatch.setattr("kv4rl.engine.placement.resolve_device", lambda name: torch.device(name))
    cuda = runs("cuda")
    multi_seed.share_device(cuda, 3)
    assert all(r.args == [f"seed={r.seed}", "engine.gpu_memory_fraction=0.2000", "engine.gpu_memory_scope=process"]
               for r in cuda)
    cpu = runs("cpu")
    multi_seed.share_device(cpu, 3)
    assert all(r.args == [f"seed={r.seed}"] for r in cpu)


def test_a_signal_stops_the_sweep_the_waiting_seeds_never_start_and_the_hint_resumes_the_saved_ones(
        tmp_path, monkeypatch) -> None:
    """SIGINT during a sweep run one seed at a time: the running seed gets it (and ends as a real run would,
    exit 0), the waiting seed is not started, the table says so, and the hint names both cases."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from kv4rl import multi_seed
    from kv4rl.config import load_config

    started = []

    def fake_start(run):  # a child that, like `kv4rl train`, ends cleanly on SIGINT
        run.log.parent.mkdir(parents=True, exist_ok=True)
        run.log.write_text("")
        run.process = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                        "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
                                        "time.sleep(60)"])
        run.seconds = 0.0
        started.append(run.seed)

    monkeypatch.setattr(multi_seed, "_start", fake_start)
    runs = [multi_seed.SeedRun(s, load_config(None, [f"out_dir={tmp_path}", f"name=sw-s{s}"]), [],
                               tmp_path / f"sw-s{s}.log") for s in (0, 1)]
    (tmp_path / "sw-s0" / "checkpoints").mkdir(parents=True)  # seed 0 saved a checkpoint before the signal
    lines = []
    threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    multi_seed.launch(runs, 1, announce=lines.append)
    assert started == [0]
    assert [multi_seed.status_of(r) for r in runs] == ["stopped (SIGINT)", "not started (SIGINT)"]
    assert "SIGINT: seeds 1 will not start" in lines
    hint = multi_seed.continue_hint(runs)
    assert f"continue seed 0 with: kv4rl train --seeds 0 --resume {shlex.quote(str(tmp_path / 'sw'))}" in hint
    assert "start seed 1 with the command that started the sweep (not --resume), given --seeds 1" in hint


def _writes_a_run(folder) -> str:
    """A child's snippet that makes `folder` a run: a config.yaml and one metrics row (accuracy 0.25)."""
    return (f"import pathlib; d = pathlib.Path({str(folder)!r}); d.mkdir(); (d / 'config.yaml').write_text('x'); "
            "(d / 'metrics.jsonl').write_text('{\"iteration\": 0, \"accuracy\": 0.25}\\n')")


def _fake_child(code: str):
    """A `_start` whose child runs `code` (a Python snippet) instead of `kv4rl train`."""
    import subprocess
    import sys

    from kv4rl import multi_seed

    def start(run):
        run.config_before = multi_seed._config_identity(run.cfg.run_dir)
        run.log.parent.mkdir(parents=True, exist_ok=True)
        run.log.write_text("the child's output\n")
        run.process = subprocess.Popen([sys.executable, "-c", code])
        run.seconds = 0.0

    return start


def test_a_seed_that_never_wrote_its_folder_leaves_whoever_holds_it_alone(tmp_path, monkeypatch) -> None:
    """A user's own run sits in a waiting seed's folder (or --overwrite had an old run there) and the seed's
    child fails before its first iteration: its log was appended to that run's train.log and the table showed
    that run's iterations as the seed's. Now the log stays beside, the table shows none, the folder is as it was."""
    from kv4rl import multi_seed
    from kv4rl.config import load_config

    theirs = tmp_path / "sw-s0"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("seed: 0\n")
    (theirs / "metrics.jsonl").write_text('{"iteration": 0, "accuracy": 0.5}\n{"iteration": 1, "accuracy": 0.75}\n')
    (theirs / "train.log").write_text("their log\n")
    before = tree_state(tmp_path)
    monkeypatch.setattr(multi_seed, "_start", _fake_child("import sys; sys.exit(2)"))
    run = multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0"]), ["seed=0"],
                             tmp_path / "sw-s0.log")
    multi_seed.launch([run], 1, announce=lambda line: None)
    assert run.final_log == tmp_path / "sw-s0.log" and (tmp_path / "sw-s0.log").read_text() == "the child's output\n"
    assert multi_seed.summary_rows([run])[0][2:5] == ["failed (exit 2)", "0", "-"]
    (tmp_path / "sw-s0.log").unlink()
    assert tree_state(tmp_path) == before

    # a child that does write its folder (a new config.yaml) is read when it ends
    monkeypatch.setattr(multi_seed, "_start", _fake_child(_writes_a_run(tmp_path / "sw-s1")))
    mine = multi_seed.SeedRun(1, load_config(None, [f"out_dir={tmp_path}", "name=sw-s1"]), ["seed=1"],
                              tmp_path / "sw-s1.log")
    multi_seed.launch([mine], 1, announce=lambda line: None)
    assert mine.final_log == tmp_path / "sw-s1" / "train.log"
    assert multi_seed.summary_rows([mine])[0][2:5] == ["finished", "1", "0.250"]


def test_a_seed_the_sweeps_signal_killed_is_stopped_not_failed(tmp_path, monkeypatch) -> None:
    """Ctrl-C before a child had set up its own handler (exit 130), or a second signal (killed): the table said
    "failed" and the sweep exited 1 as if the seed had crashed."""
    import os
    import signal
    import threading

    from kv4rl import multi_seed
    from kv4rl.config import load_config

    monkeypatch.setattr(multi_seed, "_start", _fake_child("import time; time.sleep(60)"))
    runs = [multi_seed.SeedRun(s, load_config(None, [f"out_dir={tmp_path}", f"name=sw-s{s}"]), [f"seed={s}"],
                               tmp_path / f"sw-s{s}.log") for s in (0, 1)]
    threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    multi_seed.launch(runs, 1, announce=lambda line: None)
    assert multi_seed.status_of(runs[0]) == f"stopped (SIGINT, exit {-signal.SIGINT})"
    assert multi_seed.failed(runs) == []


def test_a_second_signal_is_reported_and_a_signal_before_the_seeds_start_starts_none(tmp_path, monkeypatch) -> None:
    """A second Ctrl-C killed the running seeds at once, and the sweep still exited 0 (a single run exits 130): launch
    returns the signals it received, which `train --seeds` turns into 128 + the second. A signal while the sweep read
    its configs killed it (exit 143) before `catch_early` covered sweeps: now no seed starts, as a single run stops
    before its first iteration."""
    import os
    import signal
    import threading

    from kv4rl import graceful_stop, multi_seed
    from kv4rl.config import load_config

    monkeypatch.setattr(multi_seed, "_start", _fake_child(
        "import signal, time\nsignal.signal(signal.SIGINT, lambda *a: signal.signal(signal.SIGINT, signal.SIG_DFL))\n"
        "time.sleep(60)"))  # as a run: the first signal is held, the second ends it
    runs = [multi_seed.SeedRun(s, load_config(None, [f"out_dir={tmp_path}", f"name=sw-s{s}"]), [f"seed={s}"],
                               tmp_path / f"sw-s{s}.log") for s in (0, 1)]
    threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    received = multi_seed.launch(runs, 1, announce=lambda line: None)
    assert received == [signal.SIGINT, signal.SIGINT]
    assert runs[0].returncode == -signal.SIGINT and runs[1].process is None
    started = []
    monkeypatch.setattr(multi_seed, "_start", lambda run: started.append(run))
    monkeypatch.setattr(graceful_stop, "_early", "SIGTERM")
    runs = [multi_seed.SeedRun(s, load_config(None, [f"out_dir={tmp_path}", f"name=e-s{s}"]), [f"seed={s}"],
                               tmp_path / f"e-s{s}.log") for s in (0, 1)]
    said = []
    assert multi_seed.launch(runs, 2, announce=said.append) == [signal.SIGTERM]
    assert started == [] and said == ["SIGTERM: seeds 0, 1 will not start"]
    assert [multi_seed.status_of(r) for r in runs] == ["not started (SIGTERM)"] * 2


def test_a_seed_folder_in_use_is_named_with_its_process_and_resumed_seeds_keep_the_child_flags(
        tmp_path, monkeypatch) -> None:
    from kv4rl import multi_seed
    from kv4rl.config import load_config
    from kv4rl.run_folder import FolderInUse

    def in_use(run_dir, overwrite, cfg=None):
        raise FolderInUse(f"{run_dir} is in use (pid 4242)")

    monkeypatch.setattr(multi_seed, "check_new_run", in_use)
    with pytest.raises(FolderInUse, match="pid 4242"):
        multi_seed.plan_runs([0, 1], None, [f"out_dir={tmp_path}", "name=sw"], None, True, ["--no-progress"])
    monkeypatch.setattr(multi_seed, "config_for_resume", lambda folder, overrides: load_config(None, [
        f"out_dir={tmp_path}", f"name={folder.name}"]))
    monkeypatch.setattr("kv4rl.run_setup.find_restore", lambda cfg: SimpleNamespace(state={"iteration": 0}))
    (tmp_path / "sw-s0" / "checkpoints").mkdir(parents=True)
    runs = multi_seed.plan_runs([0], None, [], tmp_path / "sw", False, ["--no-progress", "--verbose"])
    assert runs[0].args == ["--resume", str(tmp_path / "sw-s0"), "--no-progress", "--verbose"]


def test_the_hint_says_what_each_seed_folder_allows(tmp_path) -> None:
    from kv4rl.multi_seed import how_to_go_on

    (tmp_path / "h-s0" / "checkpoints").mkdir(parents=True)
    (tmp_path / "h-s1").mkdir()
    (tmp_path / "h-s1" / "metrics.jsonl").write_text("")
    folders = {s: tmp_path / f"h-s{s}" for s in (0, 1, 2, 3)}
    assert how_to_go_on(folders, tmp_path / "h") == [
        f"continue seed 0 with: kv4rl train --seeds 0 --resume {shlex.quote(str(tmp_path / 'h'))}",
        "start seeds 2,3 with the command that started the sweep (not --resume), given --seeds 2,3",
        "seed 1 has a run but no checkpoint: start it again with the command that started the sweep, --seeds 1 and --overwrite "
        "(the old folder is moved aside, not deleted)"]


def test_a_seed_that_finished_is_offered_a_longer_run_not_a_resume_that_trains_nothing(tmp_path) -> None:
    """A finished seed was offered `--resume`, which trained nothing and said so only in its log; its
    last checkpoint at the run's length is what tells (one before it: resumable). The sweep's table says so
    where such a resume runs anyway."""
    from kv4rl.config import load_config
    from kv4rl.multi_seed import SeedRun, how_to_go_on, status_of

    from kv4rl.config import save_config

    (tmp_path / "h-s0" / "checkpoints" / "iter_000002").mkdir(parents=True)
    (tmp_path / "h-s1" / "checkpoints" / "iter_000003").mkdir(parents=True)
    for s in (0, 1):  # what a --resume runs to is the folder's own trainer.iterations, whatever a new command asks
        save_config(load_config(None, ["trainer.iterations=3"]), tmp_path / f"h-s{s}" / "config.yaml")
    folders = {s: tmp_path / f"h-s{s}" for s in (0, 1)}
    assert how_to_go_on(folders, tmp_path / "h") == [
        f"seed 1 finished (3 iterations): to train it longer, kv4rl train --seeds 1 --resume {shlex.quote(str(tmp_path / 'h'))} "
        "trainer.iterations=<more>",
        f"continue seed 0 with: kv4rl train --seeds 0 --resume {shlex.quote(str(tmp_path / 'h'))}"]
    run = SeedRun(1, load_config(None, ["trainer.iterations=3"]), [], tmp_path / "log", returncode=0,
                  nothing_to_train=True)
    assert status_of(run) == "finished (nothing trained: its checkpoint had reached trainer.iterations=3)"


def test_resuming_a_sweep_whose_seed_never_started_says_how_to_start_it(tmp_path) -> None:
    """A sweep stopped while seed 0 ran never started seed 1; `--seeds 0,1 --resume` then said only
    "--resume .../ms-s1: no such folder". Reference: what each folder holds (a checkpoint for seed 0, nothing
    for seed 1), and the hint the stopped sweep itself printed."""
    from kv4rl.multi_seed import plan_runs
    from kv4rl.run_folder import RunFolderError

    (tmp_path / "ms-s0" / "checkpoints").mkdir(parents=True)
    with pytest.raises(RunFolderError) as info:
        plan_runs([0, 1], None, [], tmp_path / "ms", False, [])
    message = str(info.value)
    assert f"--seeds 0,1 --resume {tmp_path / 'ms'}: seed 1 has no checkpoint to continue from" in message
    assert f"continue seed 0 with: kv4rl train --seeds 0 --resume {shlex.quote(str(tmp_path / 'ms'))}" in message
    assert "start seed 1 with the command that started the sweep (not --resume), given --seeds 1" in message


@pytest.mark.parametrize("last_saved, status", [(2, "finished"), (1, "stopped (SIGINT)")])
def test_a_seed_the_signal_reached_in_its_last_iteration_is_finished(tmp_path, monkeypatch, last_saved,
                                                                     status) -> None:
    """A child that got the sweep's signal during its last iteration finishes it and exits 0 with every row
    written; the table said "stopped (SIGINT)" and the hint told the user to resume a finished run.
    Reference: the child's last checkpoint, of iteration `trainer.iterations` or (rows past it left by an
    earlier kill, a resume stopped before its first iteration) one before."""
    import os
    import signal
    import threading

    from kv4rl import multi_seed
    from kv4rl.config import load_config

    folder = tmp_path / "sw-s0"
    monkeypatch.setattr(multi_seed, "_start", _fake_child(
        "import json, pathlib, signal, time\n"
        "signal.signal(signal.SIGINT, lambda *a: None)  # the run finishes the iteration it is in\n"
        f"d = pathlib.Path({str(folder)!r}); d.mkdir(parents=True)\n"
        "time.sleep(4)\n"
        "(d / 'config.yaml').write_text('name: sw-s0\\n')\n"
        f"(d / 'checkpoints' / 'iter_{last_saved:06d}').mkdir(parents=True)\n"
        "(d / 'metrics.jsonl').write_text(''.join(json.dumps({'iteration': i, 'accuracy': 0.5}) + '\\n'"
        " for i in range(2)))\n"))
    runs = [multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0", "trainer.iterations=2"]),
                               ["seed=0"], tmp_path / "sw-s0.log")]
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    multi_seed.launch(runs, 1, announce=lambda line: None)
    assert runs[0].returncode == 0 and runs[0].iterations == 2
    assert multi_seed.status_of(runs[0]) == status
    assert any(r.stopped_by for r in runs) == (status != "finished")  # the CLI's hint to resume it


def test_a_seed_the_signal_killed_as_it_shut_down_after_its_last_checkpoint_is_finished(tmp_path, monkeypatch) -> None:
    """The sweep's signal reached a child past its last iteration and final checkpoint, killing it as it shut
    down: the table said "stopped (SIGINT, exit -2)" and the hint listed it for a resume."""
    import os
    import signal
    import threading

    from kv4rl import multi_seed
    from kv4rl.config import load_config

    folder = tmp_path / "sw-s0"
    monkeypatch.setattr(multi_seed, "_start", _fake_child(
        "import json, os, pathlib, signal, time\n"
        "signal.signal(signal.SIGINT, lambda *a: None)\n"
        f"d = pathlib.Path({str(folder)!r}); d.mkdir(parents=True)\n"
        "(d / 'config.yaml').write_text('name: sw-s0\\n')\n"
        "(d / 'checkpoints' / 'iter_000002').mkdir(parents=True)\n"
        "(d / 'metrics.jsonl').write_text(''.join(json.dumps({'iteration': i, 'accuracy': 0.5}) + '\\n'"
        " for i in range(2)))\n"
        "time.sleep(4)\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)\n"))
    runs = [multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0", "trainer.iterations=2"]),
                               ["seed=0"], tmp_path / "sw-s0.log")]
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    multi_seed.launch(runs, 1, announce=lambda line: None)
    assert runs[0].returncode == -signal.SIGINT and runs[0].iterations == 2
    assert multi_seed.status_of(runs[0]) == f"finished (SIGINT as it shut down, exit {-signal.SIGINT})"
    assert multi_seed.failed(runs) == [] and multi_seed.continue_hint(runs) == ""


def test_a_file_where_a_seeds_log_would_go_is_left_as_it_was(tmp_path, monkeypatch) -> None:
    """A user's file at `<out_dir>/<name>-s<seed>.log` was appended to, moved into the seed's train.log and deleted
    (a review helper's find), and so was the log a running child of another sweep of the same name was writing. The
    sweep now writes a file of its own beside it, `<name>-s<seed>.2.log`, and moves only that one."""
    import sys
    from importlib import import_module

    from kv4rl.config import load_config

    multi_seed = import_module("kv4rl.multi_seed")
    theirs = tmp_path / "sw-s0.log"
    theirs.write_text("MY NOTES\n")
    child = (f"import pathlib; d = pathlib.Path({str(tmp_path / 'sw-s0')!r}); d.mkdir(); "
             "(d / 'config.yaml').write_text('x'); print('trained')")
    real = import_module("subprocess").Popen
    monkeypatch.setattr(multi_seed, "subprocess", SimpleNamespace(
        Popen=lambda cmd, **kwargs: real([sys.executable, "-c", child], **kwargs), STDOUT=-2))
    run = multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0"]), ["seed=0"], theirs)
    said = []
    multi_seed.launch([run], 1, announce=said.append)
    assert theirs.read_text() == "MY NOTES\n"
    assert f"log {tmp_path / 'sw-s0.2.log'}" in said[0]
    assert run.final_log == tmp_path / "sw-s0" / "train.log" and run.final_log.read_text() == "trained\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sw-s0", "sw-s0.log"]


def test_a_seed_refused_while_another_sweeps_child_writes_its_folder_leaves_that_run_alone(tmp_path, monkeypatch):
    """Two sweeps of one name: the second's child is refused (the folder is in use) while the first's child writes
    the folder's config.yaml and trains on. The refused seed took the new config.yaml for its own: it moved its log
    into the other run's train.log and read that run's rows as its own (a review helper's find)."""
    from kv4rl import multi_seed
    from kv4rl.config import load_config
    from kv4rl.run_folder import lock_folder, unlock_folder

    folder = tmp_path / "sw-s0"
    folder.mkdir()
    held = lock_folder(folder)  # the other sweep's child, training in the folder (another open file: another lock)
    try:
        monkeypatch.setattr(multi_seed, "_start", _fake_child(  # meanwhile it writes; this seed's child is refused
            f"import pathlib, sys; d = pathlib.Path({str(folder)!r}); (d / 'config.yaml').write_text('x'); "
            "(d / 'metrics.jsonl').write_text('{\"iteration\": 0, \"accuracy\": 0.25}\\n'); sys.exit(2)"))
        run = multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0"]), ["seed=0"],
                                 tmp_path / "sw-s0.log")
        multi_seed.launch([run], 1, announce=lambda line: None)
    finally:
        unlock_folder(held)
    assert run.final_log == tmp_path / "sw-s0.log" and run.final_log.read_text() == "the child's output\n"
    assert not (folder / "train.log").exists()
    assert multi_seed.summary_rows([run])[0][2:5] == ["failed (exit 2)", "0", "-"]


def test_a_seed_that_wrote_its_folder_and_then_failed_with_exit_2_keeps_its_log_there(tmp_path, monkeypatch):
    """A ValueError in a later iteration ends `kv4rl train` with exit 2 too, after its folder was written: its log
    and rows are the seed's (the review of the first fix, which took every exit 2 for a refusal)."""
    from kv4rl import multi_seed
    from kv4rl.config import load_config

    folder = tmp_path / "sw-s0"
    monkeypatch.setattr(multi_seed, "_start", _fake_child(_writes_a_run(folder) + "; import sys; sys.exit(2)"))
    run = multi_seed.SeedRun(0, load_config(None, [f"out_dir={tmp_path}", "name=sw-s0"]), ["seed=0"],
                             tmp_path / "sw-s0.log")
    multi_seed.launch([run], 1, announce=lambda line: None)
    assert run.final_log == folder / "train.log" and run.final_log.read_text() == "the child's output\n"
    assert multi_seed.summary_rows([run])[0][2:5] == ["failed (exit 2)", "1", "0.250"]
