"""`kv4rl plot mismatch`: the CSV against metrics rows written by hand, and errors that name the run."""

import csv
import json

from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.telemetry.mismatch_curves import SOURCES

runner = CliRunner()


def attribution_row(iteration, tokens, scale):
    """Source i logs abs_mean scale*(i+1), k3 scale*(i+1)/10, mean -scale*(i+1); total their sums."""
    row = {"iteration": iteration, "loss": 0.5, "mismatch/attributed_tokens": tokens}
    for i, source in enumerate(SOURCES):
        row |= {f"mismatch/{source}_abs_mean": scale * (i + 1), f"mismatch/{source}_k3": scale * (i + 1) / 10,
                f"mismatch/{source}_mean": -scale * (i + 1)}
    row |= {"mismatch/total_abs_mean": 21 * scale, "mismatch/total_k3": 2.0 * scale, "mismatch/total_mean": -21 * scale}
    return row


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_csv_holds_one_row_per_run_iteration_and_source(tmp_path):
    write_run(tmp_path / "kv4", [
        {"iteration": 0, "loss": 1.0},  # attribution not due
        attribution_row(3, 40, 0.5),
        {"iteration": 4, "loss": 1.0, "mismatch/attributed_tokens": 0, "mismatch/skipped_responses": 8},
        attribution_row(1, 20, 0.25),  # out of order in the file: sorted by iteration
    ])
    write_run(tmp_path / "bf16", [attribution_row(1, 10, 0.0)])  # every term exactly 0: no line, still CSV
    out = tmp_path / "fig" / "mismatch.png"
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "kv4"), str(tmp_path / "bf16"),
                              str(tmp_path / "kv4" / "."), "-o", str(out)])  # kv4 named twice: drawn once
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "iteration", "source", "abs_mean", "k3", "mean", "tokens"]
    got = [(r["run"], int(r["iteration"]), r["source"], float(r["abs_mean"]), float(r["k3"]), float(r["mean"]),
            int(r["tokens"])) for r in rows]
    names = [*SOURCES, "total"]
    expected = [("kv4", 1, "learner", 0.25, 0.025, -0.25, 20), ("kv4", 1, "staleness", 0.5, 0.05, -0.5, 20)]
    assert got[:2] == expected
    assert [g[2] for g in got] == names * 3
    assert [(g[0], g[1]) for g in got] == [("kv4", 1)] * 7 + [("kv4", 3)] * 7 + [("bf16", 1)] * 7
    assert got[6] == ("kv4", 1, "total", 5.25, 0.5, -5.25, 20)
    assert got[12] == ("kv4", 3, "kernels", 3.0, 0.3, -3.0, 40)
    assert all(g[3] == 0.0 for g in got[14:])


def test_runs_without_attribution_are_named(tmp_path):
    write_run(tmp_path / "plain", [{"iteration": 0, "loss": 1.0}])
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "plain"), "-o", str(tmp_path / "m.png")])
    assert res.exit_code != 0 and "telemetry.attribution_every" in res.output and "plain" in res.output
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "nothing"), "-o", str(tmp_path / "m.png")])
    assert res.exit_code != 0 and "no metrics.jsonl" in res.output
    assert not (tmp_path / "m.png").exists()


def test_two_runs_with_one_folder_name_stay_apart(tmp_path):
    """runs/b-s0 and dup/b-s0 were both labelled b-s0: one panel, their points joined into one zig-zag line."""
    write_run(tmp_path / "runs" / "b-s0", [attribution_row(1, 10, 0.5)])
    write_run(tmp_path / "dup" / "b-s0", [attribution_row(1, 10, 0.25)])
    out = tmp_path / "m.png"
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "runs" / "b-s0"), str(tmp_path / "dup" / "b-s0"),
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    with out.with_suffix(".csv").open() as f:
        labels = [r["run"] for r in csv.DictReader(f)]
    assert labels == [str(tmp_path / "runs" / "b-s0")] * 7 + [str(tmp_path / "dup" / "b-s0")] * 7


def test_attribution_that_ran_but_attributed_nothing_is_told_apart_from_none(tmp_path):
    """Attribution on, every response older than its window: the error said to turn attribution on."""
    write_run(tmp_path / "c", [{"iteration": 2, "mismatch/attributed_tokens": 0, "mismatch/skipped_responses": 16},
                               {"iteration": 5, "mismatch/attributed_tokens": 0, "mismatch/skipped_responses": 8}])
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "c"), "-o", str(tmp_path / "m.png")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "attribution ran at 2 iteration(s) (first 2) but attributed no tokens" in text
    assert "24 responses were skipped" in text and "attribution_every" not in text


def test_a_null_term_draws_no_point_instead_of_a_traceback(tmp_path):
    """A non-finite term is logged as null: `plot mismatch` failed comparing None > 0."""
    row = attribution_row(2, 30, 0.5)
    row["mismatch/kernels_abs_mean"] = row["mismatch/truncation_abs_mean"] = None
    write_run(tmp_path / "run", [attribution_row(1, 30, 0.5), row])
    out = tmp_path / "m.png"
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "run"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    with out.with_suffix(".csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["iteration"] == "2" and r["source"] == "kernels"]
    assert rows[0]["abs_mean"] == ""


def test_a_row_without_a_sources_term_is_named_instead_of_a_traceback(tmp_path):
    """A row with the token count but without one source's terms (a hand-edited or foreign file) raised a KeyError
    traceback (exit 1): now one line naming the run, the iteration and the key."""
    row = attribution_row(2, 10, 0.5)
    del row[f"mismatch/{SOURCES[0]}_abs_mean"]
    write_run(tmp_path / "odd", [attribution_row(1, 10, 0.5), row])
    res = runner.invoke(app, ["plot", "mismatch", str(tmp_path / "odd"), "-o", str(tmp_path / "m.png")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"iteration 2 logs mismatch/attributed_tokens but not mismatch/{SOURCES[0]}_abs_mean" \
        in text, res.output
    assert not (tmp_path / "m.png").exists()
