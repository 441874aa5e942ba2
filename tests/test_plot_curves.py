"""`kv4rl plot curves` and `plot iteration-time`: the CSV/JSON numbers against cases worked by hand."""

import csv
import json
import math

import pytest
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.telemetry.curves import ema, worst_drop

runner = CliRunner()
EVAL = "eval/mean@1"


def squash(text: str) -> str:
    """The console wraps long lines: compare text with all whitespace removed."""
    return "".join(text.split())


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def eval_rows(values: dict):
    """Rows for iterations 0..max: the eval metric only where given (None is written as null)."""
    last = max(values)
    return [{"iteration": i, "loss": 0.1 * i, **({EVAL: values[i]} if i in values else {})} for i in range(last + 1)]


@pytest.fixture
def runs(tmp_path):
    write_run(tmp_path / "ppo-s0", eval_rows({1: 0.0, 3: 1.0, 5: 0.5, 6: None, 7: 0.0}))
    write_run(tmp_path / "ppo-s1", eval_rows({1: 1.0, 3: 1.0, 5: 0.0, 7: 1.0, 9: 1.0}))
    write_run(tmp_path / "other" / "base-s0", eval_rows({1: 0.25, 3: 0.75}))
    return tmp_path


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_csv_and_summary_match_hand_computation(runs):
    out = runs / "fig" / "curves.png"
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--ema", "0.5",
                              "--arm", f"baseline={runs / 'other' / 'base-*'}", "--out", str(out),
                              "--json", str(runs / "s.json")])
    assert res.exit_code == 0, res.output
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # By hand, EMA 0.5 over the logged iterations (iteration 6's null is skipped):
    #   ppo-s0 at 1,3,5,7: x = 0, 1, .5, 0    -> s = 0, .5, .5, .25
    #   ppo-s1 at 1,3,5,7,9: x = 1, 1, 0, 1, 1 -> s = 1, 1, .5, .75, .875
    #   baseline at 1,3: x = .25, .75          -> s = .25, .5
    expected = [
        (1, "ppo", 0.5, 0.0, 1.0, 2), (3, "ppo", 0.75, 0.5, 1.0, 2), (5, "ppo", 0.5, 0.5, 0.5, 2),
        (7, "ppo", 0.5, 0.25, 0.75, 2), (9, "ppo", 0.875, 0.875, 0.875, 1),
        (1, "baseline", 0.25, 0.25, 0.25, 1), (3, "baseline", 0.5, 0.5, 0.5, 1),
    ]
    rows = read_csv(out.with_suffix(".csv"))
    assert list(rows[0]) == ["iteration", "arm", "mean", "low", "high", "n_seeds"]
    got = [(int(r["iteration"]), r["arm"], float(r["mean"]), float(r["low"]), float(r["high"]), int(r["n_seeds"]))
           for r in rows]
    assert got == expected

    summary = json.loads((runs / "s.json").read_text())
    assert summary["band"] == "min-max over seeds" and summary["ema"] == 0.5
    ppo = summary["arms"]["ppo"]
    # finals .25 and .875: mean .5625, sample std |.875 - .25| / sqrt(2)
    assert ppo["final_per_seed"] == [0.25, 0.875]
    assert ppo["final_mean"] == pytest.approx(0.5625)
    assert ppo["final_std"] == pytest.approx(0.625 / math.sqrt(2))
    # mean curve .5, .75, .5, .5, .875: falls .25 below its peak; seed 1 falls from 1 to .5
    assert ppo["worst_drop_mean_curve"] == pytest.approx(0.25)
    assert ppo["worst_drop_worst_seed"] == pytest.approx(0.5)
    assert ppo["null_values"] == 1 and ppo["n_seeds"] == 2 and ppo["last_iteration"] == 9
    base = summary["arms"]["baseline"]
    assert base["final_mean"] == 0.5 and base["final_std"] is None and base["worst_drop_mean_curve"] == 0.0
    assert "0.5625±0.4419" in squash(res.output)


