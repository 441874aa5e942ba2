"""Rewards: boxed extraction, the registry, `exact`, and `math_verify` with its watchdogged worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kv4rl.rewards import base, extract_boxed, get_reward, registered_rewards
from kv4rl.rewards.math import MathVerifyReward, verify_answer

MATH500 = Path("/work/shared/data/math500.jsonl")


def _hang_or_raise_check(predicted: str, gold: str) -> bool:
    """Check used by the worker tests: hangs on `HANG`, raises on `RAISE`, else the real check."""
    if predicted == "HANG":
        time.sleep(3600)
    if predicted == "RAISE":
        raise RuntimeError("check blew up")
    return verify_answer(predicted, gold)


TEST_CHECK_FN = f"{__name__}:_hang_or_raise_check"


@pytest.fixture(scope="module")
def math_reward():
    with get_reward("math_verify", timeout_s=5.0) as reward:
        yield reward


# --- extract_boxed -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\fbox{7}", "7"),
        (r"\boxed {x+1}", "x+1"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a_{b_{c}}} tail }", "a_{b_{c}}"),
        (r"\boxed{}", ""),
        ("no box here", None),
        (r"\boxed{\frac{1}{2}", None),
        (r"\boxed{1} and a truncated \boxed{\frac{3", None),
        # without braces, the one token after it, as TeX reads it (math-verify alone takes `\boxed 18` as 18)
        # where that token is an answer: a digit alone, a command, a letter that starts no word
        (r"\boxed 5", "5"),
        (r"\boxed 5.", "5"),
        (r"\boxed 18", None),  # TeX boxes the 1: no answer, neither 1 nor 18
        (r"\boxed{3} then \boxed 18", None),  # ... and not the earlier box either
        (r"\boxed\frac{1}{2}", None),  # a command that takes arguments is no answer alone
        (r"\boxed 5.2", None),
        (r"\boxed\pi", r"\pi"),
        (r"\boxed x.", "x"),
        (r"\boxed{1} then \boxed 2.", "2"),
        (r"So \boxed{18}. I used \boxed as asked.", "18"),  # prose that names the command after the answer
        (r"\boxed{7} (written with \boxed because the task asks)", "7"),
        (r"\framebox{7}", "7"),
        (r"\framebox[2cm][c]{7}", "7"),
        (r"\boxedx{3}", None),
        (r"\boxed }", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# --- registry ------------------------------------------------------------------------------------


def test_builtin_rewards_are_registered():
    assert {"exact", "math_verify"} <= set(registered_rewards())


def test_unknown_reward_lists_known_names():
    with pytest.raises(ValueError, match="unknown reward 'nope'.*exact.*math_verify"):
        get_reward("nope")


def test_math_verify_without_its_package_is_refused_when_built(monkeypatch):
    """A missing math-verify was met by the worker at the first boxed answer, after an eval's whole sampling
    (and a training run without boxed answers never met it); the reward is refused when it is built now."""
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # find_spec and import now see no such package
    with pytest.raises(ValueError, match=r"needs the math-verify package \(pip install math-verify\)"):
        get_reward("math_verify")
    # a check function of one's own does not need it
    get_reward("math_verify", check_fn="tests.test_rewards:_always_right").close()


def _always_right(predicted: str, gold: str) -> bool:
    return True


def test_bad_option_is_a_value_error():
    with pytest.raises(ValueError, match="bad options.*'exact'"):
        get_reward("exact", timeout_s=3)


def test_register_reward_passes_options_and_rejects_duplicates(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", {})

    @base.register_reward("constant")
    def make_constant(value: float = 1.0):
        return lambda responses, golds: base.RewardResult([value] * len(responses), {})

    assert get_reward("constant", value=0.25)(["a", "b"], ["x", "y"]).scores == [0.25, 0.25]
    with pytest.raises(ValueError, match="already registered"):
        base.register_reward("constant")(make_constant)


# --- exact ---------------------------------------------------------------------------------------


def test_exact_reward_takes_ascii_digits_only():
    """`\\d` and int() read Arabic-Indic or full-width digits as numbers: ١٦ scored 1 against 16."""
    from kv4rl.data.synthetic import verify

    result = get_reward("exact")([r"\boxed{١٦}", r"\boxed{１６}", r"\boxed{16}"], ["16", "16", "16"])
    assert result.scores == [0.0, 0.0, 1.0]
    assert verify(r"\boxed{١٦}", "16") == 0.0
    with pytest.raises(ValueError, match="answer must be an integer string"):
        verify(r"\boxed{16}", "١٦")


def test_exact_reward_compares_integers_past_int_s_digit_limit():
    """int() refuses strings past 4,300 digits: a degenerate response of repeated digits raised out of the reward
    and stopped the run. Values compare by sign and digits instead (leading zeros, a plus sign, minus zero)."""
    from kv4rl.rewards.math import exact_match

    reward = get_reward("exact")
    long = "7" * 4301
    assert reward([f"\\boxed{{{long}}}", f"\\boxed{{{'0' * 5000}7}}"], ["7", "7"]).scores == [0.0, 1.0]
    assert reward([f"\\boxed{{{long}}}"], [long]).scores == [1.0]
    assert [exact_match(p, g) for p, g in (("-0", "0"), ("+7", "7"), ("-7", "7"), ("007", "7"), ("-007", "-7"),
                                           ("70", "7"), ("0", "00"))] == [True, True, False, True, True, False, True]


def test_math_verify_survives_a_subscript_past_int_s_digit_limit_and_logs_a_long_answer_shortened():
    """`52_{<5,000 digits>}` raised int()'s digit-limit error inside the base rule (a base is 2-36: two digits at
    most), and the reward's warning of a failed check carried the whole answer."""
    from kv4rl.rewards.math import _shortened

    assert isinstance(verify_answer("52_{" + "9" * 5000 + "}", "52_8"), bool)
    assert _shortened("x" * 5000) == "x" * 200 + "... (5,000 characters)" and _shortened("abc") == "abc"


