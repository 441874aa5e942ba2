"""`kv4rl train --seeds`: one folder per seed with its own seed and log, every folder checked before any
seed starts, and a non-zero exit with a table when a seed fails."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kv4rl.cli import app
from tests.small_runs import tree_state

pytestmark = pytest.mark.slow  # the seeds are child processes (~10 s each to start on 2 cores)
runner = CliRunner()
TINY = ["--config", "recipes/testbed_longmul_test.yaml", "trainer.iterations=1", "rollout.max_new_tokens=32",
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
    assert f"kv4rl train --seeds 0,1 --resume {tmp_path / 'ms'}" in text  # the sweep's hint, not one seed's
    assert tree_state(tmp_path) == before  # seed 0 did not start either


def test_a_failing_seed_fails_the_command_with_a_table(testbed_cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KV4RL_CACHE", str(testbed_cache[0]))
    res = seeds_cli(tmp_path, "--seeds", "3,4", "--parallel", "2", "engine.num_kv_blocks=1", "engine.kv.block_size=4")
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert text.count("failed (exit 2)") >= 2 and "seeds 3, 4 failed" in text
    # neither started, so no folder; each log stays beside and says why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ms-s3.log", "ms-s4.log"]
    assert "num_kv_blocks" in (tmp_path / "ms-s3.log").read_text()


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
    assert f"continue with: kv4rl train --seeds 0 --resume {tmp_path / 'sw'}" in hint
    assert "seeds 1 have no checkpoint: start them with the same command and --seeds 1" in hint