def test_until_compares_runs_at_the_same_iteration(runs):
    """Runs stopped at different iterations: `--until common` cuts every run at the last iteration all
    of them logged (ppo-s0's rows end at 7, ppo-s1's at 9), an explicit `--until 3` at iteration 3."""
    common = runs / "common.json"
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--ema", "0.5",
                              "--until", "common", "--out", str(runs / "c.png"), "--json", str(common)])
    assert res.exit_code == 0, res.output
    ppo = json.loads(common.read_text())["arms"]["ppo"]
    # By hand (see above), at iteration 7: seed 0's EMA .25, seed 1's .75
    assert json.loads(common.read_text())["until"] == 7
    assert ppo["final_per_seed"] == [0.25, 0.75] and ppo["last_iteration"] == 7
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--ema", "0.5",
                              "--until", "3", "--out", str(runs / "t.png"), "--json", str(common)])
    assert res.exit_code == 0, res.output
    assert json.loads(common.read_text())["arms"]["ppo"]["final_per_seed"] == [0.5, 1.0]
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--until", "soon", "--out", str(runs / "x.png")])
    assert res.exit_code != 0 and "--until" in res.output
    # a list was read as its first value, quietly (a review helper's find)
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--until", "1,2", "--out", str(runs / "x.png")])
    assert res.exit_code == 2 and "--until '1,2': one iteration, or 'common'" in res.output, res.output
    assert not (runs / "x.png").exists()


def test_ema_and_worst_drop_definitions():
    assert ema([4.0, 0.0, 2.0], 0.75) == [4.0, 3.0, 2.75]
    assert ema([4.0, 0.0], 0.0) == [4.0, 0.0]
    assert worst_drop([1.0, 3.0, 2.0, 5.0, 1.5, 4.0]) == 3.5
    assert worst_drop([1.0, 2.0, 2.0]) == 0.0


def test_missing_metric_names_it_and_the_keys_there(runs):
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s0"), "--metric", "acuracy",
                              "--out", str(runs / "x.png")])
    assert res.exit_code == 2
    assert squash("metric 'acuracy' not in metrics.jsonl; numeric keys there: eval/mean@1, loss") in squash(res.output)
    write_run(runs / "nan-s0", eval_rows({0: None, 1: None}))
    res = runner.invoke(app, ["plot", "curves", str(runs / "nan-s0"), "--metric", EVAL])
    assert res.exit_code == 2 and squash(f"metric '{EVAL}' is null in every row that has it (not finite") in squash(res.output)
    assert not (runs / "x.png").exists()


def test_glob_matching_nothing_is_a_clear_error(runs):
    res = runner.invoke(app, ["plot", "curves", str(runs / "dpo-s*"), "--out", str(runs / "x.png")])
    assert res.exit_code == 2 and squash(f"{runs / 'dpo-s*'}: matches no run folder") in squash(res.output)
    res = runner.invoke(app, ["plot", "curves", "--arm", "dpo", "--out", str(runs / "x.png")])
    assert res.exit_code == 2 and "NAME=GLOB" in res.output
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s0"), "--ema", "1"])
    assert res.exit_code == 2 and "--ema" in res.output
    assert not (runs / "x.png").exists()


def test_same_folder_name_under_two_parents_needs_named_arms(runs):
    write_run(runs / "again" / "ppo-s0", eval_rows({1: 0.5}))
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), str(runs / "again" / "ppo-s0"),
                              "--metric", EVAL, "--out", str(runs / "x.png")])
    assert res.exit_code == 2 and "--arm NAME=GLOB" in res.output


