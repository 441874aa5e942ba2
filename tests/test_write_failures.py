"""A write that fails mid-run (a full disk) keeps what the user had: the earlier checkpoints and rows, a
released folder lock, one error line naming the file and how to continue; a failing TensorBoard mirror
does not stop the run; `kv4rl eval` replaces its JSON and samples together or not at all."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from kv4rl.cli import app, main
from kv4rl.cli_common import write_together
from kv4rl.closing import close_all
from tests.small_runs import SMALL, runner, train_cli

ITERS = ["trainer.iterations=4", "checkpoint.save_every=1", "checkpoint.keep_last=4"]


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def fail_nth_state_save(monkeypatch, n: int) -> list[str]:
    """torch.save raises ENOSPC on the n-th trainer state it writes; returns the paths it was asked for."""
    real, asked = torch.save, []

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state.pt"):
            asked.append(str(f))
            if len(asked) == n:
                raise no_space(f)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return asked


def rows(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def saved(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_close_all_calls_every_closer_and_raises_the_first_error_or_logs_it(caplog):
    called = []

    def ok(name):
        return lambda: called.append(name)

    def bad(name):
        def close():
            called.append(name)
            raise OSError(errno.EIO, f"{name} broke")
        return close

    with pytest.raises(OSError, match="a broke"):
        close_all({"a": bad("a"), "b": ok("b"), "none": None, "c": bad("c")})
    assert called == ["a", "b", "c"]
    assert "closing the c also failed" in caplog.text and "closing the a" not in caplog.text
    called.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        close_all({"a": bad("a"), "b": ok("b")}, failing=True)  # the run's own error is the one to raise
    assert called == ["a", "b"] and "closing the a also failed: [Errno 5] a broke" in caplog.text


def test_a_checkpoint_save_on_a_full_disk_keeps_the_earlier_ones_and_says_how_to_continue(tmp_path, monkeypatch):
    asked = fail_nth_state_save(monkeypatch, 3)
    res = train_cli(f"out_dir={tmp_path}", "name=full", *SMALL, *ITERS)
    run = tmp_path / "full"
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert f"{asked[2]}: No space left on device" in text and "Traceback" not in res.output
    assert f"continue with kv4rl train --resume {shlex.quote(str(run))}" in text
    assert saved(run) == ["iter_000001", "iter_000002", "latest"]  # the failed save left nothing behind
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert rows(run) == [0, 1, 2]
    monkeypatch.undo()  # room again: the lock was released, the run goes on from its newest checkpoint
    res = train_cli("--resume", str(run), "--no-progress")
    assert res.exit_code == 0, res.output
    assert rows(run) == [0, 1, 2, 3]


def test_a_log_that_cannot_close_does_not_hide_the_error_or_keep_the_lock(tmp_path, monkeypatch, caplog):
    """A full disk makes the metrics file's close raise again: the save's error is the one reported, the
    close's a warning, and the folder's lock and viewers are still let go."""
    from kv4rl.telemetry.metrics import JsonlWriter

    asked = fail_nth_state_save(monkeypatch, 2)

    def close(self):
        raise no_space(self.path)

    monkeypatch.setattr(JsonlWriter, "close", close)
    with caplog.at_level(logging.WARNING):
        res = train_cli(f"out_dir={tmp_path}", "name=full", *SMALL, *ITERS)
    assert res.exit_code == 1, res.output
    assert f"{asked[1]}: No space left on device" in " ".join(res.output.split())
    assert "closing the metrics log also failed" in caplog.text
    monkeypatch.undo()
    res = train_cli("--resume", str(tmp_path / "full"), "--no-progress")  # refused if the lock were held
    assert res.exit_code == 0, res.output
    assert rows(tmp_path / "full") == [0, 1, 2, 3]


def test_a_failing_tensorboard_mirror_stops_mirroring_not_the_run(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    real, calls = SummaryWriter.flush, []

    def flush(self):
        calls.append(1)
        if len(calls) == 2:
            raise no_space(self.log_dir)
        return real(self)

    monkeypatch.setattr(SummaryWriter, "flush", flush)
    with caplog.at_level(logging.WARNING):
        res = train_cli(f"out_dir={tmp_path}", "name=tb", *SMALL, *ITERS, "logging.tensorboard=true")
    assert res.exit_code == 0, res.output
    assert rows(tmp_path / "tb") == [0, 1, 2, 3]
    assert "mirroring stops for this run, metrics.jsonl keeps every row" in caplog.text
    assert len(calls) == 2  # nothing written to the mirror after it failed


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's report, under pytest
def test_an_event_file_write_failing_in_tensorboards_thread_is_one_warning_not_a_traceback(tmp_path, monkeypatch,
                                                                                          caplog, capfd):
    """TensorBoard writes from a thread of its own: a full disk there printed "Exception in thread" and its
    traceback before the mirror's one-line warning."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    real, calls = record_writer.RecordWriter.write, []

    def write(self, data):
        calls.append(1)
        if len(calls) >= 3:
            raise no_space("events.out.tfevents")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    with caplog.at_level(logging.WARNING):
        res = train_cli(f"out_dir={tmp_path}", "name=tb", *SMALL, *ITERS, "logging.tensorboard=true")
    assert res.exit_code == 0, res.output
    assert rows(tmp_path / "tb") == [0, 1, 2, 3]
    assert "mirroring stops for this run" in caplog.text
    printed = res.output + "".join(capfd.readouterr())
    assert "Traceback" not in printed and "Exception in thread" not in printed, printed


