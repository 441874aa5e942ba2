"""`kv4rl eval` under torchrun on the CPU (gloo): the problems shared out over the ranks' engines.

The reference is one process evaluating the same problems: every problem's samples (scores, token
counts, texts) and every metric must be equal, because each request is seeded by its problem's place
in the whole set, not by its place in an engine's batch. Also checked: rank 0 alone prints the table
and writes the files, an engine of two tensor-parallel ranks samples what one process samples, bad
settings are refused by name before any work, and a failing rank ends the job with its error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kv4rl.cli import app

pytestmark = pytest.mark.slow
ARGS = ["--num-problems", "7", "--k", "4", "--device", "cpu", "--seed", "3"]  # 7 problems: uneven shares (4 and 3)

# records which rank writes the result files, then writes them as usual
WRITERS_HOOK = (
    "import os\n"
    "import kv4rl.cli_eval as cli_eval\n"
    "def _logged(fn):\n"
    "    def wrapped(*args):\n"
    "        with open(os.environ['WRITERS_LOG'], 'a') as log:\n"
    "            log.write(fn.__name__ + ' ' + os.environ.get('RANK', '-') + '\\n')\n"
    "        return fn(*args)\n"
    "    return wrapped\n"
    "cli_eval.write_together = _logged(cli_eval.write_together)\n")

FAILING_HOOK = (
    "import os\n"
    "if os.environ.get('LOCAL_RANK') == '1':\n"
    "    import kv4rl.eval.data_parallel as dp\n"
    "    def failing(*args, **kwargs):\n"
    "        raise RuntimeError('rank 1 fails on purpose while sampling')\n"
    "    dp.sample_problems = failing\n")


def torchrun_eval(cwd, hook: str, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    (cwd / "hook").mkdir(exist_ok=True)
    (cwd / "hook" / "sitecustomize.py").write_text(hook)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="", WRITERS_LOG=str(cwd / "writers.log"),
               PYTHONPATH=os.pathsep.join([str(cwd / "hook"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--standalone", "-m", "kv4rl.cli", "eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def one_process(tmp_path, *extra: str) -> tuple[dict, list[dict]]:
    res = CliRunner().invoke(app, ["eval", *ARGS, *extra, "--json", str(tmp_path / "one.json"),
                                   "--samples", str(tmp_path / "one.jsonl")])
    assert res.exit_code == 0, res.output
    return read(tmp_path / "one.json", tmp_path / "one.jsonl")


def read(json_path, samples_path) -> tuple[dict, list[dict]]:
    return (json.loads(json_path.read_text()),
            [json.loads(line) for line in samples_path.read_text().splitlines()])


def test_two_ranks_evaluate_what_one_process_evaluates_and_rank_0_alone_writes(tmp_path):
    done = torchrun_eval(tmp_path, WRITERS_HOOK, *ARGS, "--json", "two.json", "--samples", "two.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    two, two_samples = read(tmp_path / "two.json", tmp_path / "two.jsonl")
    one, one_samples = one_process(tmp_path)

    assert [s["index"] for s in two_samples] == list(range(7))
    assert two_samples == one_samples  # every problem's scores, token counts and texts
    assert two.pop("engines") == 2 and one.pop("engines") == 1
    assert two == one  # mean@4, pass@1,2,4, response_len_mean, reward counts and settings
    assert 0 < one["mean@4"] < 1  # the tiny model gets some but not all of these right: a real comparison
    assert len({s["responses"][0] for s in one_samples}) > 1

    assert sorted((tmp_path / "writers.log").read_text().split("\n")[:-1]) == ["write_together 0"]  # JSON and samples
    assert done.stdout.count("pass@4") == 1, done.stdout  # one table, from rank 0
    assert "error:" not in done.stdout + done.stderr


def test_one_tensor_parallel_engine_of_two_ranks_samples_what_one_process_samples(tmp_path):
    """The sharded engine computes the unsharded logits to float32 rounding, which moves no sample here."""
    done = torchrun_eval(tmp_path, WRITERS_HOOK, *ARGS, "engine.tensor_parallel=2", "--json", "tp.json",
                         "--samples", "tp.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    tp, tp_samples = read(tmp_path / "tp.json", tmp_path / "tp.jsonl")
    one, one_samples = one_process(tmp_path)
    assert tp_samples == one_samples
    assert tp.pop("engines") == one.pop("engines") == 1
    assert tp.pop("engine") == ["engine.tensor_parallel=2"] and one.pop("engine") == []
    assert tp == one


def test_an_error_every_rank_meets_is_said_once(tmp_path):
    """A model of one KV head cannot be split over two tensor-parallel ranks: both ranks refused it, and the
    line was printed once per rank."""
    from kv4rl.data.char_tokenizer import build_char_tokenizer
    from tests.conftest import make_checkpoint

    model = tmp_path / "one-kv-head"
    tokenizer = build_char_tokenizer(model)
    make_checkpoint(model, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id, num_key_value_heads=1)
    (tmp_path / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    done = torchrun_eval(tmp_path, "", "--model", str(model), "--data", "d.jsonl", "--k", "1", "--device", "cpu",
                         "--json", "out.json", "engine.tensor_parallel=2")
    out = done.stderr + done.stdout
    assert done.returncode != 0
    assert out.count("error: engine.tensor_parallel=2 does not divide the model's 1 KV heads") == 1, out[-3000:]
    assert not (tmp_path / "out.json").exists()


def test_one_failing_rank_ends_the_job_with_its_error(tmp_path):
    failed = torchrun_eval(tmp_path, FAILING_HOOK, *ARGS, "--json", "out.json")
    assert failed.returncode != 0
    assert "rank 1 fails on purpose while sampling" in failed.stderr + failed.stdout
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(("world", "args", "needle"), [
    ("2", ["engine.tensor_parallel=3"], "engine.tensor_parallel=3 does not divide the 2 ranks torchrun started"),
    ("1", ["engine.tensor_parallel=2"], "torchrun --nproc-per-node 2 -m kv4rl.cli eval"),
    ("2", ["--device", "cuda:1"], "--device cuda:1: under torchrun each rank takes its own GPU"),
])
def test_bad_layouts_are_refused_by_name_before_any_work(tmp_path, monkeypatch, world, args, needle):
    import kv4rl.cli_eval
    import kv4rl.distributed

    def no_work(*_args, **_kwargs):
        raise AssertionError("work started")

    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(kv4rl.cli_eval, "check_device", lambda device: None)  # cuda:1 on a CPU-only host
    monkeypatch.setattr(kv4rl.distributed, "init_from_torchrun", no_work)
    res = CliRunner().invoke(app, ["eval", "--num-problems", "2", *args, "--json", str(tmp_path / "out.json")])
    assert res.exit_code == 2, res.output
    assert needle in " ".join(res.output.split()), res.output
    assert not (tmp_path / "out.json").exists()
