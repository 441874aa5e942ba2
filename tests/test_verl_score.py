"""`VerlScore`: a verl `compute_score(data_source, solution_str, ground_truth, extra_info)` as a kv4rl reward, called
per response as verl's naive reward manager calls it, with the row's own columns; the README's example module
trains and evaluates on verl's Parquet through `algo.plugins`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kv4rl.data.types import Problem
from kv4rl.rewards import VerlScore, WeightedRewards, base, get_reward, register_reward


def problem(source, index):
    return Problem(problem="q", answer="7", id=str(index),
                   meta={"data_source": source, "extra_info": {"index": index}})


def test_each_response_is_scored_with_its_rows_columns_through_every_wrapper(monkeypatch):
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, dict(extra_info)))
        extra_info["seen"] = True  # verl hands a dict it may write to; the row's own stays as it was
        return {"score": float(extra_info["index"]), "acc": 1} if data_source == "a" else 0.5

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_reward("verl_fn")(lambda: VerlScore(compute_score))
    rows = [problem("a", 3), problem("b", 4)]
    result = get_reward("verl_fn")(["x", "y"], ["7", "7"], problems=rows)
    assert result.scores == [3.0, 0.5]
    turns = {"num_turns": None, "rollout_reward_scores": {}}  # as verl's naive manager adds them
    assert calls == [("a", "x", "7", {"index": 3, **turns}), ("b", "y", "7", {"index": 4, **turns})]
    assert rows[0].meta["extra_info"] == {"index": 3}
    # beside another reward, the rows reach it too; a caller without rows gives None and {}
    both = WeightedRewards([("verl_fn", get_reward("verl_fn"), 1.0), ("boxed_format", get_reward("boxed_format"), 2.0)])
    assert base.call_reward(both, ["x", "\\boxed{1}"], ["7", "7"], rows).scores == [3.0, 0.5 + 2.0]
    calls.clear()
    assert get_reward("verl_fn")(["x"], ["7"]).scores == [0.5] and calls == [(None, "x", "7", turns)]
    with pytest.raises(ValueError, match="reward got 2 responses but 1 problems"):
        get_reward("verl_fn")(["x", "y"], ["7", "7"], problems=rows[:1])


def test_a_dict_without_a_score_is_named():
    reward = VerlScore(lambda **kwargs: {"acc": 1.0})
    with pytest.raises(ValueError, match=r"compute_score returned a dict without 'score' for response 0 of 1 \(keys "
                                         r"\['acc'\]\); verl reads the reward from 'score'"):
        reward(["x"], ["7"], problems=[problem("a", 0)])


def test_the_readme_example_trains_and_evaluates_on_verl_parquet(tmp_path, monkeypatch):
    """The README's module as a user copies it: every response of the embedded model ends in a boxed answer, never
    '####', so it scores 0 on every row, and each call saw the file's `data_source`."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from typer.testing import CliRunner

    import kv4rl
    from kv4rl.cli import app
    from tests.small_runs import SMALL, train_cli

    readme = (Path(kv4rl.__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("# my_verl_reward.py\n")
    module = readme[start:readme.index("```", start)]
    seen = tmp_path / "seen.jsonl"
    module += (f"\n_inner = compute_score\n\ndef compute_score(**kwargs):\n    out = _inner(**kwargs)\n"
               f"    open({str(seen)!r}, 'a').write(__import__('json').dumps(out) + '\\n')\n    return out\n")
    (tmp_path / "my_verl_reward.py").write_text(module)
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{b}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate([(1, 1), (2, 3), (4, 4), (3, 1)])]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    try:
        res = train_cli(f"data.train={data}", "algo.plugins=[my_verl_reward]", "reward.name=gsm8k_hashes",
                        "data.prompt_template={problem}=", "trainer.iterations=1", "data.eval_size=2",
                        f"out_dir={tmp_path}", "name=r", *SMALL)
        assert res.exit_code == 0, res.output
        (row,) = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert row["reward_mean"] == 0.0
        outs = [json.loads(line) for line in seen.read_text().splitlines()]
        assert len(outs) == 4 and all(out == {"score": 0.0, "data_source": "openai/gsm8k"} for out in outs)
        seen.unlink()
        out = tmp_path / "e.json"
        res = CliRunner().invoke(app, ["eval", "--plugins", "my_verl_reward", "--reward", "gsm8k_hashes", "--data",
                                       str(data), "--k", "2", "--template", "{problem}=", "--max-new-tokens", "8",
                                       "--json", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["mean@2"] == 0.0
        assert {json.loads(line)["data_source"] for line in seen.read_text().splitlines()} == {"openai/gsm8k"}
    finally:
        sys.modules.pop("my_verl_reward", None)


def test_a_scorer_is_passed_only_the_arguments_it_names():
    """verl's own scorers take two of the four arguments (gsm8k.compute_score(solution_str, ground_truth, method,
    format_score, score), reached in verl through default_compute_score): passed as they are, they failed with
    "unexpected keyword argument 'data_source'"; one that needs an argument no manager passes is named at once."""
    import re

    def gsm8k_like(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
        found = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return score if found and found.group(1) == ground_truth else format_score

    reward = VerlScore(gsm8k_like)
    assert reward(["so #### 72", "#### 3"], ["72", "4"], problems=[problem("a", 0), problem("a", 1)]).scores == [1.0, 0.0]
    seen = []
    VerlScore(lambda **kwargs: seen.append(sorted(kwargs)) or 0.0)(["x"], ["7"], problems=[problem("a", 0)])
    assert seen == [["data_source", "extra_info", "ground_truth", "solution_str"]]
    with pytest.raises(ValueError, match=r"compute_score needs tokenizer, which a verl reward manager does not pass"):
        VerlScore(lambda solution_str, ground_truth, tokenizer: 1.0)


def test_a_non_dict_extra_info_and_a_positional_only_scorer_are_named():
    with pytest.raises(ValueError, match=r"problem 0: its extra_info is str 'note', where verl's is a dict"):
        VerlScore(lambda **kwargs: 1.0)(["x"], ["7"], problems=[Problem("q", "7", "0", meta={"extra_info": "note"})])

    def by_position(solution_str, ground_truth, /):
        return 1.0

    with pytest.raises(ValueError, match=r"compute_score takes solution_str, ground_truth by position only"):
        VerlScore(by_position)


def test_a_verl_rows_ground_truth_reaches_the_scorer_as_the_file_holds_it(tmp_path):
    """verl hands `reward_model.ground_truth` as its column holds it: a number stays a number (the gold answer's
    text, "72", is what kv4rl's own graders read)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from kv4rl.data.datasets import load_problems

    path = tmp_path / "n.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}],
                                          "reward_model": {"ground_truth": 72}}]), path)
    (row,) = load_problems(path)
    seen = []
    VerlScore(lambda solution_str, ground_truth: seen.append(ground_truth) or 1.0)(["x"], [row.answer], problems=[row])
    assert row.answer == "72" and seen == [72] and type(seen[0]) is int


def test_a_dicts_numeric_keys_are_summed_into_the_stats():
    """verl's scorers return {"score", "acc", "pred"}: each number's batch sum is a stat (a bool counts 1), text and
    non-finite values are dropped; a scorer returning numbers alone gives none."""
    outs = iter([{"score": 1.0, "acc": True, "pred": "42", "steps": 3},
                 {"score": 0.0, "acc": False, "pred": None, "steps": float("nan")},
                 {"score": 1.0, "acc": 1, "steps": 2.5}])
    result = VerlScore(lambda solution_str: next(outs))(["a", "b", "c"], ["7"] * 3)
    assert result.scores == [1.0, 0.0, 1.0] and result.stats == {"acc_sum": 2.0, "steps_sum": 5.5}
    assert VerlScore(lambda solution_str: 0.5)(["a"], ["7"]).stats == {}


def test_a_bool_score_is_1_or_0_as_verl_reads_it():
    """verl's naive manager writes a scorer's result into a float tensor, so `solution_str == ground_truth` scores
    1.0 / 0.0 there: it passes the run's score check here too (a plain kv4rl reward returning a bool is still refused
    by name), NumPy's bool and a dict's bool `score` as well."""
    import numpy as np

    outs = iter([True, np.bool_(False), {"score": True}, {"score": np.bool_(False), "acc": True}])
    checked = base.CheckedReward("bools", VerlScore(lambda solution_str, ground_truth: next(outs)))
    result = checked(["7", "3", "7", "3"], ["7"] * 4)
    assert result.scores == [1.0, 0.0, 1.0, 0.0] and all(type(x) is float for x in result.scores)
    assert result.stats == {"acc_sum": 1.0}


def test_numpy_and_tensor_numbers_count_as_numbers():
    """verl's scorers return NumPy scalars (np.bool_ from a comparison of arrays, np.float32), which verl's np.mean
    reads: they were dropped as not `int | float`; an array of several values is not one number."""
    import numpy as np
    import torch

    outs = iter([{"score": 1.0, "acc": np.bool_(True), "n": np.int64(2), "f": np.float32(0.5), "t": torch.tensor(1.5),
                  "many": np.array([1.0, 2.0])},
                 {"score": 0.0, "acc": np.bool_(False), "n": np.int64(3), "f": np.float32(np.inf), "t": torch.tensor(1)}])
    result = VerlScore(lambda solution_str: next(outs))(["a", "b"], ["7"] * 2)
    assert result.stats == {"acc_sum": 1.0, "n_sum": 5.0, "f_sum": 0.5, "t_sum": 2.5}
    huge = VerlScore(lambda solution_str: {"score": 1.0, "big": 10**400, "ok": 1})(["a"], ["7"])  # OverflowError
    assert huge.scores == [1.0] and huge.stats == {"ok_sum": 1.0}


def test_a_runs_rows_and_its_evaluation_count_a_scorers_acc(tmp_path, monkeypatch):
    """Through training and `kv4rl eval`: `reward_acc_sum` counts the responses the scorer called right, which is
    `reward_mean` (its score is the same call's 0/1) times the responses of the iteration, and `mean@k` times
    the samples of the evaluation."""
    from typer.testing import CliRunner

    from kv4rl.cli import app
    from tests.small_runs import SMALL, train_cli

    def compute_score(solution_str, ground_truth):
        right = solution_str.strip().startswith(str(ground_truth))
        return {"score": float(right), "acc": right, "pred": solution_str[:4]}

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_reward("verl_acc")(lambda: VerlScore(compute_score))
    res = train_cli("reward.name=verl_acc", "trainer.iterations=3", "rollout.quota_groups=4", "rollout.group_size=4",
                    "trainer.lr=3e-3", f"out_dir={tmp_path}", "name=r", *SMALL[2:])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_acc_sum"] for r in rows] == [r["reward_mean"] * 16 for r in rows]
    assert any(r["reward_acc_sum"] > 0 for r in rows)
    out = tmp_path / "e.json"
    model = tmp_path / "r" / "checkpoints"
    res = CliRunner().invoke(app, ["eval", "--reward", "verl_acc", "--model", str(sorted(model.glob("iter_*"))[-1]),
                                   "--k", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["reward_acc_sum"] == pytest.approx(summary["mean@2"] * 2 * summary["num_problems"])


def test_a_watchdogged_scorer_scores_as_in_process_and_a_hung_call_scores_0():
    """With timeout_s the calls run in a worker process: a call that never returns scores 0 and counts in
    `timeouts` within about the limit (the worker is restarted for the rest of the batch and the next one), the
    other scores and sums equal the in-process VerlScore's; a call that raises stops the batch naming its
    response; a scorer the worker cannot import is refused when built."""
    import time

    from tests.verl_score_fns import hangs_or_fails

    responses, golds = ["1", "hang", "2", "1"], ["1", "1", "2", "2"]
    with VerlScore(hangs_or_fails, timeout_s=1.0) as reward:
        start = time.monotonic()
        got = reward.score(responses, golds)
        assert time.monotonic() - start < 30
        assert got.scores == [1.0, 0.0, 1.0, 0.0] and got.stats == {"acc_sum": 2.0, "timeouts": 1.0}
        plain = VerlScore(hangs_or_fails).score(["1", "2", "1"], ["1", "2", "2"])
        assert [got.scores[i] for i in (0, 2, 3)] == plain.scores and plain.stats == {"acc_sum": 2.0}
        assert reward.score(["3"], ["3"]).stats == {"acc_sum": 1.0, "timeouts": 0.0}
        with pytest.raises(RuntimeError, match="compute_score failed on response 1 of 2: ValueError: cannot score boom"):
            reward.score(["1", "boom"], ["1", "1"])
        process = reward.worker.process
        assert process is not None and process.is_alive()
    assert not process.is_alive()
    with pytest.raises(ValueError, match="cannot be imported there \\(a lambda"):
        VerlScore(lambda solution_str, ground_truth: 1.0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s and startup_timeout_s must be positive and finite"):
        VerlScore(hangs_or_fails, timeout_s=float("nan"))
