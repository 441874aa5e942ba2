"""A run folder holds one run: a second `train` into it refuses, --overwrite moves the old run
aside, a failed start (each cause) leaves the folder byte for byte as it was, retention deletes
only the run's own checkpoints, and a resume works in place and reports the whole run."""

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from kv4rl.config import load_config
from kv4rl.config_loader import ConfigError
from kv4rl.paths import SET_ASIDE
from kv4rl.run_folder import FolderInUse, RunFolder, RunFolderError, config_for_resume, lock_folder, unlock_folder
from kv4rl.telemetry.metrics import read_jsonl
from tests.small_runs import SMALL, new_run, tiny_weights_sha256, train_cli, tree_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-iteration run with checkpoints iter_1 and iter_2."""
    return new_run(tmp_path_factory.mktemp("runs"), "base", "trainer.iterations=2", "checkpoint.save_every=1")


@pytest.fixture
def copied(finished, tmp_path):
    """A private copy of the finished run (its config.yaml still names the original folder)."""
    return shutil.copytree(finished, tmp_path / "run")


@pytest.fixture
def run(copied):
    """A private run folder whose config.yaml names the folder itself, as if trained there."""
    saved = copied / "config.yaml"
    saved.write_text(yaml.safe_dump({**yaml.safe_load(saved.read_text()), "name": "run",
                                     "out_dir": str(copied.parent)}, sort_keys=False))
    return copied


def test_every_row_records_the_starting_models_fingerprint(finished):
    rows = read_jsonl(finished / "metrics.jsonl")
    assert len(rows) == 2 and {r["model_sha256"] for r in rows} == {tiny_weights_sha256()[:16]}


def test_train_into_a_folder_holding_a_run_refuses_before_any_work(run):
    before = tree_state(run.parent)
    res = train_cli(f"out_dir={run.parent}", "name=run", *SMALL, "trainer.iterations=3")
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "already holds a run" in text and f"--resume {shlex.quote(str(run))}" in text and "name=" in text and "--overwrite" in text
    assert tree_state(run.parent) == before


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/iter_000001", "link to a checkpoint"])
def test_a_run_inside_another_runs_checkpoints_is_refused_before_any_work(run, inside):
    """A run trained into `<run>/checkpoints/iter_000005` was deleted with no word when the outer run's resume
    pruned that checkpoint (a review helper's find): a folder in a run's checkpoints/ is refused, also through a
    symlink."""
    before = tree_state(run)
    if inside == "link to a checkpoint":
        (run.parent / "link").symlink_to(run / "checkpoints" / "iter_000001")
        inside = "../link"
    res = train_cli(f"out_dir={run / inside}", "name=nested", *SMALL, "trainer.iterations=1")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"lies inside the checkpoints of the run folder {run}" in text, text
    assert "out_dir=" in text and tree_state(run) == before


def test_a_project_folder_with_a_config_yaml_and_checkpoints_is_no_run_folder(tmp_path, monkeypatch):
    """Beside a user's own config.yaml and checkpoints/ (the review of the first fix, which refused them), and in a
    run folder outside its checkpoints/ (which --overwrite moves aside whole), a new run trains."""
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("model: mine\n")
    (project / "metrics.jsonl").write_text("")
    monkeypatch.chdir(project)
    res = train_cli("out_dir=runs", "name=fine", *SMALL, "trainer.iterations=1")
    assert res.exit_code == 0, res.output
    res = train_cli(f"out_dir={project / 'runs' / 'fine' / 'notes'}", "name=beside", *SMALL, "trainer.iterations=1")
    assert res.exit_code == 0, res.output


def test_overwrite_moves_the_old_run_aside_and_says_where(run, caplog):
    before = tree_state(run)
    res = train_cli(f"out_dir={run.parent}", "name=run", *SMALL, "trainer.iterations=1", "--overwrite")
    assert res.exit_code == 0, res.output
    siblings = [p for p in run.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(siblings) == 1 and SET_ASIDE.search(siblings[0].name)  # what plot curves' globs leave out
    assert tree_state(siblings[0]) == before  # the old run, untouched, under its new name
    assert str(siblings[0]) in caplog.text
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "latest"]


@pytest.mark.parametrize("key", ["data.train", "data.eval", "model.path", "data.train as a link"])
def test_overwrite_refuses_to_move_the_new_runs_own_inputs_aside(run, key, tmp_path):
    """--overwrite moved the old folder aside with a data file the new run read from inside it: the run trained,
    but its config.yaml named a path that had gone, so its resume failed ("dataset file ... does not exist"). Such
    an input (data or model, also one of a list) is refused by name before any work; the folder stays as it was."""
    import json as json_

    rows = "".join(json_.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
    if key == "model.path":
        inside = run / "checkpoints" / "iter_000001"
        value = str(inside)
    elif key == "data.train as a link":  # the link moves aside with the folder, the file it names does not
        (tmp_path / "elsewhere.jsonl").write_text(rows)
        inside = run / "mydata.jsonl"
        inside.symlink_to(tmp_path / "elsewhere.jsonl")
        value, key = str(inside), "data.train"
    else:
        inside = run / "mydata.jsonl"
        inside.write_text(rows)
        value = json_.dumps([str(inside)]) if key == "data.eval" else str(inside)
    before = tree_state(run.parent)
    extra = ["data.prompt_template='{problem}'", "reward.name=exact"] if key != "model.path" else []
    res = train_cli(f"out_dir={run.parent}", "name=run", *SMALL, "trainer.iterations=1", f"{key}={value}", *extra,
                    "--overwrite")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{key}=" in text and "moves aside with the old run" in text, text
    assert tree_state(run.parent) == before


CAUSES = {
    "missing model folder": ["model.path={tmp}/no-model"],
    "missing data file": ["data.train={tmp}/no-data.jsonl"],
    "KV pool too small": ["engine.num_kv_blocks=1", "engine.kv.block_size=4"],
    "context shorter than a prompt": ["engine.max_model_len=4"],
    "kv4 protection beyond the context": ["engine.kv.format=kv4", "engine.kv.group_size=32",
                                          "engine.kv.n_sink=64", "engine.kv.n_recent=64"],
    "no CUDA": ["device=cuda"],
}


def test_overwrite_of_a_run_whose_set_aside_name_is_too_long_refuses_before_any_work(finished, tmp_path):
    """A name near the file system's 255 bytes: moving the old run aside as `<name>.old-<time>` failed after
    the first iteration ("File name too long", then a hint to resume, which was not what was asked)."""
    long = "L" * 240
    run = shutil.copytree(finished, tmp_path / long)
    before = tree_state(tmp_path)
    res = train_cli(f"out_dir={tmp_path}", f"name={long}", *SMALL, "trainer.iterations=1", "--overwrite")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"--overwrite moves the old run aside as {long}.old-<time>, a name longer than the 255 bytes" in text
    assert tree_state(tmp_path) == before and run.is_dir()


@pytest.mark.parametrize("mode", ["resume", "overwrite"])
@pytest.mark.parametrize("cause", list(CAUSES))
def test_failed_start_leaves_the_folder_byte_identical(run, cause, mode):
    if cause == "no CUDA" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    extra = [a.format(tmp=run.parent) for a in CAUSES[cause]]
    before = tree_state(run.parent)
    if mode == "resume":
        res = train_cli("--resume", str(run), "trainer.iterations=4", "--no-progress", *extra)
    else:
        res = train_cli(f"out_dir={run.parent}", "name=run", *SMALL, "trainer.iterations=4", *extra, "--overwrite")
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error:") and "Traceback" not in res.output
    assert tree_state(run.parent) == before  # nothing written, nothing moved aside


def test_failed_start_in_a_new_folder_creates_nothing(tmp_path):
    res = train_cli(f"out_dir={tmp_path}", "name=new", *SMALL, "engine.max_model_len=4")
    assert res.exit_code == 2 and "max_model_len" in res.output
    assert not (tmp_path / "new").exists()


def test_retention_deletes_only_this_runs_checkpoints(run, tmp_path):
    other = new_run(tmp_path / "elsewhere", "other", "trainer.iterations=1", "checkpoint.save_every=1")
    foreign = run / "checkpoints" / "iter_000000"  # another run's checkpoint dropped into this folder
    shutil.copytree(other / "checkpoints" / "iter_000001", foreign)
    foreign_state = tree_state(foreign)
    res = train_cli("--resume", str(run), "trainer.iterations=4", "checkpoint.keep_last=1", "--no-progress")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["iter_000000", "iter_000004", "latest"]
    assert tree_state(foreign) == foreign_state
    assert (run / "checkpoints" / "latest").read_text() == "iter_000004"


def test_resume_where_checkpoints_is_a_file_says_so_and_touches_nothing(copied):
    """It said "no checkpoint yet (the run stopped before its first save...)" of a run with rows."""
    run = copied
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")
    before = tree_state(run)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert f"{run / 'checkpoints'} is a file, not the run's checkpoints folder" in text, text
    assert "no checkpoint yet" not in text and tree_state(run) == before


def test_resume_without_a_checkpoint_refuses_and_its_start_over_command_acts_on_that_folder(copied, finished):
    """The folder is a copy whose config.yaml names the original run: the command the error suggests must
    start over in the copy, not move the original aside."""
    run = copied
    shutil.rmtree(run / "checkpoints")
    before, original = tree_state(run), tree_state(finished)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 2
    assert "no checkpoint yet" in res.output and tree_state(run) == before
    command = re.search(r"to start it over, run `kv4rl train ([^`]*)`", " ".join(res.output.split())).group(1)
    res = train_cli(*shlex.split(command), *SMALL, "trainer.iterations=1")
    assert res.exit_code == 0, res.output
    assert tree_state(finished) == original and not list(finished.parent.glob("base.old-*"))
    (aside,) = run.parent.glob("run.old-*")
    assert tree_state(aside) == before  # the copy was set aside, whole, and the new run trained in its place
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0]


def test_resume_of_a_missing_folder_or_a_file_says_which(tmp_path):
    (tmp_path / "afile").write_text("x")
    res = train_cli("--resume", str(tmp_path / "nothing"), "--no-progress")
    assert res.exit_code == 2 and "no such folder" in res.output
    res = train_cli("--resume", str(tmp_path / "afile"), "--no-progress")
    assert res.exit_code == 2 and "is a file, not a run folder" in res.output
    assert (tmp_path / "afile").read_text() == "x"


def test_copied_run_folder_resumes_in_place(copied, finished):
    run = copied
    original = tree_state(finished)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert (run / "checkpoints" / "iter_000003").is_dir()
    assert "name: run\n" in (run / "config.yaml").read_text()
    assert tree_state(finished) == original  # the folder it was copied from is untouched
    res = train_cli("--resume", str(run), "name=elsewhere", "--no-progress")
    assert res.exit_code == 2 and "name comes from the folder resumed; leave it out" in " ".join(res.output.split())


def test_summary_after_resume_covers_the_whole_run(run):
    from kv4rl.config import load_config
    from kv4rl.loop import train

    summary = train(load_config(run / "config.yaml", [f"out_dir={run.parent}", "name=run",
                                                      "trainer.iterations=4"]), resume=True, show_progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert {r["model_sha256"] for r in rows} == {tiny_weights_sha256()[:16]}  # the config's model, also on resume
    assert summary["iterations"] == 4 and summary["resumed_from"] == 2
    assert summary["reward_first"] == rows[0]["reward_mean"] and summary["reward_last"] == rows[3]["reward_mean"]
    assert summary["accuracy_first5"] == pytest.approx(sum(r["accuracy"] for r in rows) / 4, abs=1e-12)


def test_summary_of_a_resume_stopped_before_its_first_iteration_leaves_out_the_rows_it_would_replace(run, monkeypatch):
    """iter_2 damaged: the resume starts from iter_1, so metrics.jsonl's row 1 is one its first write replaces."""
    import kv4rl.loop
    from kv4rl.graceful_stop import GracefulStop
    from kv4rl.loop import train

    class StoppedAtOnce(GracefulStop):
        def __enter__(self):
            super().__enter__()
            self.requested = "SIGTERM"
            return self

    (run / "checkpoints" / "iter_000002" / "trainer_state.pt").write_bytes(b"torn")
    monkeypatch.setattr(kv4rl.loop, "GracefulStop", StoppedAtOnce)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    summary = train(load_config(run / "config.yaml", ["trainer.iterations=4"]), resume=True, show_progress=False)
    assert summary["resumed_from"] == 1 and summary["stopped_by"] == "SIGTERM after iteration 0"
    assert summary["iterations"] == 1 and summary["reward_last"] == rows[0]["reward_mean"]
    assert summary["seconds_in_iterations"] == pytest.approx(rows[0]["time_total"])
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1]  # nothing written