def test_exact_reward_scores_and_counts():
    responses = [
        r"\boxed{007}",
        r"\boxed{ 12 }",
        r"\boxed{3}",
        "no box",
        r"\boxed{-05}",
        r"\boxed{7.0}",
        r"\boxed{abc}",
        r"\boxed{  }",
    ]
    golds = ["7", "12", "4", "1", "-5", "7", "abc", "1"]
    with get_reward("exact") as reward:
        result = reward(responses, golds)
    assert result.scores == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert result.stats == {"no_answer": 2.0}


def test_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        get_reward("exact")(["a", "b"], ["a"])


# --- math_verify ---------------------------------------------------------------------------------


def test_math_verify_correct_incorrect_and_missing(math_reward):
    cases = [
        (r"Thus \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),
        (r"\boxed{3}", "4", 0.0),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{(3, \pi)}", r"\left( 3, \frac{\pi}{2} \right)", 0.0),
        ("The answer is 0.5", "0.5", 0.0),  # no box: not graded
        (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # unclosed box
    ]
    result = math_reward([c[0] for c in cases], [c[1] for c in cases])
    assert result.scores == [c[2] for c in cases]
    assert result.stats == {"no_answer": 2.0, "timeouts": 0.0, "errors": 0.0}


def test_math_verify_reads_the_latex_it_misparsed_in_training_golds(math_reward):
    """Golds of this shape (from the MATH training set) scored a right answer 0, and three a wrong one 1: a
    trailing period made math-verify read a matrix as -1, `\\frac\\pi 2` as 2, `\\phantom -1` as -1."""
    cases = [  # (gold, a right answer, a wrong one)
        (r"-\frac{5}{3}.", r"-\frac{5}{3}", "7"),
        (r"\text{(E)},", r"\text{(E)}", r"\text{(A)}"),
        (r"2007 + \frac\pi 2", r"2007+\frac{\pi}{2}", "2"),
        (r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}.", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", "-1"),
        (r"\begin{pmatrix} 1 & -1 \\ 1 & \phantom -1 \end{pmatrix}", r"\begin{pmatrix} 1 & -1 \\ 1 & 1 \end{pmatrix}",
         "-1"),
        (r"\dfrac{1}{29,\!322,\!216}", r"\frac{1}{29322216}", "7"),
        (r"\dfrac{2469}{20,\!000}", r"\frac{2469}{20000}", r"\frac{2469}{20}"),
    ]
    golds = [gold for gold, _, _ in cases for _ in range(2)]
    responses = [f"\\boxed{{{answer}}}" for _, right, wrong in cases for answer in (right, wrong)]
    assert math_reward(responses, golds).scores == [1.0, 0.0] * len(cases)
    # and written with the gold's own quirks, a model's answer is read the same way
    assert math_reward([r"\boxed{2007 + \frac\pi 2.}", r"\boxed{\frac{1}{29,\!322,\!216}}"],
                       [r"2007+\frac{\pi}{2}", r"\frac{1}{29322216}"]).scores == [1.0, 1.0]


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        # a trailing `\,` thin space kept whole (its ',' was cut, leaving a lone backslash)
        (r"5\,", "5", True),
        (r"(1,2)\,", "(1,2)", True),
        (r"30^\circ\,", "30", True),
        # thousands separated by `\,` (math-verify read `1\,000` as 1*0 and `2\,500` as 502)
        (r"1\,000", "1000", True),
        (r"3\,600", "3600", True),
        (r"1\,000\,000", "10^6", True),
        (r"1\,000.", "1000", True),
        (r"1\,000.", "0", False),
        (r"1\,000", "0", False),
        (r"2\,500", "502", False),
        # numbers in a base compare by value (math-verify dropped the subscript: 52_9 equalled 52_8)
        ("52_9", "52_8", False),
        ("52_{10}", "52_8", False),
        ("110_2", "110_3", False),
        ("101010_2", "52_8", True),  # both 42
        ("52_8", "4210_{5}", False),  # 42 against 555
        ("52", "52_8", True),  # the base left off is still read as the digits, as before
        ("x_2", "x_1", False),
        # `\frac` with one bare argument (`\frac\pi{2}` parsed as garbage, `\frac ab` as nothing)
        (r"\frac\pi{2}", r"\frac{\pi}{2}", True),
        (r"\frac ab", r"\frac{a}{b}", True),
        (r"\frac ab", r"\frac{b}{a}", False),
        (r"\frac{1}2", "0.5", True),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
        # a unit in words after a plain-number gold: math-verify read `18 dollars` as 18*d*o*l*l*a*r*s (0) but
        # `18 meters` as 18 (1), so a right GSM8K answer scored by its noun
        ("18 dollars", "18", True),
        (r"\text{18 dollars}", "18", True),
        (r"18 \text{ eggs}", "18", True),
        ("17 dollars", "18", False),
        ("18 x", "18", False),  # one letter: a variable, not a unit
        ("18 dollars", "x", False),
        # words that change the number rather than name its unit are not dropped (`2 pi` scored 1 against 2)
        ("2 pi", "2", False),
        ("18 thousand", "18", False),
        ("2 million", "2", False),
        ("18 squared", "18", False),
        ("18 or more", "18", False),
        ("3 times", "3", True),
        # ... only as the first word: these are units
        ("18 dozen eggs", "18", True),
        ("12 quarters", "12", True),
        ("50 meters squared", "50", True),
        ("20 dollars and cents", "20", True),
        # a square or cubic unit (math-verify read `18~\text{cm}^2` as nothing)
        (r"18~\text{cm}^2", "18", True),
        (r"18 \text{ cm}^{2}", "18", True),
        (r"17~\text{cm}^2", "18", False),
        # Unicode a model writes: full-width digits, the degree sign, the root sign, thousands apart by spaces
        ("\uff11\uff18", "18", True),
        ("\uff11\uff19", "18", False),
        ("30\u00b0", r"30^\circ", True),
        ("30\u00b0", "30", True),
        (r"30\degree", r"30^\circ", True),
        ("31\u00b0", "30", False),
        ("3\u221a13", r"3\sqrt{13}", True),
        ("\u221a{2}/2", r"\frac{\sqrt{2}}{2}", True),
        ("3\u221a12", r"3\sqrt{13}", False),
        ("\u221a\\frac{1}{2}", r"\frac{\sqrt{2}}{2}", True),
        ("2\u221a\\pi", r"2\sqrt{\pi}", True),
        ("1\u00a0000", "1000", True),
        ("1\u2009000\u2009000", "10^6", True),
        ("1\u202f000", "100", False),
        ("1 000", "1000", True),
        ("1 000", "100", False),
    ],
)
def test_math_verify_reads_thin_spaces_bases_and_half_bare_fractions(answer, gold, expected):
    assert verify_answer(answer, gold) is expected


