"""`data.max_prompt_tokens` (verl's max_prompt_length with filter_overlong_prompts): the data files' rows whose
formatted prompt is longer are dropped at start, counted in a log line; a file it would empty is refused before
any model is built; the stream's fingerprint records the limit, so a resume that changes it is refused."""

from __future__ import annotations

import json

import pytest

from kv4rl.config import ConfigError, load_config
from kv4rl.data.source import ProblemSource
from tests.small_runs import SMALL, train_cli, tree_state


def write_rows(path, problems):
    path.write_text("".join(json.dumps({"problem": p, "answer": "0"}) + "\n" for p in problems))
    return str(path)


def words(problems) -> list[int]:
    return [len(problem.problem.split()) for problem in problems]


def test_rows_longer_than_the_limit_are_dropped_from_both_files(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", ["a", "a b c", "a b", "a b c d e", "a b c d"])
    held = write_rows(tmp_path / "eval.jsonl", ["a b c d", "a"])
    source = ProblemSource(train, held, seed=0, max_prompt_tokens=3)
    said = source.drop_long_prompts(words)
    assert [p.problem for p in source.train] == ["a", "a b c", "a b"]  # the file's order, the 4- and 5-word rows gone
    assert [p.problem for p in source.eval_problems(10)] == ["a"]
    assert said == ["data.train: dropped 2 of 5 rows whose prompt is longer than data.max_prompt_tokens=3 "
                    "(longest 5 tokens)",
                    "data.eval: dropped 1 of 2 rows whose prompt is longer than data.max_prompt_tokens=3 "
                    "(longest 4 tokens)"]
    assert source.drop_long_prompts(words) == []  # a second pass (the loop's, then the engine's) drops nothing
    assert {source.problem_at(i).problem for i in range(9)} == {"a", "a b c", "a b"}  # epochs over the kept rows
    # no limit: the fingerprint is what it always was; a limit is part of it, whatever was dropped
    plain = ProblemSource(train, held, seed=0).stream_fingerprint()
    assert ProblemSource(train, held, seed=0, max_prompt_tokens=None).stream_fingerprint() == plain
    assert source.stream_fingerprint()["sha256"] != plain["sha256"]
    assert ProblemSource(train, held, seed=0, max_prompt_tokens=3).stream_fingerprint() == source.stream_fingerprint()


def test_a_file_it_would_empty_is_refused_by_name(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", ["a b c", "a b"])
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens=1 drops every row of data.train \(2 rows; its "
                                         r"shortest prompt is 2 tokens\)"):
        ProblemSource(train, None, seed=0, max_prompt_tokens=1).drop_long_prompts(words)


def test_the_limit_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="data.max_prompt_tokens must be >= 1"):
        load_config(None, ["data.max_prompt_tokens=0", f"data.train={tmp_path / 'x.jsonl'}"])
    with pytest.raises(ConfigError, match="data.max_prompt_tokens drops rows of the data.train / data.eval files, "
                                          "and this run has neither"):
        load_config(None, ["data.max_prompt_tokens=10"])


def test_a_run_trains_without_the_prompts_that_would_not_fit(tmp_path, caplog):
    """The embedded model has 64 positions: a 70-character prompt fills them (its tokenizer spells characters), so
    the run is refused without the limit and trains with it."""
    long_problem = "+".join(["1"] * 35)  # 69 characters + '=' = 70 tokens
    train = write_rows(tmp_path / "train.jsonl", ["1+1", "2+3", long_problem, "4+4"])
    common = [f"data.train={train}", "data.prompt_template={problem}=", "reward.name=exact", "trainer.iterations=2",
              "data.eval_size=2", f"out_dir={tmp_path}", *SMALL]
    refused = train_cli(*common, "name=plain")
    assert refused.exit_code != 0 and "leaves no room for a response" in refused.output
    with caplog.at_level("INFO", logger="kv4rl"):
        res = train_cli(*common, "name=limited", "data.max_prompt_tokens=20")
    assert res.exit_code == 0, res.output
    assert "data.train: dropped 1 of 4 rows whose prompt is longer than data.max_prompt_tokens=20 (longest 70 " \
           "tokens)" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "limited" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1]


def test_a_resume_that_changes_the_limit_is_refused_and_one_that_keeps_it_goes_on(tmp_path):
    """Another limit keeps other rows, so the run's place in the stream would point at other problems."""
    train = write_rows(tmp_path / "train.jsonl", ["1+1", "2+3", "1+1+1+1+1+1", "4+4"])
    run = tmp_path / "r"
    common = [f"data.train={train}", "data.prompt_template={problem}=", "reward.name=exact", "checkpoint.save_every=1"]
    res = train_cli(f"out_dir={tmp_path}", "name=r", *SMALL, *common, "trainer.iterations=1", "data.max_prompt_tokens=8")
    assert res.exit_code == 0, res.output
    before = tree_state(run)
    res = train_cli("--resume", str(run), "trainer.iterations=2", "data.max_prompt_tokens=20", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "differs from the checkpoint's (max_prompt_tokens 8 -> 20)" in text, text
    assert tree_state(run) == before  # refused before the folder was touched
    # the same limit over another prompt format keeps other rows too (QA: a chat template took 344 of GSM8K's
    # rows where the plain template took 61, and the resume went on)
    res = train_cli("--resume", str(run), "trainer.iterations=2", "data.prompt_template={problem} = ?", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "(prompt_format ['{problem}=', False] -> ['{problem} = ?', False])" in text, text
    assert tree_state(run) == before
    res = train_cli("--resume", str(run), "trainer.iterations=2", "--no-progress")
    assert res.exit_code == 0, res.output  # the recorded config keeps the limit


def test_a_limit_on_the_eval_file_alone_leaves_the_training_stream_as_it_was(tmp_path):
    """Training on the embedded task, the limit drops only evaluation rows: a resume that changes it was refused as
    a changed training stream (QA)."""
    held = write_rows(tmp_path / "eval.jsonl", ["a b c d", "a"])
    plain = ProblemSource(None, held, seed=0).stream_fingerprint()
    assert ProblemSource(None, held, seed=0, max_prompt_tokens=3, prompt_format=["{problem}", True]
                         ).stream_fingerprint() == plain