def test_resume_of_a_finished_run_prints_its_summary_builds_nothing_and_says_how_to_train_longer(run, monkeypatch):
    import kv4rl.loop

    def built(*args, **kwargs):
        raise AssertionError("a finished run's resume built the model, engine and learner")

    monkeypatch.setattr(kv4rl.loop, "build", built)
    before = tree_state(run)
    res = train_cli("--resume", str(run), "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "warning: nothing trained: iter_000002 has done 2 iterations and trainer.iterations=2" in text, text
    assert "give trainer.iterations above 2" in text and f"run {run}" in text
    assert tree_state(run) == before


def test_resume_refuses_a_newest_checkpoint_copied_in_from_another_run(run):
    """Another run's iter_000005 copied into checkpoints/ was resumed from without a word: its weights, a gap in
    metrics.jsonl (iterations 3-4 never logged) and its run id, under which the folder's own checkpoints were never
    pruned again. Refused, nothing touched; the run's own newest checkpoint still resumes."""
    foreign = run / "checkpoints" / "iter_000005"
    shutil.copytree(run / "checkpoints" / "iter_000002", foreign)
    meta = json.loads((foreign / "checkpoint.json").read_text())
    (foreign / "checkpoint.json").write_text(json.dumps({**meta, "run_id": "0123456789ab", "iteration": 5}))
    state = torch.load(foreign / "trainer_state.pt", weights_only=False)
    torch.save({**state, "iteration": 5}, foreign / "trainer_state.pt")
    before = tree_state(run)
    res = train_cli("--resume", str(run), "trainer.iterations=7", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "the newest checkpoint iter_000005 (run id 0123456789ab) is not this run's (its " \
        "metrics.jsonl ends at iteration 1)" in text, text
    assert f"model.path={foreign}" in text
    assert tree_state(run) == before
    # two copied in (the others' ids no longer one): refused alike, by the log
    second = run / "checkpoints" / "iter_000004"
    shutil.copytree(foreign, second)
    res = train_cli("--resume", str(run), "trainer.iterations=7", "--no-progress")
    assert res.exit_code == 2 and "is not this run's" in " ".join(res.output.split()), res.output
    shutil.rmtree(second)
    # a log that reaches it (rows appended by hand): refused by its run id, the others' being one
    metrics = run / "metrics.jsonl"
    logged = metrics.read_text()
    metrics.write_text(logged + "".join(json.dumps({"iteration": i}) + "\n" for i in range(2, 5)))
    res = train_cli("--resume", str(run), "trainer.iterations=7", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "(the folder's other checkpoints were written by run " in text, text
    metrics.write_text(logged)
    shutil.rmtree(foreign)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output


def test_resume_refuses_another_starting_model(run, tmp_path):
    """model.path on --resume swapped the reference model and the rows' fingerprint mid-run, silently."""
    before = tree_state(run)
    res = train_cli("--resume", str(run), f"model.path={tmp_path / 'other-model'}", "trainer.iterations=3",
                    "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "model.path cannot change on resume" in text, text
    assert f"change model.path in {run / 'config.yaml'}" in text
    res = train_cli("--resume", str(run), "model.testbed=longmul-test", "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 2 and "model.testbed cannot change on resume" in " ".join(res.output.split())
    assert tree_state(run) == before


def test_resume_refuses_other_weights_at_the_starting_models_path(tmp_path):
    """The path was compared, not the weights: a model folder replaced at the same path (another machine's
    build of a testbed, another cache) was taken as the run's reference, and kl_ref went 0.0006 -> 1.08 at the
    resume (QA). Reference: the model_sha256 the run's rows record."""
    from safetensors.torch import load_file, save_file

    from kv4rl.models.tiny import tiny_model_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), model)
    run = new_run(tmp_path / "runs", "swapped", f"model.path={model}", "trainer.iterations=1")
    assert train_cli("--resume", str(run), "trainer.iterations=2", "--no-progress").exit_code == 0  # same model
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in weights.items()},
              model / "model.safetensors", metadata={"format": "pt"})
    (model / "kv4rl_tiny.json").unlink()  # its recorded fingerprint was of the old weights
    before = tree_state(run)
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"the starting model {model} is not the one this run started from" in text, text
    assert tree_state(run) == before
    model.rename(tmp_path / "moved")  # the bare 'does not exist' did not say where the path comes from
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"(model.path in {run / 'config.yaml'}); if the folder moved, change" in text, text
    assert tree_state(run) == before


@pytest.mark.parametrize("override, message", [
    ("staleness.lag=1", "staleness.lag cannot change on resume (0 -> 1): its checkpoints hold the batches"),
    ("rollout.group_size=4", "rollout.group_size cannot change on resume (2 -> 4)"),
    ("engine.tensor_parallel=2", "engine.tensor_parallel cannot change on resume (1 -> 2)"),
])
def test_resume_refuses_a_setting_its_checkpoint_holds_work_for(run, override, message):
    """`staleness.lag=0` on resuming a lag-1 run was recorded in config.yaml but the restored pipeline kept
    delivering batches one version old (and max_versions then counted from the wrong lag)."""
    before = tree_state(run)
    res = train_cli("--resume", str(run), override, "trainer.iterations=3", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and message in text, text
    assert tree_state(run) == before


def test_resume_of_a_partial_run_as_sync_is_refused_before_any_work(tmp_path):
    """It used to start, then fail in the collector with 'scheduler produced an empty batch'."""
    run = new_run(tmp_path, "p", "rollout.mode=partial", "trainer.iterations=1", "checkpoint.save_every=1")
    before = tree_state(run)
    res = train_cli("--resume", str(run), "rollout.mode=sync", "trainer.iterations=2", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "rollout.mode=sync cannot take over a partial run" in text, text
    assert tree_state(run) == before


@pytest.mark.parametrize("first, then", [("grpo", "remax"), ("remax", "grpo")])
def test_a_switch_to_or_from_remax_is_refused_where_groups_are_held(tmp_path, first, then):
    """A partial grpo run resumed as remax stopped with an IndexError in the collector: its groups in flight had no
    greedy response. Refused before any work, both ways; a sync run (nothing held) switches."""
    run = new_run(tmp_path, "p", "rollout.mode=partial", f"advantage.estimator={first}", "trainer.iterations=1",
                  "checkpoint.save_every=1")
    before = tree_state(run)
    res = train_cli("--resume", str(run), f"advantage.estimator={then}", "trainer.iterations=2", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"advantage.estimator cannot change to or from remax on resume ({first} -> {then})" \
        in text, text
    assert tree_state(run) == before
    sync = new_run(tmp_path, "s", f"advantage.estimator={first}", "trainer.iterations=1", "checkpoint.save_every=1")
    res = train_cli("--resume", str(sync), f"advantage.estimator={then}", "trainer.iterations=2", "--no-progress")
    assert res.exit_code == 0, res.output


def test_a_change_of_the_reward_is_refused_where_scored_groups_are_held(tmp_path):
    """rollout.filter_groups scores each group as it finishes, and with staleness.lag > 0 the checkpoint holds
    batches of them: a resume under another reward (GDPO's aggregation, other weights) would train their old
    scores beside new ones. Refused before any work; a partial run without a lag holds no scores (its groups are
    scored again), so it switches."""
    run = new_run(tmp_path, "lag", "staleness.lag=1", "rollout.filter_groups=true", "trainer.iterations=1",
                  "checkpoint.save_every=1")
    before = tree_state(run)
    res = train_cli("--resume", str(run), "reward.aggregation=normalize_then_sum", "reward.extra=[boxed_format]",
                    "trainer.iterations=2", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "reward.extra, reward.aggregation cannot change on resume" in text, text
    assert tree_state(run) == before
    partial = new_run(tmp_path, "p", "rollout.mode=partial", "rollout.filter_groups=true", "trainer.iterations=1",
                      "checkpoint.save_every=1")
    res = train_cli("--resume", str(partial), "reward.aggregation=normalize_then_sum", "trainer.iterations=2",
                    "--no-progress")
    assert res.exit_code == 0, res.output


# Another process that holds a folder's lock as `kv4rl train` does: flock on the folder's own descriptor.
HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(600)")
PROBE = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
         "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
         "except BlockingIOError:\n    print('busy')")


@pytest.fixture
def hold():
    """`hold(folder)` locks `folder` from another process until the test ends; returns its pid."""
    held = []

    def start(folder):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
        held.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc.pid

    yield start
    for proc in held:
        proc.kill()
        proc.wait()


def _probe(folder) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("how", ["resume", "overwrite", "new run"])
def test_train_into_a_folder_another_process_writes_refuses_before_any_work_and_names_its_pid(run, hold, how):
    pid = hold(run)
    before = tree_state(run.parent)
    if how == "resume":
        res = train_cli("--resume", str(run), "trainer.iterations=4", "--no-progress")
    else:
        res = train_cli(f"out_dir={run.parent}", "name=run", *SMALL, *(["--overwrite"] if how == "overwrite" else []))
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"{run} is in use: another process (pid {pid})" in text and "Traceback" not in text
    assert tree_state(run.parent) == before


def test_the_writing_process_holds_the_folder_until_it_closes(tmp_path):
    cfg = load_config(overrides=[f"out_dir={tmp_path}", "name=run", "device=cpu"])
    folder = RunFolder(cfg, None, None, overwrite=False)
    folder.write({"iteration": 0}, [])
    assert _probe(tmp_path / "run") == "busy"
    folder.close()
    assert _probe(tmp_path / "run") == "free"


def test_a_resume_that_another_process_overtook_changes_nothing_at_its_first_write(run, hold):
    """Both passed the check at start; the other took the lock first. Unguarded, this resume from iter_1
    would set the other's iter_2 aside as damaged and cut metrics.jsonl back to its first row."""
    cfg = config_for_resume(run, [])
    folder = RunFolder(cfg, "someone", 1, overwrite=False)
    hold(run)
    before = tree_state(run)
    with pytest.raises(FolderInUse, match="is in use"):
        folder.write({"iteration": 1}, [])
    folder.close()
    assert tree_state(run) == before


def test_checks_of_a_folder_do_not_exclude_each_other_but_a_writer_excludes_them(tmp_path):
    """All ranks of a torchrun job check the run folder at once at start: their checks must not collide."""
    checks = [lock_folder(tmp_path, shared=True) for _ in range(2)]
    assert None not in checks
    with pytest.raises(FolderInUse):
        lock_folder(tmp_path)
    for fd in checks:
        unlock_folder(fd)
    writer = lock_folder(tmp_path)
    with pytest.raises(FolderInUse):
        lock_folder(tmp_path, shared=True)
    unlock_folder(writer)


def test_resume_refuses_a_training_stream_that_changed(tmp_path):
    """The dataset file edited between a run and its resume (or another seed or data.shuffle) was taken
    silently: the run's place in the stream then pointed at other problems, and 13 draws of one epoch held 4
    problems twice and 5 never. Reference: the rows written by hand, and the unchanged resume, which works."""
    data = tmp_path / "train.jsonl"
    rows = [{"id": f"p{i}", "problem": f"{i}+{i + 1}", "answer": str(2 * i + 1)} for i in range(7)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"data.train={data}", "data.prompt_template={problem}=", "reward.name=exact",
              "rollout.max_new_tokens=8", "checkpoint.save_every=1"]
    run = new_run(tmp_path, "d", "trainer.iterations=2", *common)
    before = tree_state(run)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"id": "p7", "problem": "7+8", "answer": "15"}]))
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "the training stream differs from the checkpoint's (rows 7 -> 8)" in text, text
    rows[3]["answer"] = "8"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 2 and "(the problems' ids, text or answers; a row without an id is named <file name>:<line>" \
        in " ".join(res.output.split()), res.output
    rows[3]["answer"] = "7"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = train_cli("--resume", str(run), "trainer.iterations=3", "seed=5", "--no-progress")
    assert res.exit_code == 2 and "(seed 0 -> 5)" in " ".join(res.output.split()), res.output
    assert tree_state(run) == before
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output


