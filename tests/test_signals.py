"""SIGTERM mid-run: the run finishes its iteration, checkpoints and exits 0, and `--resume` then
ends exactly where an uninterrupted run ends; a second signal ends the process at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kv4rl
from kv4rl.telemetry.metrics import read_jsonl
from tests.small_runs import SMALL, new_run, train_cli

pytestmark = pytest.mark.slow


def start_training(out_dir: Path, name: str, *extra: str, stderr_path: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(kv4rl.__file__).parents[1]))
    cmd = [sys.executable, "-m", "kv4rl.cli", "train", f"out_dir={out_dir}", f"name={name}", *SMALL, *extra]
    stderr = subprocess.PIPE if stderr_path is None else stderr_path.open("w")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path):
    # 16 short iterations: the signal, sent once the first row is written, lands well before the end
    # even when the machine is slow to deliver it
    ref = new_run(tmp_path, "ref", "trainer.iterations=16", "checkpoint.save_every=100")
    proc = start_training(tmp_path, "cut", "trainer.iterations=16", "checkpoint.save_every=100")
    run = tmp_path / "cut"
    wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 1,
             proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = len(read_jsonl(run / "metrics.jsonl"))
    assert 1 <= stopped < 16, "the signal came after the run ended: the test would prove nothing"
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{stopped:06d}"
    assert "stopped by SIGTERM" in " ".join(out.split()) and "--resume" in out

    res = train_cli("--resume", str(run), "--no-progress")
    assert res.exit_code == 0, res.output
    rows, ref_rows = read_jsonl(run / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    for key in ("iteration", "groups", "reward_mean", "response_len_mean"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    a = load_file(ref / "checkpoints" / "iter_000016" / "model.safetensors")
    b = load_file(run / "checkpoints" / "iter_000016" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_second_signal_stops_at_once(tmp_path):
    """Iterations of a second or so, so the second signal lands while the first is being honoured."""
    big = ["rollout.quota_groups=4", "rollout.group_size=4"]
    proc = start_training(tmp_path, "twice", "trainer.iterations=1000", "checkpoint.save_every=1000", *big,
                          stderr_path=tmp_path / "stderr.txt")
    metrics = tmp_path / "twice" / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping after this iteration" in (tmp_path / "stderr.txt").read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert not (tmp_path / "twice" / "checkpoints").exists()  # it did not wait for the iteration to end


def test_a_stop_signal_seen_on_another_rank_is_named_in_the_summary(tmp_path, monkeypatch):
    """Under torchrun a signal on rank 1 stops rank 0 too, after the same iteration; rank 0's summary said
    nothing of it (it read like a finished run) and printed no way to continue."""
    import kv4rl.loop
    from kv4rl.config import load_config

    seen = iter([False, True])  # rank 0 sees no signal of its own; the other rank's arrives at iteration 1
    monkeypatch.setattr(kv4rl.loop, "any_rank", lambda local: local or next(seen))
    cfg = load_config(overrides=[f"out_dir={tmp_path}", "name=r", "device=cpu", "trainer.iterations=5",
                                 "rollout.quota_groups=2", "rollout.group_size=2", "checkpoint.save_every=1"])
    summary = kv4rl.loop.train(cfg, show_progress=False)
    assert summary["stopped_by"] == "a stop signal on another rank after iteration 0"
    assert summary["iterations"] == 1


def test_a_signal_during_the_last_iteration_reports_a_finished_run(tmp_path, monkeypatch):
    """A signal that arrived while the last iteration ran: every iteration, the final eval and the last
    checkpoint were written, yet the summary said 'stopped ... after iteration 2' and the CLI told the user to
    resume a finished run. Reference: the iterations the run was asked for, all in metrics.jsonl."""
    import kv4rl.loop
    from kv4rl.config import load_config

    real = kv4rl.loop.run_iteration

    def signalled(s, it):
        if it == s.cfg.trainer.iterations - 1:
            os.kill(os.getpid(), signal.SIGINT)  # caught by the run's GracefulStop: the iteration finishes
        return real(s, it)

    monkeypatch.setattr(kv4rl.loop, "run_iteration", signalled)
    cfg = load_config(overrides=[f"out_dir={tmp_path}", "name=r", "device=cpu", "trainer.iterations=4",
                                 "rollout.quota_groups=2", "rollout.group_size=2", "checkpoint.save_every=10"])
    summary = kv4rl.loop.train(cfg, show_progress=False)
    assert [r["iteration"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (cfg.run_dir / "checkpoints" / "latest").read_text() == "iter_000004"
    assert "stopped_by" not in summary, summary["stopped_by"]


def test_a_sigterm_while_the_command_starts_stops_the_run_with_exit_0(tmp_path):
    """A SIGTERM that arrived while the config or the checkpoint was read, before the run's handler was
    installed, took the default action: exit 143 with no output, where the README promises 0 (a requeue
    script branches on it). Reference: the README's contract, and a run folder with nothing written."""
    script = (
        "import os, signal, sys\n"
        "import kv4rl.config as config\n"
        "real = config.load_config\n"
        "def signalled(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # while the config is read\n"
        "    return real(*args, **kwargs)\n"
        "config.load_config = signalled\n"
        "from kv4rl.cli import app\n")
    stopped_at_start(tmp_path, script, "SIGTERM")


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_training_code_is_imported_stops_the_run_with_exit_0(tmp_path, signum):
    """The start-up handler went in only after `kv4rl.loop` was imported (torch and transformers: ~4 s on
    a 2-core machine), so a signal in that window still took the default action: SIGTERM exit 143 with no
    output, SIGINT a KeyboardInterrupt and exit 130. Reference: the README's contract (exit 0, nothing
    written)."""
    script = (
        "import os, signal, sys\n"
        "class SignalOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'kv4rl.loop':\n"
        f"            os.kill(os.getpid(), signal.{signum})  # as the training code is imported\n"
        "        return None\n"
        "sys.meta_path.insert(0, SignalOnImport())\n"
        "from kv4rl.cli import app\n")
    stopped_at_start(tmp_path, script, signum)


