"""A dataset file, for training or for evaluation, is prompted with the boxed-answer instruction and
scored by math-verify: the defaults the README promises, on real MATH-500 and GSM8K rows."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.data.datasets import load_jsonl
from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.source import ProblemSource
from kv4rl.rewards import get_reward

runner = CliRunner()
SHARED_DATA = Path("/work/shared/data")
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
TEMPLATE = "{problem}" + INSTRUCTION.replace("{}", "{{}}")  # as given to --template: literal braces doubled

# Rows copied from MATH-500 and the GSM8K test split, in their files' JSON shape.
ROWS = [
    {"id": "test/algebra/2584.json", "problem": "If $\\sqrt{\\frac{2}{x} + 2} = \\frac{3}{2}$, solve for $x$.",
     "answer": "\\frac{14}{3}", "source": "MATH-500", "level": 3, "subject": "Algebra",
     "solution": "Squaring both sides, $\\frac2x + 2 = \\frac94$, so $\\frac2x = \\frac14$ and "
                 "$x = \\boxed{\\frac{14}{3}}$... (abridged)"},
    {"id": "test/precalculus/807.json",
     "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in "
                "the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "source": "MATH-500", "level": 2, "subject": "Precalculus",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$"},
    {"id": "gsm8k-test-0",
     "problem": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
                "muffins for her friends every day with four. She sells the remainder at the farmers' market "
                "daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' "
                "market?",
     "answer": "18", "source": "GSM8K",
     "solution": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every "
                 "day at the farmer\u2019s market."},
    {"id": "gsm8k-test-1",
     "problem": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does "
                "it take?",
     "answer": "3", "source": "GSM8K",
     "solution": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 "
                 "bolts of fabric"},
]
# The same value as each gold, written differently: math-verify scores it 1, a string match would not.
EQUIVALENT = ["\\dfrac{14}{3}", "(3, \\pi/2)", "18.00", "3.0"]
WRONG = ["\\frac{13}{3}", "\\left( 3, \\frac{\\pi}{3} \\right)", "17", "4"]


@pytest.fixture()
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def sources(path):
    """The ways a run can read a file: training only, evaluation only (eval, bench fidelity), both."""
    return {"train": ProblemSource(str(path), None, seed=0), "eval": ProblemSource(None, str(path), seed=0),
            "both": ProblemSource(str(path), str(path), seed=0)}


def test_a_file_read_for_training_or_evaluation_defaults_to_the_boxed_prompt_and_math_verify(rows_file):
    for name, source in sources(rows_file).items():
        assert not source.embedded, name
        assert source.default_reward == "math_verify", name
        formatter = PromptFormatter(None, source.default_template)
        for row in ROWS:
            problem = next(p for p in source.eval_problems(10) if p.id == row["id"])
            assert formatter.text(problem) == row["problem"] + INSTRUCTION, name
    embedded = ProblemSource(None, None, seed=0)
    assert (embedded.embedded, embedded.default_template, embedded.default_reward) == (True, "{problem}=", "exact")


def score(source, problems, *answer_sets):
    """Scores of each answer set, boxed at the end of a response to the default prompt, by the default
    reward (one worker for all of them)."""
    formatter = PromptFormatter(None, source.default_template)
    with get_reward(source.default_reward) as reward:
        out = []
        for answers in answer_sets:
            responses = [f"{formatter.text(p)}\nWorking it out... so the answer is $\\boxed{{{a}}}$." for p, a in
                         zip(problems, answers)]
            out.append(reward(responses, [p.answer for p in problems]).scores)
    return out


def test_the_default_reward_scores_a_correct_boxed_answer_1_and_a_wrong_one_0(rows_file):
    source = sources(rows_file)["eval"]
    problems = source.eval_problems(10)
    assert [p.id for p in problems] == [row["id"] for row in ROWS]
    gold, equivalent, wrong = score(source, problems, [p.answer for p in problems], EQUIVALENT, WRONG)
    assert (gold, equivalent, wrong) == ([1.0] * 4, [1.0] * 4, [0.0] * 4)


@pytest.mark.parametrize("name", ["math500.jsonl", "gsm8k_test.jsonl"])
def test_real_files_score_their_own_gold_answers_1_and_a_wrong_number_0(name):
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    problems = load_jsonl(path)[:20]
    source = ProblemSource(None, str(path), seed=0)
    assert (source.default_template, source.default_reward) == (TEMPLATE, "math_verify")
    gold, wrong = score(source, problems, [p.answer for p in problems], ["-987654321"] * 20)
    assert (gold, wrong) == ([1.0] * 20, [0.0] * 20)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The embedded tiny model with 1024 positions, so whole MATH-500 / GSM8K prompts fit (RoPE has no
    trained length limit; only the position table grows)."""
    from kv4rl.models.tiny import tiny_model_dir

    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir(), path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_eval_on_a_file_uses_the_file_defaults_and_records_its_settings(rows_file, long_context_model, tmp_path):
    out = tmp_path / "new" / "eval.json"
    res = runner.invoke(app, ["eval", "--model", str(long_context_model), "--data", str(rows_file), "--k", "2",
                              "--max-new-tokens", "3", "--temperature", "0.5", "--seed", "7", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["reward"] == "math_verify" and r["template"] == TEMPLATE
    assert (r["chat_template"], r["temperature"], r["max_new_tokens"], r["seed"], r["k"]) == (False, 0.5, 3, 7, 2)
    assert (r["model"], r["data"], r["num_problems"]) == (str(long_context_model), str(rows_file), 4)


def test_bench_fidelity_on_a_file_uses_the_boxed_prompt_and_records_it(rows_file, long_context_model, tmp_path):
    out = tmp_path / "fidelity.json"
    res = runner.invoke(app, ["bench", "fidelity", "--model", str(long_context_model), "--data", str(rows_file),
                              "--formats", "bf16", "--n", "2", "--max-new-tokens", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["template"] == TEMPLATE and r["data"] == str(rows_file)
    tokenizer = AutoTokenizer.from_pretrained(long_context_model)
    lengths = [len(tokenizer.encode(row["problem"] + INSTRUCTION)) for row in ROWS[:2]]
    assert r["prompt_tokens_mean"] == sum(lengths) / 2