def test_iteration_time_csv_matches_hand_computation(tmp_path):
    phases = lambda it, r, w, u, s, t: {"iteration": it, "time_rollout": r, "time_reward": w, "time_update": u,
                                        "time_sync": s, "time_total": t}
    write_run(tmp_path / "a", [phases(0, 9.0, 9.0, 9.0, 9.0, 99.0),  # warm-up, left out by --skip 1
                               phases(1, 1.0, 0.5, 2.0, 0.25, 4.0), phases(2, 3.0, 0.5, 4.0, 0.75, 9.0)])
    write_run(tmp_path / "b", [dict(phases(i, 2.0, 0.0, 1.0, 0.0, 4.0), time_sleep_wake=0.5) for i in (0, 1)])
    out = tmp_path / "t.png"
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "a"), str(tmp_path / "b"), "--skip", "1",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    got = [(r["run"], r["phase"], float(r["mean_s"]), float(r["share"]), int(r["iterations"]))
           for r in read_csv(tmp_path / "t.csv")]
    # a, iterations 1-2 (recorded before sleep/wake was timed: sleep 0): rollout 2, reward .5, update 3,
    # sync .5, total 6.5 -> other .5
    # b, iteration 1: rollout 2, update 1, sleep .5, total 4 -> other .5
    assert got == [("a", "rollout", 2.0, 2 / 6.5, 2), ("a", "reward", 0.5, 0.5 / 6.5, 2),
                   ("a", "update", 3.0, 3 / 6.5, 2), ("a", "sync", 0.5, 0.5 / 6.5, 2),
                   ("a", "sleep_wake", 0.0, 0.0, 2), ("a", "other", 0.5, 0.5 / 6.5, 2),
                   ("b", "rollout", 2.0, 0.5, 1), ("b", "reward", 0.0, 0.0, 1), ("b", "update", 1.0, 0.25, 1),
                   ("b", "sync", 0.0, 0.0, 1), ("b", "sleep_wake", 0.5, 0.125, 1), ("b", "other", 0.5, 0.125, 1)]


def test_iteration_time_names_a_missing_phase(tmp_path):
    write_run(tmp_path / "a", [{"iteration": 0, "time_rollout": 1.0, "time_total": 2.0}])
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "a"), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and "'time_reward' missing at iteration 0" in res.output