def test_write_together_leaves_every_target_as_it_was_when_one_write_fails(tmp_path, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "sub" / "b.jsonl"
    write_together({a: "old a\n", b: "old b\n", None: "skipped", tmp_path / "c": None})
    assert a.read_text() == "old a\n" and b.read_text() == "old b\n" and not (tmp_path / "c").exists()
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name.startswith(".b.jsonl.") and self.name.endswith(".tmp"):
            real(self, text[:3], *args, **kwargs)  # half of it, then the disk is full
            raise no_space(self)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError, match="No space"):
        write_together({a: "new a\n", b: "new b\n"})
    assert a.read_text() == "old a\n" and b.read_text() == "old b\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "b.jsonl", "sub"]


def test_write_together_stages_under_names_no_target_and_no_user_file_has(tmp_path):
    """A target named like another's old staging name (`.s.jsonl.tmp`) gets its own text, and each file
    gets the mode a plain open() gives under the umask (mkstemp's are 0600)."""
    from kv4rl.file_modes import umask_mode

    odd, samples, mine = tmp_path / ".s.jsonl.tmp", tmp_path / "s.jsonl", tmp_path / ".a.json.tmp"
    mine.write_text("the user's\n")
    write_together({odd: "JSON\n", samples: "SAMPLES\n", tmp_path / "a.json": "A\n"})
    assert (odd.read_text(), samples.read_text(), mine.read_text()) == ("JSON\n", "SAMPLES\n", "the user's\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.json.tmp", ".s.jsonl.tmp", "a.json", "s.jsonl"]
    assert {p.stat().st_mode & 0o777 for p in (odd, samples)} == {umask_mode(False)}


def test_eval_keeps_the_earlier_json_and_samples_when_writing_the_new_ones_fails(tmp_path, monkeypatch, capsys):
    out, samples = tmp_path / "res.json", tmp_path / "samples.jsonl"
    args = ["eval", "--n", "4", "--k", "2", "--json", str(out), "--samples", str(samples), "--device", "cpu"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    before = (out.read_bytes(), samples.read_bytes())
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name.startswith(".samples.jsonl.") and self.name.endswith(".tmp"):
            raise no_space(self)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(sys, "argv", ["kv4rl", *args, "--seed", "1"])
    with pytest.raises(SystemExit) as stopped:
        main()  # the command's entry point: a failed file operation is one line, exit 1
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(tmp_path))}/\.samples\.jsonl\.\w+\.tmp: No space left on device",
                     " ".join(err.split())), err
    assert "Traceback" not in err and "(KV4RL_TRACEBACK=1 shows where)" in err
    assert (out.read_bytes(), samples.read_bytes()) == before
    monkeypatch.setenv("KV4RL_TRACEBACK", "1")  # the error itself, for a bug report
    with pytest.raises(OSError, match="No space left on device"):
        main()
    assert (out.read_bytes(), samples.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json", "samples.jsonl"]


def test_files_written_together_reach_the_disk_before_they_replace_the_users(tmp_path, monkeypatch):
    """A power loss right after the renames must not leave empty files where the user's were: every staged
    file is fsynced before the first rename."""
    import os

    from kv4rl.cli_common import write_together

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])
    (tmp_path / "a.json").write_text("old")
    write_together({tmp_path / "a.json": "new a", tmp_path / "b.jsonl": "new b"})
    assert (tmp_path / "a.json").read_text() == "new a" and (tmp_path / "b.jsonl").read_text() == "new b"
    first_rename = next(i for i, e in enumerate(events) if e[0] == "replace")
    renamed = [e[1] for e in events if e[0] == "replace"]
    assert len(renamed) == 2 and set(renamed) <= {e[1] for e in events[:first_rename] if e[0] == "fsync"}