def test_math_verify_unparseable_gold_counts_as_error(math_reward):
    result = math_reward([r"\boxed{1}", r"\boxed{1}"], ["\\\\", "1"])
    assert result.scores == [0.0, 1.0]
    assert result.stats["errors"] == 1.0


@pytest.mark.skipif(not MATH500.exists(), reason="shared MATH-500 file not present")
def test_math_verify_on_math500_golds(math_reward):
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()[:120]]
    golds = [row["answer"] for row in rows]
    own = math_reward([f"The answer is \\boxed{{{gold}}}." for gold in golds], golds)
    assert own.scores == [1.0] * len(golds)
    shifted = math_reward([f"\\boxed{{{gold}}}" for gold in golds[1:] + golds[:1]], golds)
    # A neighbour's answer is almost never right; allow the few coincidences (equal golds).
    coincidences = sum(a == b for a, b in zip(golds[1:] + golds[:1], golds))
    assert sum(shifted.scores) <= coincidences + 3


def test_hanging_check_times_out_and_worker_recovers():
    responses = [
        r"\boxed{\frac{1}{2}}",
        r"\boxed{HANG}",
        r"\boxed{3}",
        r"\boxed{RAISE}",
        r"\boxed{HANG}",
        r"\boxed{2}",
        "unboxed",
    ]
    golds = ["0.5", "1", "4", "1", "1", "2", "2"]
    with MathVerifyReward(timeout_s=1.0, check_fn=TEST_CHECK_FN) as reward:
        start = time.monotonic()
        result = reward(responses, golds)
        elapsed = time.monotonic() - start
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert result.stats == {"no_answer": 1.0, "timeouts": 2.0, "errors": 1.0}
        # Two 1 s timeouts plus two worker restarts (~0.5 s each here); nowhere near the 3600 s sleep.
        assert elapsed < 15.0
        follow_up = reward([r"\boxed{4}", r"\boxed{5}"], ["4", "4"])
        assert follow_up.scores == [1.0, 0.0]
        assert follow_up.stats["timeouts"] == 0.0
        process = reward._process
        assert process is not None and process.is_alive()
    assert not process.is_alive()