def test_the_start_over_command_of_a_torchrun_job_is_a_torchrun_command(tmp_path, monkeypatch):
    """A rank of `torchrun --nproc-per-node 2` told its folder has no checkpoint: the command it suggests
    starts the same number of processes."""
    from kv4rl.config import load_config
    from kv4rl.distributed import train_launch
    from kv4rl.run_setup import find_restore

    assert train_launch(1) == ["kv4rl", "train"]
    assert train_launch(4) == ["torchrun", "--nproc-per-node", "4", "-m", "kv4rl.cli", "train"]
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=empty"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunFolderError, match=r"run `torchrun --nproc-per-node 2 -m kv4rl\.cli train -c "):
        find_restore(cfg)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RunFolderError, match=r"run `kv4rl train -c "):
        find_restore(cfg)


def test_a_checkpoint_without_its_stream_record_still_refuses_another_seed_or_shuffle(tmp_path):
    """Checkpoints written before the training stream was recorded (before 2026-12-05) skipped the check,
    so a resume with another seed or data.shuffle went through and wrote the new seed into config.yaml,
    losing the run's own. The run's config.yaml holds what the stream was: the same refusal, nothing
    touched; an unchanged resume of such a checkpoint works."""
    run = new_run(tmp_path, "old", "trainer.iterations=2", "checkpoint.save_every=1")
    for state_file in run.glob("checkpoints/iter_*/trainer_state.pt"):
        state = torch.load(state_file, weights_only=False)
        del state["data_stream"]
        torch.save(state, state_file)
    before = tree_state(run)
    for change, shown in (("seed=7", "(seed 0 -> 7)"), ("data.shuffle=false", "(shuffle True -> False)")):
        res = train_cli("--resume", str(run), "trainer.iterations=3", change, "--no-progress")
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and f"the training stream differs from the checkpoint's {shown}" in text, text
        assert tree_state(run) == before
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]


