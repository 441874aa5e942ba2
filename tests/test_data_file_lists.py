"""`data.train` / `data.eval` as a list of files (verl's `train_files: [gsm8k/train.parquet, math/train.parquet]`):
their rows one file after another, whatever each file's format, checked as one file's are, and a run on the list
trains as on one file holding the same rows in the same order."""

from __future__ import annotations

import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from kv4rl.config import ConfigError, load_config  # noqa: E402
from kv4rl.data.datasets import DatasetError, load_jsonl, read_problems  # noqa: E402
from kv4rl.data.source import ProblemSource  # noqa: E402
from tests.small_runs import SMALL, train_cli  # noqa: E402
from tests.test_parquet_data import verl_row, write_parquet  # noqa: E402

FIRST = [("1+1", "2"), ("2+3", "5"), ("4+4", "8")]
SECOND = [("3+1", "4"), ("2+2", "4"), ("5+1", "6")]


def files(tmp_path):
    """verl's Parquet in one folder, JSON Lines of the same file name in another (verl's gsm8k/ and math/), and one
    JSON Lines file holding all six rows in order."""
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "math").mkdir()
    verl = write_parquet(tmp_path / "gsm8k" / "train.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(FIRST)])
    plain = tmp_path / "math" / "train.parquet.jsonl"
    plain.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in SECOND))
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in FIRST + SECOND))
    return verl, plain, whole


def test_a_list_reads_its_files_rows_in_order(tmp_path):
    verl, plain, whole = files(tmp_path)
    problems, layout = read_problems([str(verl), str(plain)])
    assert [(p.problem, p.answer) for p in problems] == [(p.problem, p.answer) for p in load_jsonl(whole)]
    assert layout == "verl" and read_problems([str(plain)])[1] == "jsonl"
    source = ProblemSource([str(plain), str(verl)], [str(verl)], seed=0)
    assert [p.problem for p in source.train] == [q for q, _ in SECOND + FIRST]
    assert [p.problem for p in source.eval_file] == [q for q, _ in FIRST]
    assert source.verl_prompt_notes(None, False)[0].startswith("data.train and data.eval hold verl's prompts")
    # the order is the stream: a resume on the list reordered is refused as an edited file is
    again = ProblemSource([str(plain), str(verl)], None, seed=0).stream_fingerprint()
    assert again == source.stream_fingerprint()
    assert ProblemSource([str(verl), str(plain)], None, seed=0).stream_fingerprint()["sha256"] != again["sha256"]