def test_iteration_time_draws_no_negative_other_and_says_why_phases_outgrow_the_iteration(tmp_path, caplog):
    """The loop times every phase inside time_total, but a multi-GPU run recorded before 2026-12-06 took each phase's
    maximum over the ranks (or a file was edited): phases adding up past time_total drew a negative `other` bar.
    It is drawn as 0 with a warning that says so; a float-rounding excess is an `other` of 0 without one."""
    import logging

    from kv4rl.telemetry.phases import means_of

    timed = {"time_rollout": 2.0, "time_reward": 0.5, "time_update": 1.0, "time_sync": 0.5}
    write_run(tmp_path / "a", [{"iteration": 0, **timed, "time_total": 3.5}])
    with caplog.at_level(logging.WARNING):
        res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "a"), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    assert any("add up to 4, more than the mean time_total 3.5" in r.getMessage() for r in caplog.records)
    other = [r for r in csv.DictReader((tmp_path / "t.csv").open()) if r["phase"] == "other"]
    assert [float(r["mean_s"]) for r in other] == [0.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        means = means_of([{"iteration": 0, "time_rollout": 0.1, "time_reward": 0.2, "time_update": 0.0,
                           "time_sync": 0.0, "time_total": 0.3}], "r")  # 0.1 + 0.2 is 0.30000000000000004
    assert means["other"] == 0.0 and not caplog.records


A, B = "a1" * 8, "b2" * 8  # two starting models' fingerprints, as metrics rows record them


def model_rows(*models):
    """One row per iteration, recording `models[i]` as its starting model (None: the field left out)."""
    return [{"iteration": i, "accuracy": 0.5, **({"model_sha256": m} if m is not None else {})}
            for i, m in enumerate(models)]


def test_runs_from_different_models_are_flagged_and_can_be_refused(tmp_path):
    write_run(tmp_path / "kv-s0", model_rows(None, A, A))  # the first recorded value counts
    write_run(tmp_path / "kv-s1", model_rows(B, B))
    write_run(tmp_path / "base-s0", model_rows(None, None))  # written before rows carried it
    runs = [str(tmp_path / "kv-s*"), str(tmp_path / "base-s0")]
    res = runner.invoke(app, ["plot", "curves", *runs, "--out", str(tmp_path / "c.png"),
                              "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    text = squash(res.output)
    assert "warning:" in text and squash("started from 2 different models") in text
    assert f"{A}->{tmp_path / 'kv-s0'}" in text and f"{B}->{tmp_path / 'kv-s1'}" in text
    summary = json.loads((tmp_path / "c.json").read_text())
    assert summary["starting_models"] == {A: [str(tmp_path / "kv-s0")], B: [str(tmp_path / "kv-s1")],
                                          "unknown": [str(tmp_path / "base-s0")]}
    assert summary["model_changes"] == {}

    out = tmp_path / "refused"
    res = runner.invoke(app, ["plot", "curves", *runs, "--require-same-model", "--out", str(out / "c.png"),
                              "--json", str(out / "c.json")])
    assert res.exit_code == 2 and "--require-same-model" in res.output and B in squash(res.output)
    assert not out.exists()


def test_runs_from_one_model_give_one_group_and_no_warning(tmp_path):
    write_run(tmp_path / "kv-s0", model_rows(A, A))
    write_run(tmp_path / "kv-s1", model_rows(A, A))  # as long as kv-s0 (shorter seeds are warned about)
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "kv-s*"), "--require-same-model",
                              "--out", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    assert "warning" not in res.output
    summary = json.loads((tmp_path / "c.json").read_text())
    assert summary["starting_models"] == {A: [str(tmp_path / "kv-s0"), str(tmp_path / "kv-s1")]}


def test_a_run_resumed_onto_another_build_is_flagged(tmp_path):
    write_run(tmp_path / "kv-s0", model_rows(A, A, B, B))
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "kv-s0"), "--out", str(tmp_path / "c.png"),
                              "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    assert squash(f"{tmp_path / 'kv-s0'}: its rows record 2 starting models ({A} then {B})") in squash(res.output)
    summary = json.loads((tmp_path / "c.json").read_text())
    assert summary["starting_models"] == {A: [str(tmp_path / "kv-s0")]}
    assert summary["model_changes"] == {str(tmp_path / "kv-s0"): [A, B]}
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "kv-s0"), "--require-same-model",
                              "--out", str(tmp_path / "d.png")])
    assert res.exit_code == 2 and not (tmp_path / "d.png").exists()


def test_figure_and_json_paths_are_checked_before_anything_is_written(runs):
    """A suffix matplotlib cannot write, a folder, or a path under a file: refused, and no PNG, CSV or JSON
    appears anywhere (the old behaviour plotted first and failed after)."""
    (runs / "afile").write_text("")
    (runs / "adir").mkdir()
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    cases = [(["--out", str(runs / "c.txt")], "cannot write a '.txt' figure"),
             (["--out", str(runs / "afile" / "c.png")], "afile is a file"),
             (["--out", str(runs / "adir")], "is a directory"),
             (["--json", str(runs / "adir")], "is a directory"),
             (["--out", str(runs / "c.png"), "--json", str(runs / "afile" / "s.json")], "afile is a file")]
    for args, needle in cases:
        res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, *args])
        assert res.exit_code == 2 and squash(needle) in squash(res.output), (args, res.output)
    res = runner.invoke(app, ["plot", "iteration-time", str(runs / "ppo-s0"), "--out", str(runs / "t.svgx")])
    assert res.exit_code == 2 and "cannot write a '.svgx' figure" in " ".join(res.output.split())
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before


def test_a_figure_path_without_a_suffix_is_a_png_and_is_named_as_written(runs):
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--out", str(runs / "fig")])
    assert res.exit_code == 0, res.output
    assert (runs / "fig.png").read_bytes()[:4] == b"\x89PNG" and (runs / "fig.csv").is_file()
    assert f"wrote {runs / 'fig.png'} and {runs / 'fig.csv'}" in " ".join(res.output.split())


