"""JSONL problem loading: field handling, default ids, and errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv4rl.data.datasets import DatasetError, load_jsonl
from kv4rl.data.types import Problem

SHARED_DATA = Path("/work/shared/data")


def write_lines(tmp_path: Path, lines: list[str], name: str = "set.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loads_rows_with_defaults_and_meta(tmp_path):
    path = write_lines(
        tmp_path,
        [
            json.dumps({"problem": "1+1?", "answer": "2", "id": "p1", "level": 3, "source": "hand"}),
            "",
            json.dumps({"problem": "Half of 1?", "answer": 0.5}),
            "   ",
            json.dumps({"problem": "AIME-style", "answer": 25, "id": 7}),
            json.dumps({"problem": "sep\u2028inside", "answer": "x"}),
        ],
    )
    assert load_jsonl(path) == [
        Problem(problem="1+1?", answer="2", id="p1", meta={"level": 3, "source": "hand"}),
        Problem(problem="Half of 1?", answer="0.5", id="set.jsonl:3", meta={}),
        Problem(problem="AIME-style", answer="25", id="7", meta={}),
        Problem(problem="sep\u2028inside", answer="x", id="set.jsonl:6", meta={}),
    ]


def test_problem_is_frozen():
    problem = Problem(problem="q", answer="a", id="i")
    assert problem.meta == {}
    with pytest.raises(AttributeError):
        problem.answer = "b"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"answer": "1"}), "missing field 'problem'"),
        (json.dumps({"problem": "q"}), "missing field 'answer'"),
        (json.dumps({"problem": "  ", "answer": "1"}), "field 'problem' is empty"),
        (json.dumps({"problem": "q", "answer": ""}), "field 'answer' is empty"),
        (json.dumps({"problem": 5, "answer": "1"}), "field 'problem' must be a string, got int"),
        (
            json.dumps({"problem": "q", "answer": [1]}),
            "field 'answer' must be a string or a number, got list",
        ),
        (
            json.dumps({"problem": "q", "answer": True}),
            "field 'answer' must be a string or a number, got bool",
        ),
        ('{"problem": "q", "answer": NaN}', "field 'answer' is not a finite number"),
        (json.dumps({"problem": "q", "answer": "1", "id": None}), "field 'id' must be"),
        (
            json.dumps({"problem": "q", "answer": "1", "id": "a"}),
            r"duplicate id 'a' \(first used on line 1\)",
        ),
        # these reached the tokenizer, or raised, as tracebacks without file or line
        ('{"problem": "a\\ud800b", "answer": "1"}', "field 'problem' holds a lone surrogate escape at character 1"),
        ('{"problem": "q", "answer": ' + "9" * 5000 + "}", r"not readable \(Exceeds the limit"),
        ('{"problem": "q", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"problem": "q", "answer": "1", "id": "a"})
    path = write_lines(tmp_path, [good, "", bad_line])
    with pytest.raises(DatasetError, match=f"{path}:3: {message}"):
        load_jsonl(path)


def test_invalid_utf8_is_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"problem": "q", "answer": "\xff"}\n')
    with pytest.raises(DatasetError, match=f"{path}:1: not valid UTF-8"):
        load_jsonl(path)


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DatasetError, match=f"{missing} does not exist"):
        load_jsonl(missing)
    empty = write_lines(tmp_path, ["", "  "], name="empty.jsonl")
    with pytest.raises(DatasetError, match=f"{empty} contains no rows"):
        load_jsonl(empty)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)


@pytest.mark.parametrize(
    ("name", "num_rows", "first_id"),
    [
        ("math500.jsonl", 500, "test/precalculus/807.json"),
        ("aime2024.jsonl", 30, "2024-I-1"),
    ],
)
def test_shared_eval_sets_load(name, num_rows, first_id):
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    problems = load_jsonl(path)
    assert len(problems) == num_rows
    assert problems[0].id == first_id
    assert len({p.id for p in problems}) == num_rows
    assert all(p.answer.strip() and p.problem.strip() for p in problems)
    assert all(p.meta["source"] for p in problems)


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"problem": "1+1", "answer": "2"}\n{"problem": "é", "answer": 3}\n'.encode())
    rows = load_jsonl(path)
    assert [(r.problem, r.answer, r.id) for r in rows] == [("1+1", "2", "bom.jsonl:1"), ("é", "3", "bom.jsonl:2")]


def test_a_numeric_answer_keeps_the_digits_the_file_wrote_without_an_exponent(tmp_path):
    """str(1e20) is '1e+20', which math-verify reads as e + 20: no response could score."""
    path = tmp_path / "n.jsonl"
    path.write_bytes(b'{"problem": "a", "answer": 1e20, "w": 0.5}\n{"problem": "b", "answer": 0.00001}\n'
                     b'{"problem": "c", "answer": 2.50}\n{"problem": "d", "answer": -3E2}\n')
    rows = load_jsonl(path)
    assert [p.answer for p in rows] == ["100000000000000000000", "0.00001", "2.50", "-300"]
    assert rows[0].meta == {"w": 0.5} and json.dumps(rows[0].meta) == '{"w": 0.5}'


def test_a_key_given_twice_in_a_row_is_refused(tmp_path):
    path = write_lines(tmp_path, ['{"problem": "p", "answer": "2", "answer": "3"}'])
    with pytest.raises(DatasetError, match=r"set.jsonl:1: key 'answer' is given twice"):
        load_jsonl(path)


def test_a_carriage_return_inside_a_row_is_whitespace_and_crlf_lines_count_once(tmp_path):
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b'{"problem": "p",\r"answer": "1"}\r\n{"problem": "q", "answer": "2"}\r\nnot json\r\n')
    with pytest.raises(DatasetError, match=r"cr.jsonl:3: not valid JSON"):  # the editor's line 3
        load_jsonl(path)
    path.write_bytes(b'{"problem": "p",\r"answer": "1"}\r\n{"problem": "q", "answer": "2"}\r\n')
    assert [(p.answer, p.id) for p in load_jsonl(path)] == [("1", "cr.jsonl:1"), ("2", "cr.jsonl:2")]


@pytest.mark.parametrize("name, text", [("pretty.json", '{\n  "problem": "q", "answer": "1"\n}\n'),
                                        ("rows.json", '[{"problem": "q", "answer": "1"}]\n')])
def test_a_json_file_that_is_not_json_lines_says_so(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DatasetError, match=f"{path}:1: .*a dataset file is JSON Lines: one object per line"):
        load_jsonl(path)


def test_a_pretty_printed_array_named_jsonl_is_told_it_is_an_array(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps([{"problem": "q", "answer": "1"}], indent=2))
    with pytest.raises(DatasetError, match=r"rows.jsonl:1: not valid JSON .* \(a JSON array\? a dataset file is JSON "
                                           r"Lines: one object per line\)"):
        load_jsonl(path)


@pytest.mark.parametrize(("encode", "said"), [
    (lambda text: __import__("gzip").compress(text.encode()), "is gzip-compressed (decompress it first)"),
    (lambda text: text.encode("utf-16"), "is UTF-16 text (save it as UTF-8)"),
])
def test_a_compressed_or_utf16_file_is_named_for_what_it_is(tmp_path, encode, said):
    """Each read as "line 1: not valid UTF-8 (invalid start byte)", which did not say what the file was."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode('{"problem": "q", "answer": "1"}\n'))
    with pytest.raises(DatasetError) as info:
        load_jsonl(path)
    assert str(info.value) == f"dataset file {path} {said}; a dataset file is JSON Lines in UTF-8"