def test_worker_killed_between_batches_is_restarted(math_reward):
    assert math_reward([r"\boxed{1}"], ["1"]).scores == [1.0]
    old_process = math_reward._process
    old_process.kill()
    old_process.join()
    assert math_reward([r"\boxed{2}", r"\boxed{3}"], ["2", "2"]).scores == [1.0, 0.0]
    assert math_reward._process.pid != old_process.pid


def test_bad_check_fn_is_reported():
    with pytest.raises(ValueError, match="check_fn must look like"):
        MathVerifyReward(check_fn="no_colon_here")
    with (
        MathVerifyReward(check_fn="kv4rl_no_such_module:check") as reward,
        pytest.raises(ValueError, match="could not load check_fn.*kv4rl_no_such_module"),
    ):
        reward([r"\boxed{1}"], ["1"])


def test_non_positive_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        get_reward("math_verify", timeout_s=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "1", 10**400])
def test_a_reward_that_returns_anything_but_finite_numbers_is_refused_by_name(monkeypatch, bad):
    """A NaN score made every advantage, loss and gradient of the batch NaN (each step then skipped as if the
    learning rate were to blame), an inf one zeroed the advantages: both trained nothing, exit 0."""
    monkeypatch.setattr(base, "_REGISTRY", {})

    @base.register_reward("plugin")
    def make():
        return lambda responses, golds: base.RewardResult([1.0, bad, 0.0][: len(responses)], {})

    with pytest.raises(ValueError, match=r"reward 'plugin' returned .* for response 1 of 3: a score must be a finite"):
        get_reward("plugin")(["a", "b", "c"], ["x", "y", "z"])
    with pytest.raises(ValueError, match="reward 'three' returned 3 scores for 2 responses"):
        base.register_reward("three")(lambda: lambda r, g: base.RewardResult([0.0] * 3, {}))
        get_reward("three")(["a", "b"], ["x", "y"])
    assert get_reward("plugin")(["a"], ["x"]).scores == [1.0]