def test_a_glob_leaves_out_runs_set_aside_by_overwrite(runs):
    """`train --overwrite` moves a seed's old run to ppo-s0.old-<time>; `ppo-s*` must not plot it as an arm."""
    write_run(runs / "ppo-s0.old-20261204-232817", eval_rows({1: 0.0}))
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--out", str(runs / "c.png"),
                              "--json", str(runs / "c.json")])
    assert res.exit_code == 0, res.output
    assert list(json.loads((runs / "c.json").read_text())["arms"]) == ["ppo"]
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s0.old-*"), "--metric", EVAL,
                              "--out", str(runs / "d.png")])
    assert res.exit_code == 2 and "set aside by --overwrite (name one to plot it)" in " ".join(res.output.split())
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s0.old-20261204-232817"), "--metric", EVAL,
                              "--out", str(runs / "e.png")])
    assert res.exit_code == 0, res.output


def test_a_run_whose_last_row_a_crash_cut_short_is_plotted_from_its_whole_rows(runs, caplog):
    """A kill mid-write leaves half a JSON line; every plot command refused such a run ("Expecting value")."""
    metrics = runs / "ppo-s0" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + json.dumps({"iteration": 8, "loss": 0.8, "time_total": 1.0})[:25])
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s0"), "--metric", EVAL,
                              "--out", str(runs / "c.png")])
    assert res.exit_code == 0, res.output
    assert {int(r["iteration"]) for r in read_csv(runs / "c.csv")} <= set(range(8))
    assert f"{metrics}:9 is not a JSON row (cut short?); skipped" in caplog.text
    phases = {"time_rollout": 1.0, "time_reward": 0.0, "time_update": 1.0, "time_sync": 0.0, "time_total": 2.0}
    write_run(runs / "t", [{"iteration": 0, **phases}])
    (runs / "t" / "metrics.jsonl").write_text((runs / "t" / "metrics.jsonl").read_text() + '{"iteration": 1, "ti')
    res = runner.invoke(app, ["plot", "iteration-time", str(runs / "t"), "--out", str(runs / "t.png")])
    assert res.exit_code == 0, res.output
    assert [int(r["iterations"]) for r in read_csv(runs / "t.csv")] == [1] * 6
    # in a process of its own the warning reads as the CLI's (it came bare, without its line break, the table
    # printed onto its end): `plot` sets up the log lines as train and bench do
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kv4rl.cli", "plot", "curves", str(runs / "ppo-s0"), "--metric",
                           EVAL, "--out", str(runs / "d.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"warning: {metrics}:9 is not a JSON row (cut short?); skipped\n" in done.stderr, done.stderr


def test_no_output_may_replace_a_runs_records_or_another_output(runs):
    """`--json runs/ppo-s0/metrics.jsonl` replaced the training log with the summary, and `--json` equal to
    the CSV replaced the curve numbers: refused, nothing written, the run's files as they were."""
    log = (runs / "ppo-s0" / "metrics.jsonl").read_bytes()
    (runs / "ppo-s0" / "config.yaml").write_text("name: ppo-s0\n")
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    cases = [(["--json", str(runs / "ppo-s0" / "metrics.jsonl")], "is the metrics.jsonl of the run in"),
             (["--json", str(runs / "ppo-s0" / "config.yaml")], "is the config.yaml of the run in"),
             (["--out", str(runs / "q.png"), "--json", str(runs / "q.csv")], "is also the CSV beside --out"),
             (["--out", str(runs / "q.png"), "--json", str(runs / "q.png")], "is also --out")]
    for args, needle in cases:
        res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, *args])
        assert res.exit_code == 2 and squash(needle) in squash(res.output), (args, res.output)
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before
    assert (runs / "ppo-s0" / "metrics.jsonl").read_bytes() == log