def test_a_pipe_or_fifo_is_refused_before_any_read(tmp_path):
    """A pipe (`--data <(zcat f.gz)`) gives its bytes once, and a dataset is read more than once: the layout check
    took its first 4 KiB, so a run trained on the rest without a word (32 of 100 rows lost); a named pipe waited for
    ever for a writer that had gone. Both are refused by name before anything is read (the FIFO has no writer
    here: a read would block the test)."""
    import os
    import threading

    from kv4rl.data.datasets import read_problems

    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    errors = []
    reader = threading.Thread(target=lambda: errors.append(pytest.raises(DatasetError, read_problems, fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "the FIFO was opened: read_problems blocked"
    assert "is not a regular file" in str(errors[0].value) and "write it to a file" in str(errors[0].value)
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"problem": "q", "answer": "1"}\n')
    os.close(write_end)
    with pytest.raises(DatasetError, match=r"/dev/fd/\d+ is not a regular file"):
        read_problems(f"/dev/fd/{read_end}")
    assert os.read(read_end, 100) == b'{"problem": "q", "answer": "1"}\n'  # nothing read from it
    os.close(read_end)
    good = tmp_path / "rows.jsonl"
    good.write_text('{"problem": "q", "answer": "1"}\n')
    assert len(read_problems(good)[0]) == 1


def test_the_stream_digest_fed_row_by_row_is_the_one_checkpoints_store():
    """`_spec_sha256` hashes the rows one by one; a checkpoint's digest is sha256 of the whole spec's JSON with the
    rows as [id, problem, answer] lists, which it must equal, or every earlier run's resume is refused."""
    import hashlib
    import random

    from kv4rl.data.source import _spec_sha256
    from kv4rl.data.types import Problem

    rng = random.Random(0)

    def text():
        return "".join(rng.choice('ab"\\\n\u00e9\u4e2d{}[], :') for _ in range(rng.randint(0, 12)))

    for _ in range(300):
        rows = [Problem(problem=text(), answer=text(), id=text()) for _ in range(rng.randint(0, 5))]
        spec = {"seed": rng.randint(0, 9), "shuffle": rng.random() < 0.5, "problems": rows}
        if rng.random() < 0.5:
            spec.update(max_prompt_tokens=rng.randint(1, 99), prompt_format=[text() or None, rng.random() < 0.5])
        whole = {**spec, "problems": [[p.id, p.problem, p.answer] for p in rows]}
        assert _spec_sha256(spec) == hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()
    task = {"seed": 3, "task": "ArithmeticTask"}
    assert _spec_sha256(task) == hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()


def test_a_large_file_is_read_line_by_line_to_the_same_rows(tmp_path):
    """Rows, ids and errors as before the file was streamed: a BOM, CRLF endings, blank lines, no final newline,
    and a JSON array named as one at its line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": 1}\r\n\n  \n{"problem": "b", "answer": "2", "id": "x"}')
    assert [(p.problem, p.answer, p.id) for p in load_jsonl(path)] == [("a", "1", "d.jsonl:1"), ("b", "2", "x")]
    array = tmp_path / "a.jsonl"
    array.write_text('\n[\n{"problem": "a", "answer": 1}\n]\n')
    with pytest.raises(DatasetError, match=r"a.jsonl:2: .*\(a JSON array\? a dataset file is JSON Lines"):
        load_jsonl(array)
