"""A damaged checkpoint is named in one line and a resume falls back to the newest intact one,
continuing exactly as an uninterrupted run; temporary folders of an interrupted save are cleared."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from kv4rl.telemetry.metrics import read_jsonl
from kv4rl.trainer.checkpoint import checkpoint_problem
from tests.small_runs import new_run, train_cli, tree_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-iteration run saving every iteration, and an uninterrupted 3-iteration reference."""
    out = tmp_path_factory.mktemp("runs")
    part = new_run(out, "part", "trainer.iterations=2", "checkpoint.save_every=1")
    full = new_run(out, "full", "trainer.iterations=3", "checkpoint.save_every=1")
    return part, full


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_text('{"model_type": "qwen3", ')


DAMAGE = {
    "model.safetensors": truncate,
    "trainer_state.pt": truncate,
    "config.json": garbage,
}


def test_intact_checkpoint_has_no_problem(runs):
    part, _ = runs
    assert checkpoint_problem(part / "checkpoints" / "iter_000002") is None


@pytest.mark.parametrize("file", list(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint(runs, file, tmp_path, caplog):
    part, full = runs
    run = shutil.copytree(part, tmp_path / "run")
    damaged = run / "checkpoints" / "iter_000002" / file
    DAMAGE[file](damaged)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("iter_000002 is damaged" in w and str(damaged) in w and "\n" not in w for w in warnings), warnings
    assert any(w == f"resuming from {run / 'checkpoints' / 'iter_000001'}, the newest intact checkpoint"
               for w in warnings), warnings
    # resumed from iteration 1, it continues exactly as the uninterrupted run
    rows, ref = read_jsonl(run / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref]
    a = load_file(full / "checkpoints" / "iter_000003" / "model.safetensors")
    b = load_file(run / "checkpoints" / "iter_000003" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint_problem(run / "checkpoints" / "iter_000002") is None  # re-saved over the damaged one


def test_no_intact_checkpoint_is_one_clear_error(runs, tmp_path):
    part, _ = runs
    run = shutil.copytree(part, tmp_path / "run")
    truncate(run / "checkpoints" / "iter_000001" / "trainer_state.pt")
    garbage(run / "checkpoints" / "iter_000002" / "config.json")
    before = tree_state(run)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 2 and res.output.startswith("error:") and "Traceback" not in res.output
    text = "".join(res.output.split())  # the console wraps long lines
    assert "nointactcheckpoint" in text and "iter_000001/trainer_state.pt" in text and "iter_000002/config.json" in text
    assert tree_state(run) == before


def test_resume_clears_temporary_folders_of_an_interrupted_save(runs, tmp_path):
    part, _ = runs
    run = shutil.copytree(part, tmp_path / "run")
    root = run / "checkpoints"
    shutil.copytree(root / "iter_000002", root / ".tmp_iter_000003")  # a save killed before its rename
    (root / "latest.tmp").write_text("iter_000003")
    res = train_cli("--resume", str(run), "trainer.iterations=3", "checkpoint.save_every=5", "--no-progress")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002", "iter_000003", "latest"]


def test_a_damaged_newer_checkpoint_is_set_aside_not_counted_by_retention(runs, tmp_path, caplog):
    """Resumed from iter_1 past a damaged iter_2, with keep_last=1: retention used to count the damaged
    iter_2 among the run's newest, keeping it and deleting intact ones. It is renamed at the run's first
    write instead (kept, byte for byte), and retention sees only the new saves."""
    part, _ = runs
    run = shutil.copytree(part, tmp_path / "run")
    truncate(run / "checkpoints" / "iter_000002" / "model.safetensors")
    damaged = tree_state(run / "checkpoints" / "iter_000002")
    res = train_cli("--resume", str(run), "trainer.iterations=3", "checkpoint.keep_last=1", "--no-progress")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["iter_000002.damaged", "iter_000003", "latest"], names
    assert tree_state(run / "checkpoints" / "iter_000002.damaged") == damaged
    assert "set aside the damaged checkpoints newer than the one resumed from, as iter_000002.damaged" in caplog.text