def test_no_plot_output_may_land_on_any_runs_records_or_checkpoints(runs):
    """`--json <run>/checkpoints/latest`, `.../checkpoint.json`, `<run>/train.log` or its TensorBoard events, and a
    figure in a checkpoint (pruning deletes it whole) were written without a word, also for a run not plotted, and
    `plot rollout-trace` checked no output at all: each is refused, nothing written."""
    other = runs / "other" / "base-s0"
    for run in (runs / "ppo-s0", other):
        (run / "config.yaml").write_text("name: x\n")
        ckpt = run / "checkpoints" / "iter_000001"
        ckpt.mkdir(parents=True)
        (ckpt / "checkpoint.json").write_text("{}")
        (run / "checkpoints" / "latest").write_text("iter_000001\n")
        (run / "train.log").write_text("log\n")
        (run / "events.out.tfevents.1.host.1.0").write_bytes(b"tb")
        (run / "rollout_trace.jsonl").write_text(json.dumps({"iteration": 0, "step": 0, "batch": 1}) + "\n")
    before = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    plotted = str(runs / "ppo-s*")
    cases = [(["--json", str(other / "checkpoints" / "latest")], "inside the checkpoints/ of run"),
             (["--json", str(runs / "ppo-s0" / "checkpoints" / "iter_000001" / "checkpoint.json")],
              "inside the checkpoints/ of run"),
             (["--json", str(other / "train.log")], "is the train.log of the run"),
             (["--json", str(other / "events.out.tfevents.1.host.1.0")], "is the events.out.tfevents.1.host.1.0 of"),
             (["--out", str(other / "checkpoints" / "iter_000001" / "fig.png")], "inside the checkpoints/ of run")]
    for args, needle in cases:
        res = runner.invoke(app, ["plot", "curves", plotted, "--metric", EVAL, *args])
        assert res.exit_code == 2 and squash(needle) in squash(res.output), (args, res.output)
    res = runner.invoke(app, ["plot", "rollout-trace", str(other), "--out",
                              str(other / "checkpoints" / "iter_000001" / "trace.png")])
    assert res.exit_code == 2 and squash("inside the checkpoints/ of run") in squash(res.output), res.output
    assert {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()} == before
    res = runner.invoke(app, ["plot", "curves", plotted, "--metric", EVAL, "--out", str(other / "fig.png")])
    assert res.exit_code == 0, res.output  # beside a run's records is fine


@pytest.mark.parametrize("line,needle", [("1.5", "a JSON float, not a metrics row"),
                                         ('{"accuracy": 0.5}', "a row without an integer 'iteration'"),
                                         ('{"iteration": 1, "accuracy": 0.5}', "iteration 1 again (first at line 2)")])
def test_a_metrics_file_kv4rl_did_not_write_is_refused_naming_the_line(tmp_path, line, needle):
    """A bare number or a row without an iteration was a traceback; an iteration written twice was drawn as a
    second seed (n_seeds 2 for one run, and its EMA ran over the duplicate)."""
    write_run(tmp_path / "a-s0", [{"iteration": 0, "accuracy": 0.25}, {"iteration": 1, "accuracy": 0.75}])
    with (tmp_path / "a-s0" / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    for args in (["curves", str(tmp_path / "a-s0")], ["iteration-time", str(tmp_path / "a-s0")],
                 ["mismatch", str(tmp_path / "a-s0")]):
        res = runner.invoke(app, ["plot", *args, "--out", str(tmp_path / "o.png")])
        assert res.exit_code == 2 and squash(f"metrics.jsonl:3: {needle}") in squash(res.output), (args, res.output)
    assert not (tmp_path / "o.png").exists()


def test_non_finite_numbers_written_by_hand_are_skipped_as_nulls(tmp_path):
    """NaN / Infinity (JSON extensions kv4rl never writes: it stores null) made every mean NaN; they count as
    nulls, so the curve is the EMA of the finite values (0.5, 0.7 with decay 0.5: 0.5, 0.6)."""
    (tmp_path / "n-s0").mkdir()
    (tmp_path / "n-s0" / "metrics.jsonl").write_text(
        '{"iteration": 0, "accuracy": NaN}\n{"iteration": 1, "accuracy": 0.5}\n'
        '{"iteration": 2, "accuracy": Infinity}\n{"iteration": 3, "accuracy": 0.7}\n')
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "n-s0"), "--ema", "0.5",
                              "--out", str(tmp_path / "n.png"), "--json", str(tmp_path / "n.json")])
    assert res.exit_code == 0, res.output
    rows = read_csv(tmp_path / "n.csv")
    assert [(int(r["iteration"]), float(r["mean"])) for r in rows] == [(1, 0.5), (3, pytest.approx(0.6))]
    assert json.loads((tmp_path / "n.json").read_text())["arms"]["n"]["final_mean"] == pytest.approx(0.6)