def test_a_bad_list_is_named(tmp_path):
    verl, plain, _ = files(tmp_path)
    with pytest.raises(ConfigError, match=r"data.train is empty"):
        load_config(None, ["data.train=[]"])
    with pytest.raises(ConfigError, match=r"data.eval\[1\] is empty; give a path"):
        load_config(None, [f"data.eval=[{verl},'']"])
    with pytest.raises(DatasetError, match=r"dataset file .*missing.jsonl does not exist"):
        read_problems([str(verl), str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "q"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl"):
        read_problems([str(plain), str(bad)])
    with pytest.raises(ConfigError, match=r"data.train: \[1, 2\] is not of type .* \(a path, or a list of paths, "
                                          r"each written as text\)"):
        load_config(None, ["data.train=[1,2]"])
    cfg = load_config(None, ["data.train=[gsm8k/train.parquet,~/math.jsonl]"])  # each made absolute, as one is
    assert cfg.data.train[0].endswith("/gsm8k/train.parquet") and cfg.data.train[0].startswith("/")
    assert not cfg.data.train[1].startswith("~")


def test_a_run_on_a_list_trains_as_on_one_file_of_the_same_rows(tmp_path):
    """The embedded tiny model on verl's Parquet then JSON Lines, against one JSON Lines file of the six rows: the
    same problems in the same order, so the same rewards, losses and weights, iteration by iteration."""
    verl, plain, whole = files(tmp_path)
    common = ["data.prompt_template={problem}=", "reward.name=exact", "trainer.iterations=2", "data.eval_size=2",
              f"out_dir={tmp_path}", *SMALL]
    res = train_cli(f"data.train=[{verl},{plain}]", f"data.eval=[{plain}]", "name=list", *common)
    assert res.exit_code == 0, res.output
    res = train_cli(f"data.train={whole}", f"data.eval={plain}", "name=one", *common)
    assert res.exit_code == 0, res.output

    def learned(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{key: value for key, value in row.items() if not key.startswith("time_") and key != "tokens_per_s"}
                for row in rows]

    assert len(learned("list")) == 2 and learned("list") == learned("one")
    assert load_config(tmp_path / "list" / "config.yaml").data.train == [str(verl), str(plain)]


def test_an_evaluation_over_several_data_sources_reports_each():
    """Rows of two `data_source`s (verl's column): mean@2 and pass@j of each over its own problems, by hand, beside
    the whole set's; rows without one count in the whole only, and one source alone adds nothing."""
    from kv4rl.data.types import Problem
    from kv4rl.eval.runner import ProblemResult, summarize_results

    def row(source):
        return Problem("q", "1", "x", meta={} if source is None else {"data_source": source})

    problems = [row("openai/gsm8k"), row("math"), row("openai/gsm8k"), row(None)]
    scores = [(1.0, 0.0), (1.0, 1.0), (0.0, 0.0), (1.0, 0.0)]
    results = [ProblemResult(i, s, (3, 4), ("", "")) for i, s in enumerate(scores)]
    out = summarize_results(results, 2, {}, problems)
    assert out["mean@2"] == pytest.approx(4 / 8) and out["num_problems"] == 4
    assert out["openai/gsm8k/mean@2"] == pytest.approx(1 / 4) and out["openai/gsm8k/pass@2"] == pytest.approx(1 / 2)
    assert out["openai/gsm8k/pass@1"] == pytest.approx(1 / 4) and out["openai/gsm8k/num_problems"] == 2
    assert out["math/mean@2"] == 1.0 and out["math/pass@2"] == 1.0 and out["math/num_problems"] == 1
    # the row without one is verl's `unknown`: every row counts in one source (the breakdown left it out)
    assert out["unknown/mean@2"] == 0.5 and out["unknown/num_problems"] == 1
    assert out["openai/gsm8k/score_mean"] == pytest.approx(1 / 4) and out["math/score_mean"] == 1.0
    assert not [key for key in out if "None" in key]
    alone = summarize_results(results[:1] + results[2:3], 2, {}, problems)
    assert not [key for key in alone if "/" in key]
    unnamed = [row(None)] * 4
    assert not [key for key in summarize_results(results, 2, {}, unnamed) if "/" in key]


def test_a_sources_name_like_a_metric_is_not_read_as_the_whole_sets():
    """A data_source "mean@2" gave `eval/mean@2/mean@2`, which the progress line and the start-of-run line read as
    the whole set's mean@k (prefix matches)."""
    from kv4rl.telemetry.progress import train_stats

    row = {"reward_mean": 0.5, "accuracy": 0.5, "eval/mean@2": 0.25, "eval/mean@2/mean@2": 0.0,
           "eval/mean@2/num_problems": 4, "tokens_per_s": 10.0, "response_len_mean": 3.0}
    assert [item for item in train_stats(row) if item.startswith("eval@")] == ["eval@2 0.250"]


def test_a_lists_rows_without_ids_are_told_apart_by_path(tmp_path):
    """verl's gsm8k/train.parquet and math/train.parquet both gave `train.parquet:1`, ...; the same file twice the
    same ids again."""
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "math").mkdir()
    one = write_parquet(tmp_path / "gsm8k" / "train.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(FIRST)])
    two = write_parquet(tmp_path / "math" / "train.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(SECOND)])
    ids = [p.id for p in read_problems([str(one), str(two)])[0]]
    assert ids == [f"{d}/train.parquet:{i}" for d in ("gsm8k", "math") for i in (1, 2, 3)]
    plain = tmp_path / "a.jsonl"
    plain.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    assert [p.id for p in read_problems([str(plain), str(one), str(plain)])[0]] == [
        "a.jsonl:1", "gsm8k/train.parquet:1", "gsm8k/train.parquet:2", "gsm8k/train.parquet:3", "a.jsonl#2:1"]
    assert [p.id for p in read_problems([str(plain)])[0]] == ["a.jsonl:1"]


def test_a_runs_evaluation_on_two_verl_files_reports_each_source(tmp_path):
    """`data.eval` a list of two verl files: the run's eval rows carry each data_source's mean@k and num_problems,
    whose problem-weighted mean is the whole set's."""
    gsm8k = write_parquet(tmp_path / "gsm8k.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(FIRST)])
    other = [dict(verl_row(q, a, i), data_source="lighteval/MATH") for i, (q, a) in enumerate(SECOND)]
    math = write_parquet(tmp_path / "math.parquet", other)
    res = train_cli(f"data.train={gsm8k}", f"data.eval=[{gsm8k},{math}]", "data.prompt_template={problem}=",
                    "reward.name=exact", "trainer.iterations=1", "eval.every=1", "eval.k=2", "data.eval_size=null",
                    f"out_dir={tmp_path}",
                    "name=r", *SMALL)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in rows if "eval/mean@2" in r][-1:]
    assert last["eval/openai/gsm8k/num_problems"] == 3 and last["eval/lighteval/MATH/num_problems"] == 3
    assert last["eval/mean@2"] == pytest.approx((last["eval/openai/gsm8k/mean@2"]
                                                 + last["eval/lighteval/MATH/mean@2"]) / 2)


def test_an_evaluation_set_cut_by_eval_size_is_said(tmp_path):
    """verl validates on every row of val_files; data.eval_size (256) took the first rows of a list's first files
    without a word."""
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.rollout.build import prompt_warnings
    from tests.test_parquet_data import _Spelled

    verl, plain, whole = files(tmp_path)

    def said(*overrides):
        cfg = load_config(None, [f"data.train={whole}", "data.prompt_template={problem}=", "reward.name=exact",
                                 *overrides])
        source = ProblemSource(cfg.data.train, cfg.data.eval, seed=0)
        return [line for line in prompt_warnings(cfg, source, PromptFormatter(_Spelled(), "{problem}="))
                if "rows" in line]

    assert said(f"data.eval=[{verl},{plain}]", "data.eval_size=4", "eval.every=5") == [
        "data.eval holds 6 rows; each evaluation uses its first 4 (data.eval_size), the first files of the list, where "
        "verl's validation uses every row: data.eval_size=null evaluates them all"]
    assert said(f"data.eval=[{verl},{plain}]", "data.eval_size=6", "eval.every=5") == []
    assert said(f"data.eval=[{verl},{plain}]", "data.eval_size=null", "eval.every=5") == []
    source = ProblemSource(str(whole), [str(verl), str(plain)], seed=0)
    assert len(source.eval_problems(None)) == 6 and len(source.eval_problems(4)) == 4
    assert len(ProblemSource(str(whole), None, seed=0).eval_problems(None)) == 6  # the training rows, all of them
    with pytest.raises(ConfigError, match=r"data.eval_size=null evaluates every row of a data file, and this run has "
                                          r"none"):
        load_config(None, ["data.eval_size=null"])
    assert said(f"data.eval={whole}", "data.eval_size=4") == []  # no evaluation, nothing cut
    assert said(f"data.eval={whole}", "data.eval_size=4", "eval.before_training=true")[0].startswith(
        "data.eval holds 6 rows; each evaluation uses its first 4 (data.eval_size), where")


def test_kv4rl_eval_takes_several_data_files_as_a_run_does(tmp_path):
    """`--data a --data b` kept only the last file: now both, in order, reported by data_source as a run's eval."""
    from typer.testing import CliRunner

    from kv4rl.cli import app

    verl, plain, whole = files(tmp_path)
    other = write_parquet(tmp_path / "math.parquet", [dict(verl_row(q, a, i), data_source="lighteval/MATH")
                                                      for i, (q, a) in enumerate(SECOND)])
    out = tmp_path / "e.json"
    res = CliRunner().invoke(app, ["eval", "--data", str(verl), "--data", str(other), "--k", "2", "--template",
                                   "{problem}=", "--reward", "exact", "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["num_problems"] == 6 and summary["data"] == f"{verl}, {other}"
    assert summary["openai/gsm8k/num_problems"] == 3 and summary["lighteval/MATH/num_problems"] == 3
    res = CliRunner().invoke(app, ["eval", "--data", str(plain), "--data", str(verl), "--samples", str(verl)])
    assert res.exit_code != 0 and f"--samples {verl} is also --data {verl}" in res.output