def test_a_reward_that_fails_or_scores_past_the_bound_is_named(monkeypatch):
    """A reward's own ValueError printed as a bare "config" line and any other exception as a ~190-line traceback,
    neither naming the reward; a factory that raised, or built no callable, failed late or bare; a finite score of
    1e200 passed and made the group's std, advantages and loss NaN (its square overflows float32)."""
    monkeypatch.setattr(base, "_REGISTRY", {})
    base.register_reward("keyerr")(lambda: lambda r, g: {}["boom"])
    base.register_reward("valerr")(lambda: lambda r, g: float("abc"))
    base.register_reward("huge")(lambda: lambda r, g: base.RewardResult([1e200] * len(r), {}))
    base.register_reward("edge")(lambda: lambda r, g: base.RewardResult([base.MAX_SCORE] * len(r), {}))

    def broken_factory():
        raise RuntimeError("no model file")

    base.register_reward("broken")(broken_factory)
    base.register_reward("number")(lambda: 42)
    for name, said in (("keyerr", "reward 'keyerr' raised KeyError scoring 2 responses: 'boom'"),
                       ("valerr", "reward 'valerr' raised ValueError scoring 2 responses: could not convert")):
        with pytest.raises(base.RewardFailed) as info:
            get_reward(name)(["a", "b"], ["x", "y"])
        assert str(info.value).startswith(said) and info.value.__cause__ is not None and info.value.show_traceback
    with pytest.raises(ValueError, match=r"reward 'huge' returned 1e\+200 for response 0 of 2: a score must be "
                                         r"within ±1e\+15"):
        get_reward("huge")(["a", "b"], ["x", "y"])
    assert get_reward("edge")(["a"], ["x"]).scores == [base.MAX_SCORE]
    with pytest.raises(base.RewardFailed, match="reward 'broken' could not be built: RuntimeError: no model file"):
        get_reward("broken")
    with pytest.raises(ValueError, match="reward 'number': its factory returned int, not a callable reward"):
        get_reward("number")