def test_seeds_that_end_at_different_iterations_are_warned_about(tmp_path):
    """Seed 0 at 0.8 for iterations 0-2, seed 1 at 0.2 for 0-5: the mean curve falls 0.3 when seed 0 stops,
    a drop no seed had; the command says so and names --until common, which removes it."""
    write_run(tmp_path / "f-s0", [{"iteration": i, "accuracy": 0.8} for i in range(3)])
    write_run(tmp_path / "f-s1", [{"iteration": i, "accuracy": 0.2} for i in range(6)])
    args = ["plot", "curves", str(tmp_path / "f-s*"), "--ema", "0", "--out", str(tmp_path / "f.png")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and squash("last logged iterations differ (2 to 5)") in squash(res.output)
    assert "--until common" in " ".join(res.output.split())
    res = runner.invoke(app, [*args, "--until", "common", "--json", str(tmp_path / "f.json")])
    assert res.exit_code == 0 and "warning" not in res.output
    assert json.loads((tmp_path / "f.json").read_text())["arms"]["f"]["worst_drop_mean_curve"] == 0.0


def test_iteration_time_refusals_leave_no_folder_and_a_run_named_twice_is_one_bar(tmp_path):
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "nope"), "--out", str(tmp_path / "g" / "t.png")])
    assert res.exit_code == 2 and not (tmp_path / "g").exists()
    phases = {"time_rollout": 1.0, "time_reward": 0.0, "time_update": 2.0, "time_sync": 0.0, "time_total": 4.0}
    write_run(tmp_path / "r", [{"iteration": 0, **phases}])
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "r"), str(tmp_path / "r" / "."),
                              "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    assert {r["run"] for r in read_csv(tmp_path / "t.csv")} == {"r"} and len(read_csv(tmp_path / "t.csv")) == 6


def test_null_values_in_a_curve_are_said_and_a_null_phase_is_called_null(tmp_path, caplog):
    """A null grad_norm (a step with no finite gradient) disappeared from the figure without a word; a null
    time_update was reported as 'missing'."""
    write_run(tmp_path / "g-s0", [{"iteration": 0, "grad_norm": 1.0}, {"iteration": 1, "grad_norm": None},
                                  {"iteration": 2, "grad_norm": 0.5}])
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "g-s0"), "--metric", "grad_norm",
                              "--out", str(tmp_path / "g.png")])
    assert res.exit_code == 0, res.output
    assert squash("arm g: 1 row(s) logged grad_norm as null (not finite, or not measured there)") in squash(res.output)
    row = {"iteration": 0, "time_rollout": 1.0, "time_reward": 0.1, "time_update": None, "time_sync": 0.0,
           "time_total": 2.0}
    write_run(tmp_path / "t", [row])
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "t"), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and "'time_update' null at iteration 0" in res.output


