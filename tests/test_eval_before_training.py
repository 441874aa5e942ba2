"""`eval.before_training` (verl's val_before_train): the starting model evaluated once before the first iteration,
logged as `eval_start/*` in the first row and said on the console; equal to `kv4rl eval` of the same model; not
again on resume."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.config import ConfigError, load_config
from tests.small_runs import SMALL, train_cli

PROBLEMS = [("3+4", "7"), ("12+5", "17"), ("9+9", "18"), ("20+13", "33"), ("7+8", "15"), ("31+2", "33")]


def rows_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_starting_model_is_evaluated_once_as_kv4rl_eval_scores_it(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS))
    common = [f"data.eval={data}", "data.prompt_template={problem}=", "reward.name=exact", "eval.temperature=0",
              f"out_dir={tmp_path}", "checkpoint.save_every=1", *[a for a in SMALL if a != "--no-progress"]]
    res = train_cli(*common, "name=r", "trainer.iterations=2", "eval.before_training=true", "eval.every=1")
    assert res.exit_code == 0, res.output
    rows = rows_of(tmp_path / "r")
    # the periodic evaluation's figures, under eval_start/, in the first row only
    assert {k.removeprefix("eval_start/") for k in rows[0] if k.startswith("eval_start/")} == \
        {k.removeprefix("eval/") for k in rows[0] if k.startswith("eval/")}
    assert not any(k.startswith("eval_start/") for k in rows[1])
    assert rows[0]["eval_start/num_problems"] == len(PROBLEMS) and rows[0]["eval_start/policy_version"] == 0
    # greedy, so seeds do not matter: `kv4rl eval` of the embedded model on the same rows is the reference
    out = tmp_path / "ref.json"
    ref = CliRunner().invoke(app, ["eval", "--data", str(data), "--k", "1", "--temperature", "0", "--reward", "exact",
                                   "--template", "{problem}=", "--max-new-tokens", "16", "--device", "cpu",
                                   "--json", str(out)])
    assert ref.exit_code == 0, ref.output
    want = json.loads(out.read_text())["mean@1"]
    assert rows[0]["eval_start/mean@1"] == want and 0 < want < 1  # some right, some wrong: a score that tells
    summary = {line.split()[1]: line.split()[3] for line in res.output.splitlines() if line.startswith("│ eval_")}
    assert float(summary["eval_start_mean@1"]) == pytest.approx(rows[0]["eval_start/mean@1"], abs=1e-4)
    assert float(summary["eval_last_mean@1"]) == pytest.approx(rows[-1]["eval/mean@1"], abs=1e-4)
    said = [line for line in res.output.splitlines() if line.startswith("eval before training")]
    assert said == [f"eval before training  mean@1 {rows[0]['eval_start/mean@1']:.3f}  pass@1 "
                    f"{rows[0]['eval_start/pass@1']:.3f}"], res.output
    # a resume does not evaluate the starting model again
    res = train_cli("--resume", str(tmp_path / "r"), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output
    assert [any(k.startswith("eval_start/") for k in row) for row in rows_of(tmp_path / "r")] == [True, False, False]


def test_off_by_default_and_refused_where_engines_have_their_own_ranks():
    assert load_config(None, []).eval.before_training is False
    from kv4rl.split.run import check_split

    cfg = load_config(None, ["eval.before_training=true", "rollout.placement=split", "rollout.engine_ranks=1",
                             "rollout.quota_groups=2", "engine.sleep_between_rollouts=false"])
    with pytest.raises(ConfigError, match="eval.before_training runs only with rollout.placement=colocated"):
        check_split(cfg, world=3)
