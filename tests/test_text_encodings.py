"""Names, paths and templates whose bytes are not UTF-8 text, or that the locale cannot hold: refused by key
before any work (a run folder path of Latin-1 bytes trained its first iterations, then failed at the first
checkpoint with nothing saved; QA), folder names with format characters taken, and plots of such folders
drawn with readable labels (they stopped matplotlib with a traceback)."""

import csv
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.config import ConfigError, load_config
from kv4rl.data.prompts import check_template
from kv4rl.paths import readable, text_problem

LATIN1 = os.fsdecode(b"caf\xe9")  # a folder name written in Latin-1, as Python passes it on: 'caf\udce9'


@pytest.mark.parametrize("key", ["out_dir", "name"])
def test_a_run_folder_whose_bytes_are_not_utf8_is_refused_by_key(key, tmp_path):
    value = LATIN1 if key == "name" else str(tmp_path / LATIN1)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={value}"])
    shown = "caf\\xe9" if key == "name" else f"{tmp_path}/caf\\xe9"
    assert str(info.value) == f"{key}='{shown}' holds bytes that are not UTF-8 text (written in another " \
                              f"encoding?); give it in UTF-8"
    with pytest.raises(ConfigError, match="holds bytes that are not UTF-8"):  # a surrogate standing for no byte
        load_config(overrides=[f"{key}={value[:-1]}\ud800"])


@pytest.mark.parametrize("key", ["model.path", "data.train", "data.eval"])
def test_files_the_run_only_reads_may_be_named_in_any_bytes(key, tmp_path):
    """Inputs at a Latin-1 path trained and resumed before (review): only what the run writes is checked."""
    assert load_config(overrides=[f"{key}={tmp_path / LATIN1}"], validate=False).validate()


def test_a_template_whose_bytes_are_not_utf8_is_refused_by_option():
    template = os.fsdecode(b"R\xe9ponds {problem}=")
    with pytest.raises(ConfigError, match=r"data.prompt_template='R\\xe9ponds \{problem\}=' holds bytes that are not"):
        load_config(overrides=[f"data.prompt_template={template}"])
    with pytest.raises(ValueError, match=r"--template='R\\xe9ponds \{problem\}=' holds bytes that are not UTF-8"):
        check_template(template, "--template")
    check_template("Réponds 中文 {problem}=", "--template")  # real non-ASCII text is a template


def test_a_template_holding_a_control_character_is_refused_naming_the_quotes():
    """`data.prompt_template="... \\boxed{{}}."` on the command line is YAML in double quotes, where `\\b` is a
    backspace: the run's prompts read `\\x08oxed` while eval's --template kept `\\boxed`, without a word. A
    control character other than newline, tab and CR is refused; single quotes keep the backslash."""
    with pytest.raises(ConfigError, match=r"holds the control character '\\x08'; in YAML's double quotes"):
        load_config(overrides=['data.prompt_template="{problem} within \\boxed{{}}."'])
    kept = load_config(overrides=["data.prompt_template='{problem} within \\boxed{{}}.'"])
    assert kept.data.prompt_template == "{problem} within \\boxed{{}}."
    check_template("Question:\n{problem}\tAnswer:\r\n", "--template")  # line breaks and tabs are text
    with pytest.raises(ValueError, match=r"--template: .* holds the control character '\\x1b'"):
        check_template("{problem}\x1b[0m", "--template")


@pytest.mark.parametrize("name", ["👨‍👩‍👧 run", "a\u3000b", "café", "中文"])
def test_folder_names_with_format_characters_and_wide_spaces_are_taken(name):
    """A ZWJ emoji (U+200D is a format character) and the ideographic space were refused as 'control
    characters' (str.isprintable); only control characters (Cc) are."""
    assert load_config(overrides=[f"name={name}"]).name == name


@pytest.mark.parametrize("name", ["a\tb", "a\x1bb", "a\x7fb"])
def test_folder_names_with_control_characters_are_refused(name):
    with pytest.raises(ConfigError, match="must be a folder name"):
        load_config(overrides=[f"name={name}"])


@pytest.mark.parametrize("source", ["argv", "config file"])
def test_under_a_locale_without_utf8_a_non_ascii_path_is_refused_with_the_way_out(tmp_path, source):
    """`LC_ALL=C PYTHONUTF8=0`: Python's file-system encoding is ASCII; the folder was refused as holding
    'control characters' (resume) or crashed after the first iteration (a name from a config file), and a
    name from a config file then failed the check itself (review)."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    env.pop("LC_CTYPE", None)
    command = [sys.executable, "-m", "kv4rl.cli", "train", "--print-config"]
    if source == "argv":
        command.append(f"out_dir={tmp_path}/中文")
    else:
        (tmp_path / "c.yaml").write_text(f"out_dir: {tmp_path}/中文\n", encoding="utf-8")
        command += ["--config", str(tmp_path / "c.yaml")]
    res = subprocess.run(command, env=env, capture_output=True, text=True, encoding="utf-8", timeout=120)
    if "encoding (ascii)" not in res.stderr and res.returncode == 0:  # this Python kept UTF-8 under C anyway
        pytest.skip("the C locale's file-system encoding is UTF-8 here")
    assert res.returncode == 2, res.stderr
    assert f"error: out_dir='{tmp_path}/中文': this locale's encoding (ascii) cannot hold it; run under a UTF-8 " \
           "locale (LANG=C.UTF-8) or with PYTHONUTF8=1" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if source == "argv" else ["c.yaml"])


def test_text_problem_against_hand_worked_cases():
    assert text_problem("k", "plain/path é 中") is None
    assert text_problem("k", LATIN1).startswith("k='caf\\xe9' holds bytes")
    assert readable(LATIN1) == "caf\\xe9" and readable(os.fsdecode("中".encode())) == "中"  # surrogates of UTF-8 bytes
    assert readable("plain é") == "plain é" and readable("a\ud800") == "a\\ud800"  # no byte behind it


def test_curves_of_a_folder_whose_name_is_not_utf8_are_drawn_with_a_readable_label(tmp_path):
    run = tmp_path / f"{LATIN1}-s0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "loss": 0.5 * i}) + "\n" for i in range(3)))
    out = tmp_path / "fig" / "c.png"
    res = CliRunner().invoke(app, ["plot", "curves", str(run), "--metric", "loss", "--ema", "0.5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    with out.with_suffix(".csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["arm"] for r in rows} == {"caf\\xe9"} and [float(r["mean"]) for r in rows] == [0.0, 0.25, 0.625]  # EMA 0.5 of 0, .5, 1