def test_the_readme_example_reward_scores_as_documented_and_trains_through_plugins(tmp_path, monkeypatch):
    """The README's "Writing your own reward" module, as a user would copy it: loaded through `algo.plugins`,
    it scores the hand-worked cases below and a one-iteration run logs its stats as `reward_<key>`."""
    import json
    import sys
    from pathlib import Path

    import kv4rl
    from kv4rl.config import load_config
    from kv4rl.loop import train

    readme = (Path(kv4rl.__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("# my_rewards.py\n")
    (tmp_path / "readme_rewards.py").write_text(readme[start:readme.index("```", start)])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the example's registration ends with the test
    try:
        cfg = load_config(overrides=["algo.plugins=[readme_rewards]", "reward.name=boxed_partial", f"out_dir={tmp_path}",
                                     "name=r", "trainer.iterations=1", "rollout.quota_groups=2", "rollout.group_size=2",
                                     "rollout.max_slots=4"])
        result = get_reward("boxed_partial")([r"\boxed{007}", r"\boxed{8}", "7", r"\boxed{"], ["7", "7", "7", "7"])
        assert result.scores == [1.0, 0.1, 0.0, 0.0] and result.stats == {"no_answer": 2.0}
        train(cfg, show_progress=False)
        (row,) = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert "reward_no_answer" in row and 0.0 <= row["reward_mean"] <= 1.0
    finally:
        sys.modules.pop("readme_rewards", None)


def test_numpy_and_tensor_scalars_are_scores_and_a_bool_is_told_to_be_a_float(monkeypatch):
    """What the loop's float32 tensor always took (NumPy scalars, one-element tensors) stays a score; a bool
    (`pred == gold`) is refused with what to write instead."""
    import numpy as np
    import torch

    monkeypatch.setattr(base, "_REGISTRY", {})
    scores = [np.float32(0.5), np.int64(1), torch.tensor(0.25), np.array(0.0)]
    base.register_reward("numeric")(lambda: lambda r, g: base.RewardResult(scores[: len(r)], {}))
    assert [float(x) for x in get_reward("numeric")(["a"] * 4, ["x"] * 4).scores] == [0.5, 1.0, 0.25, 0.0]
    base.register_reward("bools")(lambda: lambda r, g: base.RewardResult([np.bool_(True)] * len(r), {}))
    with pytest.raises(ValueError, match=r"a bool, not a score \(write float\(...\) for 1.0 / 0.0\)"):
        get_reward("bools")(["a"], ["x"])


@pytest.mark.parametrize(("result", "said"), [
    (lambda: [1.0, 0.0], "returned list; it must return a RewardResult"),
    (lambda: base.RewardResult([1.0, 0.0], {"mean": 99.0}), "returned a stat 'mean', which the run logs itself as "
                                                            "reward_mean"),
    (lambda: base.RewardResult([1.0, 0.0], {"s": "text"}), "returned stat 's' = 'text'; a stat must be a number"),
])
def test_a_reward_result_the_run_cannot_log_is_named(monkeypatch, result, said):
    """A plain list failed as "'list' object has no attribute 'scores'", a stat named `mean` was dropped beside
    the run's reward_mean without a word, a text stat failed as "could not convert string to float"."""
    monkeypatch.setattr(base, "_REGISTRY", {})
    base.register_reward("odd")(lambda: (lambda responses, golds: result()))
    with pytest.raises(ValueError, match=f"^reward 'odd' {said}"):
        get_reward("odd")(["a", "b"], ["1", "1"])


def test_a_reward_giving_its_scores_as_a_generator_keeps_them():
    """The check used the generator up and the run then failed: "must be real number, not generator"."""
    reward = base.CheckedReward("gen", lambda responses, golds: base.RewardResult(
        (float(r == g) for r, g in zip(responses, golds)), {"n": 2, "odd": float("nan")}))
    result = reward(["1", "2"], ["1", "1"])
    assert result.scores == [1.0, 0.0] and result.stats["n"] == 2


_GROUP_SIGNAL_SCRIPT = """
import os, signal, sys
from kv4rl.rewards import get_reward
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda *a: None)  # the run finishes its iteration, as GracefulStop has it
    with get_reward("math_verify") as reward:
        reward([r"\\\\boxed{1}"], ["1"])  # the worker is up
        os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
        os.killpg(0, signal.SIGTERM if len(sys.argv) > 1 else signal.SIGINT)
        result = reward([r"\\\\boxed{2}", r"\\\\boxed{3}"], ["2", "3"])
        print(result.scores, result.stats["errors"])
"""


@pytest.mark.parametrize("then", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_runs_process_group_leaves_the_math_worker_running(tmp_path, then):
    """Ctrl-C (and torchrun's SIGTERM) went to the worker too: the run, finishing its iteration, crashed at the
    next reward with a reset pipe, or scored the item in check 0 (QA). Reference: both answers are right."""
    import os
    import subprocess
    import sys

    script = tmp_path / "group_signal.py"
    script.write_text(_GROUP_SIGNAL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    args = [sys.executable, str(script)] + (["term"] if then == "SIGTERM" else [])
    if then == "SIGTERM":  # the script's own SIGTERM would end it: it ignores that one too
        script.write_text(_GROUP_SIGNAL_SCRIPT.replace(
            "signal.signal(signal.SIGINT, lambda *a: None)",
            "signal.signal(signal.SIGINT, lambda *a: None); signal.signal(signal.SIGTERM, lambda *a: None)"))
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[0] == "[1.0, 1.0] 0.0", res.stdout + res.stderr[-3000:]


def test_a_worker_whose_pipe_was_reset_is_replaced_and_the_batch_scored(math_reward):
    """A worker killed between batches (out of memory, a signal) left a pipe that raised ConnectionResetError
    at the next send, which only EOFError was caught for: the run crashed."""
    math_reward([r"\boxed{1}"], ["1"])
    worker = math_reward.reward._worker  # get_reward's CheckedReward holds the MathVerifyReward, it its worker
    real = worker._conn
    assert real is not None

    class Reset:
        def send(self, _):
            raise ConnectionResetError(104, "Connection reset by peer")

        def __getattr__(self, name):
            return getattr(real, name)

    worker._conn = Reset()
    result = math_reward([r"\boxed{2}", r"\boxed{3}"], ["2", "3"])
    assert result.scores == [1.0, 1.0] and result.stats["errors"] == 0


_BUSY_PARENT_SCRIPT = """
import sys
from kv4rl.rewards.math import MathVerifyReward
if __name__ == "__main__":
    reward = MathVerifyReward(check_fn="hangs:check", timeout_s=1000)
    reward.score([r"\\\\boxed{1}"], ["1"])  # the worker is up
    print(reward._process.pid, flush=True)
    reward.score([r"\\\\boxed{hang}"], ["1"])  # never returns
"""


def test_a_worker_busy_on_a_hanging_check_dies_with_its_parent(tmp_path):
    """Out of the run's process group (so a Ctrl-C leaves it alive), a worker stuck in a check outlived a parent
    killed outright, using a core with no owner for ever (review)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "hangs.py").write_text("import time\ndef check(a, b):\n    if a == 'hang':\n        time.sleep(10**6)\n"
                                       "    return True\n")
    (tmp_path / "parent.py").write_text(_BUSY_PARENT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.5)  # the worker is in the check now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return  # gone (reaped by init)
        with open(f"/proc/{worker}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return  # dead, waiting for init to reap it
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the math_verify worker outlived its killed parent")


@pytest.mark.slow
def test_a_failing_reward_plugin_stops_train_with_one_line_and_shows_its_traceback_with_v(tmp_path, monkeypatch):
    """Through `kv4rl train`: one line naming the reward (exit 2), and with -v the traceback down to the plugin's
    own line, which the config-error path had swallowed."""
    from tests.small_runs import SMALL, train_cli

    (tmp_path / "qa_plugin.py").write_text(
        "from kv4rl.rewards import register_reward\n\n"
        "@register_reward('fails_later')\n"
        "def make():\n"
        "    def score(responses, golds):\n"
        "        return float('abc')\n"
        "    return score\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    args = [f"out_dir={tmp_path}", "algo.plugins=[qa_plugin]", "reward.name=fails_later", "trainer.iterations=1",
            *SMALL]
    res = train_cli("name=a", *args)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "error: reward 'fails_later' raised ValueError scoring" in text, res.output
    assert "Traceback" not in res.output
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delitem(base._REGISTRY, "fails_later")
    monkeypatch.delitem(__import__("sys").modules, "qa_plugin")
    res = train_cli("name=b", "-v", *args)
    assert isinstance(res.exception, base.RewardFailed), res.output
    assert isinstance(res.exception.__cause__, ValueError)