def stopped_at_start(tmp_path, script: str, signal_name: str) -> None:
    """`script` (signalling itself while `kv4rl train` starts) then the train command: the README's contract,
    exit 0 with the signal named and nothing written."""
    script += (f"sys.argv = ['kv4rl', 'train', 'out_dir={tmp_path}', 'name=early', *{SMALL!r}, 'trainer.iterations=3']\n"
               "app()\n")
    env = dict(os.environ, PYTHONPATH=str(Path(kv4rl.__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert signal_name in proc.stdout + proc.stderr
    assert not (tmp_path / "early" / "metrics.jsonl").exists()


GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5290: Connection "
             "reset by peer")  # what the survivor's broadcast raised when its peer was SIGKILLed (torchrun, CPU)


def test_a_rank_killed_without_a_word_is_one_error_line_with_the_resume_hint(tmp_path, monkeypatch):
    """A rank killed by SIGKILL (the out-of-memory killer) cannot say so in the job's store: its peer printed
    the collective's ~290-line traceback, naming neither the rank nor the cause."""
    import kv4rl.loop
    from kv4rl import distributed
    from kv4rl.cli import app
    from tests.small_runs import runner, new_run

    run = new_run(tmp_path, "r", "trainer.iterations=1", "checkpoint.save_every=1")
    monkeypatch.setattr(distributed, "launched_ranks", lambda: 2)
    monkeypatch.setattr(distributed, "init_from_torchrun", lambda device: distributed.Ranks(0, 2))

    def killed_peer(*args, **kwargs):
        raise RuntimeError(GLOO_LOST)

    monkeypatch.setattr(kv4rl.loop, "train", killed_peer)
    res = runner.invoke(app, ["train", "--resume", str(run), "trainer.iterations=3", "--no-progress"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert text.startswith("error: another rank of this job went down without a word (killed? the out-of-memory "
                           "killer?); this rank stops too; the checkpoints in"), text
    assert f"continue with torchrun --nproc-per-node 2 -m kv4rl.cli train --resume {run}" in text

    def own_bug(*args, **kwargs):
        raise RuntimeError("a bug of this rank's own")

    monkeypatch.setattr(kv4rl.loop, "train", own_bug)
    res = runner.invoke(app, ["train", "--resume", str(run), "trainer.iterations=3", "--no-progress"])
    assert res.exit_code == 1 and isinstance(res.exception, RuntimeError)  # raised as it is


@pytest.mark.parametrize("args", [["--print-config"], ["trainer.iterations=0"], ["trainer.iterations=1"]])
def test_the_command_puts_back_the_signal_handlers_it_found(tmp_path, args):
    """`kv4rl train` called in a process that goes on (this test session, a notebook) left its start-up
    handler installed after it returned, so the process's next Ctrl-C or SIGTERM was held, not acted on
    (QA: a test session ignored the first SIGTERM of a CI time limit). A run, a refused config and
    --print-config alike leave the handlers as they found them."""
    def mine(signum, frame):
        raise AssertionError("not called")

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in before:
            signal.signal(s, mine)
        train_cli(f"out_dir={tmp_path}", "name=r", *SMALL, *args)
        assert {s: signal.getsignal(s) for s in before} == {signal.SIGINT: mine, signal.SIGTERM: mine}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_signal_before_the_first_iteration_says_nothing_will_be_written(caplog):
    """A signal while the model and engine build said "stopping after this iteration with a checkpoint", then the
    run stopped before its first iteration with nothing written (as its summary said): the warning now says which
    of the two happens, as the loop has or has not started an iteration."""
    import os

    from kv4rl.graceful_stop import GracefulStop

    for iterating, said in ((False, "SIGTERM: stopping before the first iteration (nothing is written)"),
                            (True, "SIGTERM: stopping after this iteration with a checkpoint")):
        caplog.clear()
        with GracefulStop() as stop:
            stop.iterating = iterating
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested == "SIGTERM"
        assert any(said in m for m in caplog.messages), caplog.messages


def test_a_resume_stopped_before_its_first_iteration_hints_its_own_settings(tmp_path, monkeypatch):
    """A resume with `trainer.iterations=8` stopped before its first iteration writes nothing, so the run's
    config.yaml lacks that setting: the hint `kv4rl train --resume <run>` alone would not train on to 8. The hint
    now carries the resume's settings then (and only then: after an iteration, config.yaml holds them)."""
    import kv4rl.loop
    from kv4rl.cli import app
    from tests.small_runs import new_run, runner

    run = new_run(tmp_path, "r", "trainer.iterations=1", "checkpoint.save_every=1")
    for stopped, carried in (("SIGTERM before the first iteration (nothing written)", True),
                             ("SIGTERM after iteration 1", False)):
        monkeypatch.setattr(kv4rl.loop, "train", lambda cfg, stopped=stopped, **kw: {"run_dir": str(run), "stopped_by": stopped})
        res = runner.invoke(app, ["train", "--resume", str(run), "trainer.iterations=8", "--no-progress"])
        text = " ".join(res.output.split())
        assert res.exit_code == 0, res.output
        hint = text.split("continue with: ", 1)[1]
        assert hint.startswith(f"kv4rl train --resume {run}") and ("trainer.iterations=8" in hint) == carried, hint