def test_a_saved_config_that_a_later_version_refuses_still_resumes(run):
    """A resume validated the saved config.yaml on its own, before placing it in the folder: a run an earlier
    version trained with `out_dir=''` (into the working folder) refused to resume."""
    saved = run / "config.yaml"
    saved.write_text(yaml.safe_dump({**yaml.safe_load(saved.read_text()), "out_dir": ""}, sort_keys=False))
    res = train_cli("--resume", str(run), "trainer.iterations=3", "--no-progress")
    assert res.exit_code == 0, res.output
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert yaml.safe_load(saved.read_text())["out_dir"] == str(run.parent)


def test_a_resume_warns_of_its_own_run_length_not_the_saved_one(tmp_path, caplog):
    """The lag warning came from the saved config.yaml's trainer.iterations, not the resume's."""
    run = new_run(tmp_path, "lagged", "trainer.iterations=1", "staleness.lag=2", "checkpoint.save_every=1")
    assert [m for m in caplog.messages if "staleness.lag=2 collects 2 batches" in m]  # the run of 1 iteration
    caplog.clear()
    with caplog.at_level("WARNING"):
        res = train_cli("--resume", str(run), "trainer.iterations=4", "--no-progress")
    assert res.exit_code == 0, res.output
    assert not [m for m in caplog.messages if "staleness.lag" in m]