def test_a_saved_config_reaches_the_disk_before_it_replaces_the_one_a_resume_reads(tmp_path, monkeypatch):
    import os

    import yaml

    from kv4rl.config import RunConfig, save_config

    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    target = tmp_path / "config.yaml"
    target.write_text("old: 1\n")
    monkeypatch.setattr(Path, "replace", lambda self, to: (synced.append(("replace", str(self))), os.rename(self, to)))
    save_config(RunConfig(), target)
    assert synced == [str(tmp_path / "config.tmp"), ("replace", str(tmp_path / "config.tmp"))]
    assert yaml.safe_load(target.read_text())["name"] == RunConfig().name


def test_a_quota_that_refuses_the_sync_leaves_no_staged_file(tmp_path, monkeypatch):
    """Network file systems and quotas may answer only at fsync: the targets stay as they were and the staged
    files go, as for a failed write."""
    import os

    from kv4rl.cli_common import write_together

    def refuse(fd):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "fsync", refuse)
    (tmp_path / "a.json").write_text("old")
    with pytest.raises(OSError, match="quota"):
        write_together({tmp_path / "a.json": "new a", tmp_path / "b.jsonl": "new b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"] and (tmp_path / "a.json").read_text() == "old"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_log_write_that_fails_names_the_log(tmp_path):
    """A flush into a full disk (or a file made immutable mid-run) raised an OSError without a file name, so
    the run's one error line said "No space left on device" and not which file. /dev/full fails every
    flush with ENOSPC."""
    from kv4rl.cli_common import os_error_text
    from kv4rl.telemetry.metrics import JsonlWriter

    log = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(log)
    writer.write({"iteration": 0})
    writer._file.close()
    writer._file = open("/dev/full", "w")  # the open log's next flush hits a full disk
    with pytest.raises(OSError) as failed:
        writer.write({"iteration": 1})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(log)
    assert os_error_text(failed.value) == f"{log}: No space left on device"
    assert rows(tmp_path) == [0]  # what was written stays


@pytest.mark.parametrize(("limit", "said"), [(1_000_000, r".tmp_iter_000001: File too large"),
                                            (5_000_000, r"trainer_state.pt: File too large (torch.save:")])
def test_a_checkpoint_the_disk_refuses_is_one_error_line_naming_it(tmp_path, limit, said):
    """safetensors and torch.save raise types of their own when a write fails (a full disk printed ~150 lines
    of traceback; torch's said only "unexpected pos"). A real refusal, a file-size limit on the process
    (model.safetensors ~3 MB, trainer_state.pt ~6 MB here), gives the CLI's one error line naming the file,
    and the save leaves nothing a resume would take."""
    import resource
    import subprocess

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail EFBIG

    cmd = [sys.executable, "-m", "kv4rl.cli", "train", f"out_dir={tmp_path}", "name=big", *SMALL,
           "trainer.iterations=2", "checkpoint.save_every=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    text = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 1, text
    assert "Traceback" not in text and text.count("error:") == 1, text
    assert re.search(rf"error: {re.escape(str(tmp_path))}/big/\S*{re.escape(said)}", text), text
    assert sorted(p.name for p in (tmp_path / "big" / "checkpoints").iterdir()) == []
    assert rows(tmp_path / "big") == [0]


def test_torch_saves_unexplained_write_failure_is_named_a_full_disk_when_the_disk_is_full(tmp_path, monkeypatch):
    """torch.save's "unexpected pos" carries no errno: with under 1 MiB free it is a full disk, else EIO (the
    file-size limit is the test above)."""
    import shutil

    from kv4rl.trainer import checkpoint

    target = tmp_path / "trainer_state.pt"
    unexplained = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    for free, number in [(1 << 19, errno.ENOSPC), (1 << 30, errno.EIO)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: shutil._ntuple_diskusage(1 << 40, 0, free))
        with pytest.raises(OSError) as caught, checkpoint._writing(target):
            raise unexplained
        assert (caught.value.errno, caught.value.filename) == (number, str(target))
    with pytest.raises(RuntimeError, match="a bug"), checkpoint._writing(target):  # any other error passes as is
        raise RuntimeError("a bug")


def test_the_resume_hint_is_quoted_for_a_shell(tmp_path, monkeypatch):
    """A run folder named with a space: the hint pasted back resumed a folder cut at the space."""
    from kv4rl.distributed import resume_command

    fail_nth_state_save(monkeypatch, 2)
    res = train_cli(f"out_dir={tmp_path}", "name=sp ace", *SMALL, *ITERS)
    assert res.exit_code == 1, res.output
    hint = " ".join(res.output.split()).split("continue with ", 1)[1]
    assert shlex.split(hint) == ["kv4rl", "train", "--resume", str(tmp_path / "sp ace")]
    assert shlex.split(resume_command("it's here", 2)) == ["torchrun", "--nproc-per-node", "2", "-m", "kv4rl.cli",
                                                            "train", "--resume", "it's here"]


def test_a_checkpoint_that_cannot_be_pruned_is_named_and_does_not_stop_a_resume(tmp_path, monkeypatch, caplog):
    """A checkpoint folder made read-only: its prune failed without a word and left a temporary folder, whose
    removal at the next resume failed after that resume's first iteration (naming a bare file), so the run
    could not go on. Both now warn, naming the folder, and the run goes on."""
    import shutil

    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if ".tmp_pruned_" in str(path) and not kwargs.get("ignore_errors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "trainer_state.pt"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    run = tmp_path / "ro"
    with caplog.at_level(logging.WARNING):
        res = train_cli(f"out_dir={tmp_path}", "name=ro", *SMALL, "trainer.iterations=3", "checkpoint.save_every=1",
                        "checkpoint.keep_last=1")
    assert res.exit_code == 0, res.output
    assert saved(run) == [".tmp_pruned_iter_000001", ".tmp_pruned_iter_000002", "iter_000003", "latest"]
    pruned = [m for m in caplog.messages if "could not delete" in m]
    assert len(pruned) == 2 and "checkpoint.keep_last" in pruned[0] and ".tmp_pruned_iter_000001" in pruned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        res = train_cli("--resume", str(run), "trainer.iterations=5", "--no-progress")
    assert res.exit_code == 0, res.output
    assert rows(run) == [0, 1, 2, 3, 4]
    assert any("left by an unfinished save or prune" in m and ".tmp_pruned_iter_000001" in m for m in caplog.messages)


def test_write_together_writes_into_pipes_and_through_symlinks_instead_of_replacing_them(tmp_path):
    """`--json` into a named pipe replaced the pipe with a plain file (its reader waited for ever), into a
    symlink replaced the link (its target kept the old text); as root, `--json /dev/stdout` turned the
    container's /dev/stdout into a plain file. A pipe is written into; a link's target is replaced whole."""
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    target = tmp_path / "real" / "out.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_together({fifo: "through the pipe\n", link: "new\n"})
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and received == ["through the pipe\n"]
    assert link.is_symlink() and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "real"]  # no temporary left
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_a_reader_that_closes_stdout_does_not_end_the_command_or_lose_its_files(tmp_path):
    """`kv4rl ... | head -1`: rich ended the process with status 1 from inside a print once the reader had gone,
    before the JSON was written, and said nothing. The command now finishes (status 0, its file written)
    and says on stderr that stdout went away. `--json -` wrote a file named '-'."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    # `true` exits at once, long before the command prints after its imports: every print meets a closed pipe
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m kv4rl.cli sim clip-bias --samples 200 --json out.json"
                                         " | true; exit ${PIPESTATUS[0]}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["n_samples"] == 200
    assert "stdout was closed by its reader; the command goes on without printing to it" in done.stderr
    from typer.testing import CliRunner

    from kv4rl.cli import app

    res = CliRunner().invoke(app, ["sim", "clip-bias", "--samples", "200", "--json", "-"])
    assert res.exit_code == 2 and "--json -: takes a file path, not '-'" in " ".join(res.output.split())
    assert not (Path.cwd() / "-").exists()


def test_a_pipe_gets_only_the_complete_result_and_dev_paths_pass_the_output_check(tmp_path):
    """The benches rewrite --json after each arm: into a pipe its reader took the first, partial document
    as the whole and the final write then blocked. /dev/stdout and /dev/null failed the check of their folder
    (/dev is root's) for every other user. A symlink under /dev to a regular file was appended to."""
    import stat
    import threading

    from kv4rl.cli_common import check_output_path, write_json, writes_into
    from kv4rl.versions import software_versions

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    write_json({"complete": False, "rows": [1]}, fifo)
    write_json({"complete": True, "rows": [1, 2]}, fifo)
    reader.join(timeout=30)
    assert [json.loads(r) for r in received] == [{"complete": True, "rows": [1, 2], "versions": software_versions()}]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert writes_into(Path("/dev/null")) and writes_into(Path("/dev/stdout")) and not writes_into(tmp_path / "a")
    check_output_path(Path("/dev/null"))  # its folder's permissions do not matter
    target = tmp_path / "eval.json"
    target.write_text('{"old": 1}\n')
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert not writes_into(link)  # a link to a regular file, wherever it lives: its target replaced whole