def test_until_common_warns_of_a_torn_line_once(tmp_path, caplog):
    import logging

    write_run(tmp_path / "u-s0", [{"iteration": i, "accuracy": 0.5} for i in range(3)])
    with open(tmp_path / "u-s0" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "accu')
    with caplog.at_level(logging.WARNING):
        res = runner.invoke(app, ["plot", "curves", str(tmp_path / "u-s0"), "--until", "common",
                                  "--out", str(tmp_path / "u.png")])
    assert res.exit_code == 0, res.output
    assert len([m for m in caplog.messages if "metrics.jsonl:4 is not a JSON row" in m]) == 1


def test_iteration_time_of_a_split_run_stacks_the_learners_wait_for_rollouts(tmp_path):
    """A split run's engines roll out beside the update: its time_rollout (2.0 s) and time_reward added up past
    the learner's time_total (1.5 s), a negative `other`. The learner waited 0.4 s for them."""
    row = {"iteration": 0, "time_rollout": 2.0, "time_reward": 0.3, "time_update": 0.9, "time_sync": 0.1,
           "time_learner_wait": 0.4, "time_total": 1.5}
    write_run(tmp_path / "s", [row])
    res = runner.invoke(app, ["plot", "iteration-time", str(tmp_path / "s"), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    shares = {r["phase"]: float(r["mean_s"]) for r in read_csv(tmp_path / "t.csv")}
    assert shares["rollout"] == 0.4 and shares["reward"] == 0.0
    assert shares["other"] == pytest.approx(0.1) and shares["other"] >= 0



def test_until_before_a_metrics_first_row_and_common_with_an_empty_run_name_the_cause(runs, tmp_path):
    """An eval logged from iteration 1 on, cut at --until 0, was reported as 'not in metrics.jsonl'; a run
    with no rows made --until common say '--until -1', a value the user never gave."""
    res = runner.invoke(app, ["plot", "curves", str(runs / "ppo-s*"), "--metric", EVAL, "--until", "0",
                              "--out", str(runs / "z.png")])
    assert res.exit_code == 2
    assert squash(f"metric '{EVAL}' is first logged at iteration 1, after --until 0") in squash(res.output), res.output
    write_run(tmp_path / "empty" / "e-s0", [{"iteration": 0, "accuracy": 0.5}])
    write_run(tmp_path / "empty" / "e-s1", [])
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "empty" / "e-s*"), "--until", "common",
                              "--out", str(tmp_path / "e.png")])
    assert res.exit_code == 2 and "--until -1" not in res.output
    assert squash(f"--until common: {tmp_path / 'empty' / 'e-s1' / 'metrics.jsonl'} has no rows to compare") \
        in squash(res.output), res.output


def test_the_starting_models_evaluation_opens_the_eval_curve(tmp_path):
    """eval.before_training logs eval_start/mean@1 in the first row: the eval curve starts there, at iteration -1
    (before the first update), and the EMA and the worst drop count it. EMA 0.5 by hand: x = .8, .2, .6 at -1, 1,
    3 -> s = .8, .5, .55; the worst drop is .8 - .5. A run without it (or with a null there) starts at 1."""
    rows = eval_rows({1: 0.2, 3: 0.6})
    rows[0]["eval_start/mean@1"] = 0.8
    write_run(tmp_path / "a-s0", rows)
    bare = eval_rows({1: 0.2, 3: 0.6})
    bare[0]["eval_start/mean@1"] = None
    write_run(tmp_path / "b-s0", bare)
    res = runner.invoke(app, ["plot", "curves", str(tmp_path / "a-s0"), str(tmp_path / "b-s0"), "--metric", EVAL,
                              "--ema", "0.5", "--out", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    got = [(int(r["iteration"]), r["arm"], float(r["mean"])) for r in read_csv(tmp_path / "c.csv")]
    assert [(i, m) for i, arm, m in got if arm == "a"] == [(-1, 0.8), (1, pytest.approx(0.5)), (3, pytest.approx(0.55))]
    assert [i for i, arm, _ in got if arm == "b"] == [1, 3]
    assert json.loads((tmp_path / "c.json").read_text())["arms"]["a"]["worst_drop_mean_curve"] == pytest.approx(0.3)