def test_a_resume_names_every_setting_its_overrides_change(run, caplog):
    """config.yaml takes a resume's overrides, so the rows before it ran settings nothing in the folder
    recorded any more: one warning names each change (training longer aside)."""
    from kv4rl.run_folder import config_for_resume

    saved = yaml.safe_load((run / "config.yaml").read_text())
    with caplog.at_level("WARNING"):
        config_for_resume(run, ["trainer.iterations=9"])
    assert not [m for m in caplog.messages if "settings changed" in m]
    with caplog.at_level("WARNING"):
        config_for_resume(run, ["trainer.iterations=9", "trainer.lr=0.5", "data.prompt_template=Q {problem}",
                                "engine.kv.format=int4"])
    said = [m for m in caplog.messages if "settings changed" in m]
    assert len(said) == 1, caplog.messages
    assert f"trainer.lr: {saved['trainer']['lr']!r} -> 0.5" in said[0]
    assert f"data.prompt_template: {saved['data']['prompt_template']!r} -> 'Q {{problem}}'" in said[0]
    assert f"engine.kv.format: {saved['engine']['kv']['format']!r} -> 'int4'" in said[0]
    assert "trainer.iterations" not in said[0] and "sampled with" not in said[0]  # sync, no lag: nothing held
    # a lagged run's checkpoint holds batches sampled ahead: they keep the old sampling settings, and the
    # learner would score them at a new temperature (mismatch_k3 0.44 against 0.007 uninterrupted, helper)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["staleness"]["lag"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    caplog.clear()
    with caplog.at_level("WARNING"):
        config_for_resume(run, ["trainer.iterations=9", "rollout.top_p=0.9"])
    (said,) = [m for m in caplog.messages if "settings changed" in m]
    assert said.endswith("keep the rollout settings and prompts they were sampled with)")
    with pytest.raises(ConfigError, match=r"rollout.temperature cannot change on resume \(1.0 -> 0.5\) of a run "
                                          r"with staleness.lag > 0 or partial rollout"):
        config_for_resume(run, ["trainer.iterations=9", "rollout.temperature=0.5"])
    caplog.clear()  # an override the validation refuses: its error alone, no warning of what it would change
    with caplog.at_level("WARNING"), pytest.raises(ConfigError, match="reward.aggregation"):
        config_for_resume(run, ["reward.aggregation=normalize_then_sum", "reward.scale=2"])
    assert not [m for m in caplog.messages if "settings changed" in m], caplog.messages
