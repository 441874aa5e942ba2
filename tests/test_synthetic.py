"""The arithmetic task and the char tokenizer, checked against Python's own `eval` and hand-worked ids."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from transformers import AutoTokenizer

from kv4rl.data.char_tokenizer import BOXED, EOS, PAD, UNK, VOCAB, build_char_tokenizer
from kv4rl.data.synthetic import PROMPT_TEMPLATE, ArithmeticTask, evaluate, target_text, verify

TASKS = [
    ArithmeticTask(),
    ArithmeticTask(min_terms=1, max_terms=5, max_value=99, ops="+-*"),
    ArithmeticTask(min_terms=3, max_terms=3, max_value=7, ops="*"),
]


@pytest.mark.parametrize("task", TASKS)
def test_problems_are_deterministic_per_seed(task: ArithmeticTask) -> None:
    assert task.problems(200, seed=3) == task.problems(200, seed=3)
    assert [p.problem for p in task.problems(200, seed=3)] != [p.problem for p in task.problems(200, seed=4)]
    first, second = random.Random(11), random.Random(11)
    assert [task.sample(first) for _ in range(50)] == [task.sample(second) for _ in range(50)]


@pytest.mark.parametrize("task", TASKS)
def test_answers_match_python_eval(task: ArithmeticTask) -> None:
    problems = task.problems(500, seed=0)
    for p in problems:
        assert int(p.answer) == eval(p.problem)
        operands = [int(v) for v in re.split(r"[-+*]", p.problem)]
        assert task.min_terms <= len(operands) == p.meta["terms"] <= task.max_terms
        assert all(0 <= v <= task.max_value for v in operands)
        assert set(re.sub(r"\d", "", p.problem)) <= set(task.ops)
    assert {p.meta["terms"] for p in problems} == set(range(task.min_terms, task.max_terms + 1))
    assert len({p.id for p in problems}) == len(problems)


def test_evaluate_matches_eval_on_every_small_expression() -> None:
    for operands in itertools.product(range(4), repeat=3):
        for operators in itertools.product("+-*", repeat=2):
            text = f"{operands[0]}{operators[0]}{operands[1]}{operators[1]}{operands[2]}"
            assert evaluate(list(operands), list(operators)) == eval(text), text


def test_prompt_and_target_text() -> None:
    task = ArithmeticTask()
    problem = task.problems(1, seed=0)[0]
    assert task.prompt(problem) == problem.problem + "="
    assert PROMPT_TEMPLATE.format(problem="12+7-3") == "12+7-3="
    assert target_text("16") == "\\boxed{16}"
    assert target_text(-4) == "\\boxed{-4}"
    assert verify(target_text(problem.answer), problem.answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("\\boxed{16}", "16", 1.0),
        ("\\boxed{-4}", "-4", 1.0),
        ("\\boxed{ 16 }", "16", 1.0),
        ("\\boxed{016}", "16", 1.0),  # the integer value is what counts
        ("so 12+7-3 is \\boxed{16} done", "16", 1.0),
        ("\\boxed{3} then \\boxed{16}", "16", 1.0),  # the last box decides
        ("\\boxed{16} then \\boxed{3}", "16", 0.0),
        ("\\boxed{15}", "16", 0.0),
        ("\\boxed{4}", "-4", 0.0),
        ("16", "16", 0.0),  # missing box
        ("", "16", 0.0),
        ("\\boxed{16", "16", 0.0),  # unclosed
        ("\\boxed{}", "16", 0.0),
        ("\\boxed{16.0}", "16", 0.0),
        ("\\boxed{+16}", "16", 1.0),  # a sign, as the exact reward takes it
        ("\\fbox{16}", "16", 1.0),
        ("\\boxed {16}", "16", 1.0),
        ("\\boxed{16} \\boxed {15}", "16", 0.0),  # the last box, with a space before its brace
        ("\\boxed{1 6}", "16", 0.0),
        ("\\boxed{16 apples}", "16", 0.0),
        ("\\boxed{--16}", "-16", 0.0),
    ],
)
def test_verify(response: str, answer: str, expected: float) -> None:
    """The warm-up's accuracy check and the `exact` reward RL trains on give the same score (they differed on
    `+16`, `\\fbox` and a space before the brace)."""
    from kv4rl.rewards import get_reward

    assert verify(response, answer) == expected
    assert get_reward("exact")([response], [answer]).scores == [expected]


def test_verify_rejects_a_non_integer_answer() -> None:
    with pytest.raises(ValueError, match="answer must be an integer"):
        verify("\\boxed{1}", "one")


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"min_terms": 0}, "min_terms"),
        ({"min_terms": 3, "max_terms": 2}, "max_terms"),
        ({"max_value": -1}, "max_value"),
        ({"ops": ""}, "ops"),
        ({"ops": "+/"}, "ops"),
        ({"ops": "++"}, "ops"),
    ],
)
def test_invalid_task_knobs_raise(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**knobs)


def test_negative_problem_count_raises() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        ArithmeticTask().problems(-1, seed=0)


def _task_strings() -> list[str]:
    task = ArithmeticTask(min_terms=1, max_terms=4, max_value=99, ops="+-*")
    problems = task.problems(200, seed=5)
    return [task.prompt(p) + target_text(p.answer) for p in problems] + [" ( 1 + 2 ) ", "{}=\\boxed{\\boxed{"]


def test_tokenizer_round_trips_and_counts_one_id_per_symbol() -> None:
    tokenizer = build_char_tokenizer()
    for text in _task_strings():
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert len(ids) == len(text) - (len(BOXED) - 1) * text.count(BOXED)


def test_tokenizer_hand_worked_ids() -> None:
    tokenizer = build_char_tokenizer()
    pieces = ["1", "2", "+", "7", "=", BOXED, "-", "4", "}"]
    assert tokenizer.encode("12+7=\\boxed{-4}") == [VOCAB.index(piece) for piece in pieces]
    assert len(tokenizer.encode(BOXED)) == 1
    assert tokenizer.encode("a") == [VOCAB.index(UNK)]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (VOCAB.index(PAD), VOCAB.index(EOS))
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == len(VOCAB)


def test_tokenizer_adds_no_special_tokens() -> None:
    tokenizer = build_char_tokenizer()
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    for text in _task_strings()[:20]:
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=True) == plain
        assert tokenizer(text)["input_ids"] == plain
        assert not special & set(plain)


def test_tokenizer_saved_and_loaded_back_encodes_identically(tmp_path) -> None:
    built = build_char_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for text in _task_strings():
        assert loaded.encode(text) == built.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, None)
    ids = loaded.encode("3=\\boxed{3}") + [loaded.eos_token_id, loaded.pad_token_id]
    assert loaded.decode(ids, skip_special_tokens=True) == "3=\\boxed{3}"
    assert loaded.decode(ids) == "3=\\boxed{3}<eos><pad>"
