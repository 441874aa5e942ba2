"""Metrics sinks: TensorBoard event files equal metrics.jsonl (read back with TensorBoard's own reader),
a resume logs each iteration once, and a viewer asked for but not installed stops the run at start-up."""

import json
import math
import shutil
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.telemetry.sinks import scalars

runner = CliRunner()
TINY = ["rollout.quota_groups=2", "rollout.group_size=2", "--no-progress"]


def squash(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_viewer_asked_for_but_not_installed_fails_before_the_run_folder(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # import and find_spec now see no such package
    res = runner.invoke(app, ["train", f"logging.{package}=true", f"out_dir={tmp_path}", *TINY])
    assert res.exit_code == 2
    assert squash(f"logging.{package}=true but the '{package}' package is not installed") in squash(res.output)
    assert not (tmp_path / "tiny-arith").exists()


def test_scalars_keep_numbers_only():
    row = {"iteration": 3, "loss": 0.5, "steps": 2, "ok": True, "hist": {"0": 1}, "groups": [1], "name": "x"}
    assert scalars(row) == {"loss": 0.5, "steps": 2.0}
    # metrics.jsonl stores a non-finite value as null; the viewers got inf / nan where the record had none
    assert scalars({"iteration": 1, "a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5}) == {"d": 1.5}


def read_events(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_events_equal_jsonl(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = read_events(run_dir)
    keys = {k for r in rows for k, v in r.items()
            if k != "iteration" and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))}
    assert set(events) == keys
    assert "staleness_hist" not in events and "groups" not in events  # nested values are left out
    for key, series in events.items():
        logged = [(r["iteration"], r[key]) for r in rows if key in r]
        assert [step for step, _ in series] == [it for it, _ in logged], key  # each iteration once
        for (_, got), (_, want) in zip(series, logged):
            if want is None:  # metrics.jsonl writes non-finite values as null
                assert math.isnan(got), key
            else:  # event files hold float32
                assert got == np.float32(want), (key, got, want)


@pytest.mark.slow
def test_training_writes_event_files_equal_to_metrics_and_resume_logs_once(tmp_path):
    pytest.importorskip("tensorboard")
    import shlex

    out_dir = tmp_path / "my runs"  # the viewing hint quotes it: pasted unquoted, a space split the path
    run_dir = out_dir / "tb"
    res = runner.invoke(app, ["train", "name=tb", f"out_dir={out_dir}", "trainer.iterations=3",
                              "checkpoint.save_every=2", *TINY])
    assert res.exit_code == 0, res.output
    assert squash(f"tensorboard: event files in {run_dir}") in squash(res.output)
    assert squash(f"tensorboard --logdir {shlex.quote(str(out_dir))})") in squash(res.output)
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert_events_equal_jsonl(run_dir)

    # as if the process died after logging iteration 2 but before its checkpoint was written
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "iter_000003")
    (ckpts / "latest").write_text("iter_000002\n")
    res = runner.invoke(app, ["train", "--resume", str(run_dir), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # a fresh file for the resumed process
    assert_events_equal_jsonl(run_dir)


def read_like_the_rust_server(run_dir) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's default data server (`--load_fast=auto`): every `*tfevents*` file in name order, a tag's
    older points dropped only when a point of that tag arrives at the same or a lower step; SessionLog.START
    (the purge) is ignored (tensorboard/data/server/reservoir.rs, "Preemption")."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(p for p in run_dir.iterdir() if "tfevents" in p.name):
        for record in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(record)
            for value in event.summary.value:
                points = [p for p in series.get(value.tag, []) if p[0] < event.step]
                series[value.tag] = [*points, (event.step, value.simple_value)]
    return series


def test_a_resume_rewrites_the_event_history_so_every_reader_drops_the_killed_processs_points(tmp_path):
    """The killed process logged iterations 2-3 (with an eval metric at 3) past its checkpoint at 1; the
    resumed one logs 2-3 again without eval. TensorBoard's default server ignores the purge record and kept
    eval at 3, which metrics.jsonl had dropped; the history is now rewritten, the old file kept renamed."""
    pytest.importorskip("tensorboard")
    from kv4rl.config import load_config
    from kv4rl.telemetry.sinks import MetricsSink

    cfg = load_config(overrides=["name=r", f"out_dir={tmp_path}", "logging.tensorboard=true"])
    cfg.run_dir.mkdir(parents=True)

    def run(rows):
        sink = MetricsSink(cfg, announce=lambda line: None)
        for row in rows:
            sink.log(row)
        sink.close()

    run([{"iteration": it, "a": float(it), **({"eval/x": 10.0 + it} if it % 2 else {})} for it in range(4)])
    (first,) = cfg.run_dir.glob("events.out.tfevents.*")
    written = first.read_bytes()
    run([{"iteration": it, "a": 100.0 + it} for it in (2, 3)])
    want = {"a": [(0, 0.0), (1, 1.0), (2, 102.0), (3, 103.0)], "eval/x": [(1, 11.0)]}
    assert read_events(cfg.run_dir) == want
    assert read_like_the_rust_server(cfg.run_dir) == want  # before: eval/x also at 3 (13.0)
    kept = cfg.run_dir / first.name.replace("tfevents", "superseded")
    assert kept.read_bytes() == written  # renamed, not deleted
    from kv4rl.telemetry.event_history import _rename_keeping

    (cfg.run_dir / "taken").write_text("mine")
    (cfg.run_dir / "other").write_text("other")
    _rename_keeping(cfg.run_dir / "other", cfg.run_dir / "taken")  # a name in use is never replaced
    assert (cfg.run_dir / "taken").read_text() == "mine" and (cfg.run_dir / "taken.1").read_text() == "other"
    for name in ("taken", "taken.1"):
        (cfg.run_dir / name).unlink()

    files = sorted(p.name for p in cfg.run_dir.iterdir())
    run([{"iteration": 4, "a": 104.0}])  # a resume past every logged step rewrites nothing
    assert sorted(p.name for p in cfg.run_dir.iterdir())[:len(files)] == files
    run([{"iteration": it, "a": 200.0 + it} for it in (1, 2)])  # again, over the rewritten history
    want = {"a": [(0, 0.0), (1, 201.0), (2, 202.0)]}
    assert read_events(cfg.run_dir) == want and read_like_the_rust_server(cfg.run_dir) == want


class FakeWandb:
    """Records the calls of the documented `wandb` API that the sink uses."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0
        ids = iter(f"id{i}" for i in range(10))
        self.util = type("util", (), {"generate_id": staticmethod(lambda: next(ids))})
        self.__spec__ = type("spec", (), {})()  # find_spec asks for it

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_run_named_after_the_run_grouped_by_arm_and_resumed_by_id(tmp_path, monkeypatch):
    from kv4rl.config import load_config
    from kv4rl.telemetry.sinks import MetricsSink

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(overrides=["name=ppo-s1", f"out_dir={tmp_path}", "logging.wandb=true",
                                 "logging.tensorboard=false"])
    cfg.run_dir.mkdir(parents=True)
    lines = []
    for _ in range(2):  # a run, then its resume
        sink = MetricsSink(cfg, announce=lines.append)
        sink.log({"iteration": 4, "loss": 0.25, "hist": {"0": 3}})
        sink.close()
    assert lines == ["wandb: project kv4rl, run ppo-s1"] * 2
    assert [i["id"] for i in fake.inits] == ["id0", "id0"] and (cfg.run_dir / "wandb_id.txt").is_file()
    first = fake.inits[0]
    assert (first["project"], first["name"], first["group"], first["resume"]) == ("kv4rl", "ppo-s1", "ppo", "allow")
    assert first["config"]["name"] == "ppo-s1" and first["dir"] == str(cfg.run_dir)
    assert fake.logged == [(4, {"loss": 0.25})] * 2 and fake.finished == 2


def test_a_copied_run_folder_gets_a_wandb_run_of_its_own_and_a_moved_one_keeps_its(tmp_path, monkeypatch):
    """A copy (`cp -r`, to branch a run) resumed into the original's W&B run by the id in the folder: its
    rows went into the original's curves (QA). A moved folder is the same run and keeps its id."""
    from kv4rl.config import load_config
    from kv4rl.telemetry.sinks import MetricsSink

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def resume(folder):
        cfg = load_config(overrides=[f"name={folder.name}", f"out_dir={folder.parent}", "logging.wandb=true",
                                     "logging.tensorboard=false"])
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        sink = MetricsSink(cfg, announce=lines.append)
        sink.log({"iteration": 1, "loss": 0.5})
        sink.close()
        return fake.inits[-1]["id"], lines

    original = tmp_path / "a"
    first, _ = resume(original)
    shutil.copytree(original, tmp_path / "b")
    copy, lines = resume(tmp_path / "b")
    assert copy != first and f"wandb: {tmp_path / 'b'} is a copy of {original}" in lines[0]
    assert resume(tmp_path / "b")[0] == copy and resume(original)[0] == first  # each keeps its own
    original.rename(tmp_path / "moved")
    assert resume(tmp_path / "moved")[0] == first  # the folder it names is gone: moved, the same run
    (tmp_path / "moved").rename(tmp_path / "moved again")
    newcomer, _ = resume(tmp_path / "moved")  # a new run at its old path, before the moved one resumes (review)
    again, lines = resume(tmp_path / "moved again")
    assert newcomer not in (first, copy) and again == first and "is a copy of" not in lines[0]


def test_a_resumed_event_file_is_created_after_the_second_of_the_newest_one(tmp_path):
    """TensorBoard reads event files in name order (creation second first); a resumed file made in
    the same second as the last one could be read before it and lose its purge."""
    import time

    from kv4rl.telemetry.sinks import _wait_past_existing_event_files

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.99.10").write_text("")
    _wait_past_existing_event_files(tmp_path)
    assert int(time.time()) > now
    (tmp_path / "events.out.tfevents.garbage").write_text("")  # names it cannot read are ignored
    start = time.monotonic()
    _wait_past_existing_event_files(tmp_path)
    assert time.monotonic() - start < 0.5


def test_a_resumed_log_keeps_its_earlier_rows_reading_line_by_line(tmp_path):
    """Resuming rewrites a log with the rows before the resume point. A long run's rollout trace (one row a
    step) is GBs; read whole it took ~6x its size of host memory (3.4 GiB for 2M rows). The rows kept are
    the earlier lines byte for byte (a line that is not a row among them too), and the reader's peak stays far
    below the file."""
    import tracemalloc

    from kv4rl.telemetry.metrics import JsonlWriter

    log = tmp_path / "rollout_trace.jsonl"
    rows = [json.dumps({"iteration": i // 100, "step": i, "slot_util": i % 7 / 7, "tokens": [i] * 8})
            for i in range(60_000)]
    log.write_text("\n".join(rows[:30_000]) + '\n{"iteration": 3, "ste\n' + "\n".join(rows[30_000:]) + "\n")
    size = log.stat().st_size
    writer = JsonlWriter(log, resume_from=450)
    tracemalloc.start()
    try:
        writer.write({"iteration": 450, "step": -1})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        writer.close()
    assert log.read_text().splitlines() == (rows[:30_000] + ['{"iteration": 3, "ste'] + rows[30_000:45_000]
                                            + ['{"iteration": 450, "step": -1}'])
    assert size > 4_000_000 and peak < size / 8


def test_a_resume_keeps_every_line_before_its_point_that_is_not_a_row_and_drops_a_torn_tail(tmp_path, caplog):
    """A resume deletes only the rows it makes again. A line that does not parse among the rows it keeps
    (NUL bytes from a damaged disk, bytes that are not UTF-8, a hand edit) was deleted with the warning
    "skipped"; it stays, byte for byte. The lines that are not rows after the last row kept, a write torn by a
    kill, go, as do the rows from the resume point on."""
    from kv4rl.telemetry.metrics import JsonlWriter, read_jsonl

    log = tmp_path / "metrics.jsonl"
    row = [b'{"iteration": %d, "loss": 0.5}' % i for i in range(6)]
    damaged = b'{"iteration": 1, \x00\x00\x00\x00 "loss": 0.5}'
    not_utf8 = b'{"iteration": 2, "note": "\xff\xfe"}'
    lines = [row[0], damaged, b"\x00" * 16, not_utf8, b"[1, 2]", row[3], row[4], b'{"iteration": 5, "lo', row[5],
             b'{"iteration": 6, "lo']
    log.write_bytes(b"\n".join(lines) + b"\n")
    writer = JsonlWriter(log, resume_from=4)
    with caplog.at_level("WARNING"):
        writer.write({"iteration": 4, "loss": 0.25})
    writer.close()
    assert log.read_bytes().split(b"\n") == [row[0], damaged, b"\x00" * 16, not_utf8, b"[1, 2]", row[3],
                                             b'{"iteration": 4, "loss": 0.25}', b""]
    assert [m for m in caplog.messages if "kept as it is" in m] == [
        f"{log}:{n} is not a JSON row; kept as it is" for n in (2, 3, 5)]  # bytes not UTF-8 in a row: a row
    assert [m for m in caplog.messages if "dropped" in m] == [
        f"{log}:{n} is not a JSON row (cut short by a kill?) and follows the rows kept; dropped" for n in (8, 10)]
    # and every reader still reads the log: the bytes that are not UTF-8 failed the whole file (UnicodeDecodeError)
    assert [row["iteration"] for row in read_jsonl(log)] == [0, 2, 3, 4]


def test_the_trace_plot_reads_its_columns_line_by_line_and_keeps_only_them(tmp_path):
    """`kv4rl plot rollout-trace` over a long run's trace (a row a step, millions): the plotted fields of
    the chosen iterations equal those of the rows read whole, and reading holds a fraction of the file
    (the rows as dicts took ~1 KB each)."""
    import tracemalloc

    from kv4rl.telemetry.plots import TRACE_COLUMNS, trace_columns

    log = tmp_path / "rollout_trace.jsonl"
    rows = [{"batch_size": i % 97, "new_tokens": 12, "prefill_tokens": 0, "context_mean": i / 3, "kv_bytes": 4096.0 * i,
             "kv_blocks": i, "shared_blocks": 0, "prefill_tokens_saved": 0, "latency_s": 1e-3 + i * 1e-9,
             "wait_s": 1e-6, "iteration": i // 1000} for i in range(40_000)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracemalloc.start()
    try:
        columns = trace_columns(log, (5, 30))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    chosen = [r for r in rows if 5 <= r["iteration"] < 30]
    assert {key: list(columns[key]) for key in TRACE_COLUMNS} == {key: [r[key] for r in chosen] for key in TRACE_COLUMNS}
    assert len(chosen) == 25_000 and peak < log.stat().st_size / 4


def _trace_row(it, **fields):
    return {"iteration": it, "batch_size": 4, "context_mean": 10.0, "kv_bytes": 2**20, "latency_s": 0.01, **fields}


@pytest.mark.parametrize("fields, said", [({"context_mean": None}, "context_mean is None"),
                                          ({"latency_s": "fast"}, "latency_s is 'fast'")])
def test_a_damaged_trace_row_is_one_line_naming_it(tmp_path, fields, said):
    """A null or missing field of a rollout trace row (edited by hand) was a TypeError/KeyError traceback."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "rollout_trace.jsonl").write_text(json.dumps(_trace_row(0)) + "\n" + json.dumps(_trace_row(0, **fields)) + "\n")
    res = runner.invoke(app, ["plot", "rollout-trace", str(run), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and res.output.startswith("error:"), res.output
    assert squash(f"rollout_trace.jsonl:2: {said}, not a finite number") in squash(res.output)
    row = _trace_row(0)
    del row["kv_bytes"]
    (run / "rollout_trace.jsonl").write_text(json.dumps(row) + "\n")
    res = runner.invoke(app, ["plot", "rollout-trace", str(run), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and squash("rollout_trace.jsonl:1: kv_bytes is missing") in squash(res.output)


def test_the_trace_plot_draws_a_run_named_twice_once_and_titles_namesakes_by_path(tmp_path, monkeypatch):
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, label, *a, **k: titles.append(label))
    for parent in ("x", "y"):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "rollout_trace.jsonl").write_text(json.dumps(_trace_row(0)) + "\n")
    one = tmp_path / "x" / "run"
    res = runner.invoke(app, ["plot", "rollout-trace", str(one), f"{one}/.", "--out", str(tmp_path / "a.png")])
    assert res.exit_code == 0, res.output
    assert titles == ["run"]  # one column, not the same run twice
    titles.clear()
    res = runner.invoke(app, ["plot", "rollout-trace", str(one), str(tmp_path / "y" / "run"),
                              "--out", str(tmp_path / "b.png")])
    assert res.exit_code == 0 and titles == [str(one), str(tmp_path / "y" / "run")]

