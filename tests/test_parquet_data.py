"""Parquet dataset files (data/parquet.py): `problem` / `answer` columns read as the same rows in JSON Lines are,
verl's layout (`prompt` chat messages, `reward_model.ground_truth`) read as its user message and ground truth, bad
rows refused by row, and a run on verl's file that trains as the same rows in JSON Lines do."""

from __future__ import annotations

import json
import sys

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from kv4rl.config import load_config  # noqa: E402
from kv4rl.data.datasets import DatasetError, load_jsonl, load_problems, read_problems  # noqa: E402
from kv4rl.data.prompts import PromptFormatter  # noqa: E402
from kv4rl.data.source import ProblemSource  # noqa: E402
from kv4rl.rollout.build import prompt_warnings  # noqa: E402
from tests.small_runs import SMALL, train_cli  # noqa: E402


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(question, truth, index=0, roles=("user",)):
    """A row as verl's examples/data_preprocess scripts write it."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": role, "content": question} for role in roles],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index}}


@pytest.mark.parametrize("answers, read", [
    ([2, -7, 10**18], ["2", "-7", "1000000000000000000"]),  # an integer column
    ([0.5, 1e20, 0.1, 2.0], ["0.5", "100000000000000000000", "0.1", "2.0"]),  # a double column
    (["\\frac{1}{2}", "72"], ["\\frac{1}{2}", "72"]),  # a string column
])
def test_flat_columns_read_as_the_same_rows_in_json_lines(tmp_path, answers, read):
    rows = [{"problem": f"q{i}", "answer": answer} for i, answer in enumerate(answers)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ids = [None] * (len(rows) - 1) + ["q-last"]  # a null id is the default id, as a row without one in JSON Lines
    parquet = write_parquet(tmp_path / "rows.parquet", [{"id": i, **row} for i, row in zip(ids, rows)])
    problems, layout = read_problems(parquet)
    assert layout == "parquet"
    twin = load_jsonl(jsonl)
    assert [p.answer for p in problems] == [p.answer for p in twin] == read
    assert [p.problem for p in problems] == [p.problem for p in twin]
    assert [p.id for p in problems] == [f"rows.parquet:{i}" for i in range(1, len(rows))] + ["q-last"]


def test_verl_rows_are_their_user_message_and_ground_truth(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row("Janet sells 16 eggs. #### after", "72"),
                                                      verl_row("What is 2+2?", "4", index=1)])
    problems, layout = read_problems(path)
    assert layout == "verl"
    assert [(p.problem, p.answer, p.id) for p in problems] == [("Janet sells 16 eggs. #### after", "72", "train.parquet:1"),
                                                              ("What is 2+2?", "4", "train.parquet:2")]
    assert problems[1].meta == {"data_source": "openai/gsm8k", "ability": "math",
                                "reward_model": {"style": "rule", "ground_truth": "4"},
                                "extra_info": {"split": "train", "index": 1}}
    # known by its bytes, not its name
    renamed = tmp_path / "train.jsonl"
    renamed.write_bytes(path.read_bytes())
    assert load_problems(renamed) == problems[:0] + [p.__class__(p.problem, p.answer, p.id.replace("parquet", "jsonl"),
                                                                  p.meta) for p in problems]


@pytest.mark.parametrize("rows, message", [
    ([verl_row("a", "1"), verl_row("b", "2", roles=("system", "user"))],
     r"row 2: `prompt` holds the messages \['system', 'user'\]; kv4rl prompts with one user message"),
    ([verl_row("a", "1") | {"reward_model": {"style": "rule"}}], r"row 1: `reward_model` has no `ground_truth`"),
    ([verl_row("a", ["1", "one"])], r"row 1, reward_model: field 'ground_truth' must be a string or a number, got list"),
    ([verl_row("", "1")], r"row 1, prompt\[0\]: field 'content' is empty"),
    ([{"question": "a", "answer": "1"}], r"its columns are question, answer; a dataset file has `problem` and `answer`"),
    ([{"problem": "a", "answer": "1", "id": "x"}, {"problem": "b", "answer": "2", "id": "x"}],
     r"row 2: duplicate id 'x' \(first used in row 1\)"),
    ([{"problem": "a", "answer": float("nan")}], r"row 1: field 'answer' is not a finite number"),
])
def test_bad_rows_are_refused_by_row(tmp_path, rows, message):
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=message):
        load_problems(path)


def test_an_empty_file_and_a_missing_pyarrow_are_named(tmp_path, monkeypatch):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(DatasetError, match="empty.parquet contains no rows"):
        load_problems(empty)
    path = write_parquet(tmp_path / "rows.parquet", [{"problem": "a", "answer": "1"}])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(DatasetError, match=r"rows.parquet is a Parquet file, and reading one needs pyarrow: pip "
                                           r"install pyarrow"):
        load_problems(path)


class _Spelled:
    """A tokenizer stand-in that has a chat template: PromptFormatter without the chat template reads only the text."""

    chat_template = "{{ messages }}"


def test_start_up_says_what_verl_would_send_otherwise_and_a_prompt_that_asks_for_no_box(tmp_path):
    verl = write_parquet(tmp_path / "gsm8k.parquet", [verl_row("Q? Output the final answer after \"####\".", "72")])
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"problem": "Q?", "answer": "1"}) + "\n")

    def warnings(*overrides, train=verl):
        cfg = load_config(None, [f"data.train={train}", *overrides])
        source = ProblemSource(cfg.data.train, None, seed=0)
        template = cfg.data.prompt_template or source.default_template
        return prompt_warnings(cfg, source, PromptFormatter(_Spelled(), template))

    default = warnings()
    assert default[0] == ("data.train holds verl's prompts, their instruction included; the default "
                          "data.prompt_template adds kv4rl's boxed-answer instruction after each: "
                          "\"data.prompt_template='{problem}'\" (quoted so for the shell) sends them as verl does")
    assert default[1] == ("data.train holds verl's prompts, which verl sends in the tokenizer's chat template: "
                          "data.chat_template=true does the same")
    assert len(default) == 2  # the default template asks for the box
    as_verl = warnings("data.prompt_template='{problem}'")
    assert len(as_verl) == 2 and as_verl[0] == default[1]
    assert as_verl[1] == ("reward math_verify grades a response's last \\boxed{...} only, and none of the first 1 "
                          "prompts asks for one, so an answer written otherwise scores 0: ask for it in "
                          "data.prompt_template, e.g. \"data.prompt_template='{problem} Put the final answer within "
                          "\\boxed{{}}.'\"")
    assert warnings("data.prompt_template='{problem}'", "reward.name=exact")[1].startswith("reward exact grades")
    assert warnings("data.prompt_template='{problem} Box it: \\boxed{{}}.'") == [default[1]]
    assert warnings("data.prompt_template='{problem}'", train=plain)[0].startswith("reward math_verify grades")
    assert warnings(train=plain) == []
    # a tokenizer without a chat template: no advice to use one (data.chat_template=true would be refused)
    cfg = load_config(None, [f"data.train={verl}"])
    source = ProblemSource(cfg.data.train, None, seed=0)
    bare = type("Bare", (), {"chat_template": None})()
    assert prompt_warnings(cfg, source, PromptFormatter(bare, source.default_template)) == [default[0]]
    two = ProblemSource(str(verl), str(verl), seed=0).verl_prompt_notes(None, False)
    assert two[0].startswith("data.train and data.eval hold verl's prompts")


def test_a_run_on_verl_parquet_trains_as_on_the_same_rows_in_json_lines(tmp_path, caplog):
    """The embedded tiny model on its own arithmetic, given as verl's Parquet and as JSON Lines: the same problems
    in the same order, so the same rewards and losses, iteration by iteration."""
    cases = [("1+1", "2"), ("2+3", "5"), ("4+4", "8"), ("3+1", "4"), ("2+2", "4"), ("5+1", "6")]
    verl = write_parquet(tmp_path / "train.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(cases)])
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in cases))
    common = ["data.prompt_template={problem}=", "reward.name=exact", "trainer.iterations=2", "data.eval_size=2",
              f"out_dir={tmp_path}", *SMALL]
    with caplog.at_level("WARNING", logger="kv4rl"):
        res = train_cli(f"data.train={verl}", "name=verl", *common)
    assert res.exit_code == 0, res.output
    # the tiny model's tokenizer has no chat template: no advice to use one, and the template is set
    assert "verl's prompts" not in caplog.text
    twin = train_cli(f"data.train={jsonl}", "name=jsonl", *common)
    assert twin.exit_code == 0, twin.output

    def learned(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{key: value for key, value in row.items() if not key.startswith("time_") and key != "tokens_per_s"}
                for row in rows]

    verl_rows = learned("verl")
    assert len(verl_rows) == 2 and {"loss", "reward_mean", "grad_norm", "model_sha256"} <= set(verl_rows[1])
    assert verl_rows == learned("jsonl")


@pytest.mark.parametrize("truth, read", [(1e20, "100000000000000000000"), (1e-5, "0.00001"), (72, "72")])
def test_a_number_ground_truth_is_written_out_as_json_lines_writes_it(tmp_path, truth, read):
    """math-verify reads `1e+20` as e + 20: a nested number is kept as the JSON Lines reader keeps a number."""
    path = write_parquet(tmp_path / "n.parquet", [verl_row("q", truth)])
    assert load_problems(path)[0].answer == read


def test_eval_on_verl_parquet_scores_as_on_the_same_rows_in_json_lines_and_names_its_own_options(tmp_path):
    from typer.testing import CliRunner

    from kv4rl.cli import app

    cases = [(f"{a}+{b}", str(a + b)) for a in range(3) for b in range(3)]
    verl = write_parquet(tmp_path / "e.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(cases)])
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in cases))
    results = {}
    for name, data in (("verl", verl), ("jsonl", jsonl)):
        out = tmp_path / f"{name}.json"
        res = CliRunner().invoke(app, ["eval", "--data", str(data), "--k", "2", "--reward", "exact", "--template",
                                       "{problem}=", "--max-new-tokens", "8", "--json", str(out)])
        assert res.exit_code == 0, res.output
        results[name] = {k: v for k, v in json.loads(out.read_text()).items() if k.startswith(("mean@", "pass@"))}
        said = " ".join(res.output.split())
        assert "verl's prompts" not in said  # --template given, and the tiny tokenizer has no chat template
        # exact grades a box the prompts `1+1=` do not ask for: said, with eval's own option
        assert ("reward exact grades a response's last \\boxed{...} only, and none of the first 9 prompts asks for "
                "one, so an answer written otherwise scores 0: ask for it in --template, e.g. --template '{problem} "
                "Put the final answer within \\boxed{{}}.'") in said
    assert results["verl"] == results["jsonl"] and results["verl"]
    notes = ProblemSource(None, str(verl), seed=0).verl_prompt_notes(None, True, eval_cli=True)
    assert notes == ["--data holds verl's prompts, their instruction included; the default --template adds kv4rl's "
                     "boxed-answer instruction after each: --template '{problem}' sends them as verl does"]


def test_rows_read_a_batch_at_a_time_keep_their_numbers_and_a_damaged_file_is_named(tmp_path, monkeypatch):
    import kv4rl.data.parquet as parquet

    monkeypatch.setattr(parquet, "ROWS_PER_BATCH", 2)
    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(4)] + [{"problem": "", "answer": "4"}]
    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    with pytest.raises(DatasetError, match=r"r.parquet row 5: field 'problem' is empty"):
        load_problems(path)
    write_parquet(path, rows[:4])
    assert [p.id for p in load_problems(path)] == [f"r.parquet:{i}" for i in range(1, 5)]
    damaged = tmp_path / "d.parquet"
    damaged.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    with pytest.raises(DatasetError, match=r"cannot read Parquet file .*d.parquet"):
        load_problems(damaged)


def test_float32_answers_read_as_their_writer_wrote_them(tmp_path):
    """A float32 column's 0.1 widened to 0.10000000149011612 in Python; it reads as 0.1, flat or in verl's struct."""
    flat = tmp_path / "f.parquet"
    pq.write_table(pa.table({"problem": ["a", "b", "c"], "answer": pa.array([0.1, 1e20, 3.0], pa.float32())}), flat)
    assert [p.answer for p in load_problems(flat)] == ["0.1", "100000000000000000000", "3"]
    schema = pa.schema([("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("reward_model", pa.struct([("ground_truth", pa.float32())]))])
    verl = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}],
                                          "reward_model": {"ground_truth": 2.675}}], schema=schema), verl)
    assert load_problems(verl)[0].answer == "2.675"
