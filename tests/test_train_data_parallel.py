"""`kv4rl train` under torchrun on the CPU (gloo, two processes): the colocated data-parallel layout.

Each rank runs an engine replica on its share of every learner batch's prompt groups and an FSDP2
shard of the learner; rank 0 writes the run. Checked: every group of the stream is delivered exactly
once (sync and partial rollout), the run resumes under torchrun with the same number of ranks from
its checkpoint (HF folder plus one DCP optimizer shard per rank) and continues exactly as an
uninterrupted run, a resume with another number of ranks is refused by name before any work, and
one rank failing ends the whole job with that rank's error instead of a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kv4rl.cli import app

pytestmark = pytest.mark.slow
SMALL = ["device=cpu", "rollout.quota_groups=4", "rollout.group_size=2", "rollout.max_slots=4",
         "checkpoint.save_every=2", "--no-progress"]
EVAL = ["eval.every=3", "data.eval_size=5"]


def start_torchrun(cwd, *args: str, ranks: int = 2, pythonpath: str | None = None) -> subprocess.Popen:
    """`torchrun ... kv4rl.cli train ARGS` started in the background; `finish` waits for it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                             "--standalone", "-m", "kv4rl.cli", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait for a job of `start_torchrun` (at most 600 s, as `subprocess.run` waited before)."""
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def torchrun(cwd, *args: str, ranks: int = 2, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    return finish(start_torchrun(cwd, *args, ranks=ranks, pythonpath=pythonpath))


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_deliver_every_group_once_and_resume_as_if_uninterrupted(tmp_path, monkeypatch):
    # The uninterrupted reference runs beside the stopped-and-resumed run instead of after it: the two
    # jobs share nothing but the parent folder, and each is deterministic, so only the wall time changes
    # (a job is mostly process start-up and imports, which leave one of the two cores idle part of the time).
    straight_job = start_torchrun(tmp_path, "name=straight", "trainer.iterations=5", *EVAL, *SMALL)
    try:
        done = torchrun(tmp_path, "name=dp", "trainer.iterations=3", *EVAL, *SMALL)
        assert done.returncode == 0, done.stderr[-3000:]
        run = tmp_path / "runs" / "dp"
        assert [r["groups"] for r in rows(run)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert all(r["num_tokens"] == sum(r["staleness_hist"].values()) for r in rows(run))
        assert (run / "checkpoints" / "iter_000003" / "model.safetensors").is_file()
        assert (run / "checkpoints" / "iter_000003" / "optimizer" / ".metadata").is_file()
        # the engines share the 5 eval problems out (3 + 2); rank 0 reports all 5 once
        assert rows(run)[2]["eval/num_problems"] == 5 and "eval/mean@1" in rows(run)[2]

        resumed = torchrun(tmp_path, "--resume", "runs/dp", "trainer.iterations=5", "--no-progress")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["groups"] for r in rows(run)][3:] == [[12, 13, 14, 15], [16, 17, 18, 19]]
    finally:  # waited for also when an assertion above fails: no job is left running
        straight = finish(straight_job)
    assert straight.returncode == 0, straight.stderr[-3000:]
    ref = tmp_path / "runs" / "straight"
    for key in ("loss", "grad_norm", "reward_mean", "num_tokens"):
        assert [r[key] for r in rows(run)] == [r[key] for r in rows(ref)], key
    a, b = (load_file(r / "checkpoints" / "iter_000005" / "model.safetensors") for r in (run, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    monkeypatch.chdir(tmp_path)
    one = CliRunner().invoke(app, ["train", "--resume", "runs/dp", "trainer.iterations=6", "--no-progress"])
    assert one.exit_code != 0
    assert "torchrun --nproc-per-node 2" in one.output
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


FAILING_HOOK = (
    "import os\n"
    "if os.environ.get('LOCAL_RANK') == '1':\n"
    "    import kv4rl.loop as loop\n"
    "    run = loop.run_iteration\n"
    "    def failing(s, it):\n"
    "        if it == 1:\n"
    "            raise RuntimeError('rank 1 fails on purpose in iteration 1')\n"
    "        return run(s, it)\n"
    "    loop.run_iteration = failing\n")


@pytest.fixture(scope="module")
def partial_and_failing(tmp_path_factory):
    """The jobs of the next two tests, started together, each in its own folder: two independent
    torchrun jobs that are mostly process start-up, so side by side on 2 cores they end sooner than one
    after the other. Each test waits for its own job and checks only that job's output and folder."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("partial", "fail")}
    hook = folders["fail"] / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_HOOK)
    jobs = {"partial": start_torchrun(folders["partial"], "name=partial", "trainer.iterations=4", "rollout.mode=partial",
                                      "staleness.max_versions=2", "rollout.carry=recompute", *SMALL),
            "fail": start_torchrun(folders["fail"], "name=fail", "trainer.iterations=3", *SMALL, pythonpath=str(hook))}
    done = {}

    def result(name: str) -> tuple:
        if name not in done:
            done[name] = folders[name], finish(jobs[name])
        return done[name]

    yield result
    for name in jobs:  # waited for also when a test did not get to it: no job is left running
        result(name)


def test_partial_rollout_over_two_ranks_never_loses_or_repeats_a_group(partial_and_failing):
    folder, done = partial_and_failing("partial")
    assert done.returncode == 0, done.stderr[-3000:]
    delivered = [g for r in rows(folder / "runs" / "partial") for g in r["groups"]]
    assert len(delivered) == 16 and len(set(delivered)) == 16
    # each rank draws every second group of the stream: rank 0 even, rank 1 odd, 2 of each per batch
    for r in rows(folder / "runs" / "partial"):
        assert sorted(g % 2 for g in r["groups"]) == [0, 0, 1, 1]


def test_one_failing_rank_ends_the_job_with_its_error(partial_and_failing):
    """Rank 1 raises in iteration 1 while rank 0 waits in a collective: torchrun ends the whole job,
    non-zero, with rank 1's error (no hang)."""
    folder, failed = partial_and_failing("fail")
    assert failed.returncode != 0
    assert "rank 1 fails on purpose in iteration 1" in failed.stderr + failed.stdout
    assert [r["iteration"] for r in rows(folder / "runs" / "fail")] == [0]


RANK0_WRITE_FAILS_HOOK = (
    "import errno, os\n"
    "if os.environ.get('LOCAL_RANK') == '0':\n"
    "    import kv4rl.run_folder as run_folder\n"
    "    def full(self, row, trace):\n"
    "        raise OSError(errno.ENOSPC, 'No space left on device', str(self.path / 'metrics.jsonl'))\n"
    "    run_folder.RunFolder.write = full\n")


def test_the_ranks_a_failing_rank_leaves_behind_say_so_in_one_line(tmp_path):
    """Rank 0 cannot write metrics.jsonl (outside a checkpoint save) while rank 1 goes on to the next
    collective: rank 0 names the file, rank 1 says in one line that rank 0 stopped, not with gloo's
    "Connection closed by peer" traceback."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RANK0_WRITE_FAILS_HOOK)
    done = torchrun(tmp_path, "name=full", "trainer.iterations=2", *SMALL, pythonpath=str(hook))
    assert done.returncode != 0
    err = done.stderr
    assert "error: runs/full/metrics.jsonl: No space left on device" in err, err[-3000:]
    assert "error: rank 0 stopped (see its error); this rank stops too" in err, err[-3000:]
    assert err.count("error:") == 2 and "RuntimeError" not in err and "Connection closed" not in err, err[-3000:]


def test_two_tensor_parallel_engines_of_two_ranks_sample_what_one_process_samples(tmp_path, monkeypatch):
    """DP2 x TP2 (four ranks, paper B's layout): every group once per batch, and the first batch's
    responses (token counts, rewards) equal a single-process run's: sampling is seeded per request and
    the sharded engines compute the unsharded logits to float32 rounding. REINFORCE++'s advantages, whitened over
    the whole batch's tokens, read every rank's rewards and token counts: each rank's own gave other advantages
    (GRPO's `advantage.std_scope=batch` reads the same gathered rewards, `needs_whole_batch`)."""
    from kv4rl.config import load_config
    from kv4rl.loop import train

    done = torchrun(tmp_path, "name=dptp", "trainer.iterations=2", "engine.tensor_parallel=2",
                    "advantage.estimator=reinforce_plus_plus_baseline", "seed=3", *SMALL, ranks=4)
    assert done.returncode == 0, done.stderr[-3000:]
    four = rows(tmp_path / "runs" / "dptp")
    assert [r["groups"] for r in four] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.chdir(tmp_path)
    train(load_config(None, ["name=one", "trainer.iterations=1", "advantage.estimator=reinforce_plus_plus_baseline",
                             "seed=3", *SMALL[:-1]]),
          show_progress=False)
    one = rows(tmp_path / "runs" / "one")[0]
    assert four[0]["num_tokens"] == one["num_tokens"]
    assert four[0]["reward_mean"] == pytest.approx(one["reward_mean"], abs=1e-9)
    assert four[0]["response_len_mean"] == pytest.approx(one["response_len_mean"], abs=1e-9)
    assert one["adv_std"] > 0  # seed 3: three groups of four differ within (the rewards of seed 0 were all 0)
    for key in ("adv_std", "adv_absmax"):
        assert four[0][key] == pytest.approx(one[key], rel=1e-9), key
    # each engine's steps once (its first rank's), at the whole engine's KV bytes: both TP ranks wrote every
    # step, each at its shard's half of the bytes
    traced = [json.loads(line) for line in (tmp_path / "runs" / "dptp" / "rollout_trace.jsonl").read_text().splitlines()]
    single = [json.loads(line) for line in (tmp_path / "runs" / "one" / "rollout_trace.jsonl").read_text().splitlines()]
    assert {t["rank"] for t in traced} == {0, 2}
    per_token = single[0]["kv_bytes"] / (single[0]["context_mean"] * single[0]["batch_size"])
    for t in single + traced:
        assert t["kv_bytes"] == pytest.approx(t["context_mean"] * t["batch_size"] * per_token, rel=1e-9), t


def test_reinforce_pps_token_returns_are_whitened_over_every_ranks_tokens(tmp_path, monkeypatch):
    """REINFORCE++ with a KL in the reward under torchrun DP2: each token's return is whitened with the sums of both
    ranks' tokens, so the first iteration's advantage statistics (over tokens, the same row on each rank) and
    penalties equal one process's; whitening a rank's own tokens gives others. An adaptive β moves by every rank's
    responses: the third iteration's β is the second's moved by the second's mean KL over all 8 (the row's, which
    averages the ranks' equal shares; the target near it, from one process's run, so the step is not clipped and a
    rank's own 4 responses would give another)."""
    from kv4rl.config import load_config
    from kv4rl.loop import train
    from tests.test_kl_control import _verl_step

    common = ["advantage.estimator=reinforce_plus_plus", "advantage.kl_reward_coef=0.5",
              "advantage.kl_reward_type=k3", "seed=3"]
    monkeypatch.chdir(tmp_path)
    train(load_config(None, ["name=one", "trainer.iterations=2", *common, *SMALL[:-1]]), show_progress=False)
    one, one_next = rows(tmp_path / "runs" / "one")
    target = 1.05 * one_next["kl_reward/token_mean"]
    adaptive = ["advantage.kl_reward_control=adaptive", f"advantage.kl_reward_target={target!r}",
                "advantage.kl_reward_horizon=2"]
    done = torchrun(tmp_path, "name=dp", "trainer.iterations=3", *common, *adaptive, *SMALL, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    two, second, third = rows(tmp_path / "runs" / "dp")
    assert two["num_tokens"] == one["num_tokens"] and one["adv_std"] > 0
    for key in ("reward_mean", "kl_reward/penalty_mean", "adv_mean", "adv_std", "adv_absmax"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert abs(second["kl_reward/token_mean"] / target - 1) < 0.2
    assert third["kl_reward/coef"] == pytest.approx(
        _verl_step(second["kl_reward/coef"], second["kl_reward/token_mean"], target, 2, 8), rel=1e-9)


def test_whitened_advantages_and_normalised_weights_read_every_ranks_tokens(tmp_path, monkeypatch):
    """advantage.whiten under torchrun DP2: each rank whitens its responses with both ranks' token sums, so the
    advantages (their mean, std and largest over the batch's responses) equal one process's; a rank's own tokens
    alone would give others (a wrong mean, and a std of about 1 on each rank's share). The same for
    algo.behavior_is_normalize's batch mean weight (INT4 KV, so that μ differs from π_old): one process's factor."""
    from kv4rl.config import load_config
    from kv4rl.loop import train

    common = ["advantage.whiten=true", "seed=3", "trainer.iterations=1", "engine.kv.format=int4",
              "engine.kv.group_size=32", "algo.old_logprob=recompute", "algo.behavior_is=token_truncate",
              "algo.behavior_is_normalize=true"]
    monkeypatch.chdir(tmp_path)
    train(load_config(None, ["name=one", *common, *SMALL[:-1]]), show_progress=False)
    (one,) = rows(tmp_path / "runs" / "one")
    done = torchrun(tmp_path, "name=dp", *common, *SMALL, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    (two,) = rows(tmp_path / "runs" / "dp")
    assert two["num_tokens"] == one["num_tokens"] and one["adv_std"] > 0
    for key in ("reward_mean", "adv_mean", "adv_std", "adv_absmax"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert abs(one["behavior_is_norm_factor"] - 1) > 1e-4
    assert two["behavior_is_norm_factor"] == pytest.approx(one["behavior_is_norm_factor"], rel=1e-6)
    for key in ("loss", "grad_norm"):  # each rank's own mean weight would move both (the logged factor, a
        assert two[key] == pytest.approx(one[key], rel=1e-5), key  # token-weighted mean of the ranks', would not)


def test_a_lagging_tensor_parallel_engine_resumes_with_each_ranks_own_weights(tmp_path):
    """refresh_every=2 leaves the engine a version behind at the checkpoint of iteration 3, so the checkpoint
    holds its weights: rank 0's slice alone was saved and loaded on both ranks, and the resumed run sampled
    from rank 0's halves on rank 1 (iteration 3: 37 tokens, reward 0 against 29 and 0.25). Reference: the
    uninterrupted run, beside it."""
    tp = ["engine.tensor_parallel=2", "staleness.refresh_every=2", "checkpoint.save_every=3", *SMALL[:-2],
          "--no-progress"]
    straight_job = start_torchrun(tmp_path, "name=straight", "trainer.iterations=4", *tp)
    try:
        first = torchrun(tmp_path, "name=tp", "trainer.iterations=3", *tp)
        assert first.returncode == 0, first.stderr[-3000:]
        saved = tmp_path / "runs" / "tp" / "checkpoints" / "iter_000003"
        assert sorted(p.name for p in saved.glob("engine_weights.*")) == ["engine_weights.rank0.pt",
                                                                          "engine_weights.rank1.pt"]
        resumed = torchrun(tmp_path, "--resume", "runs/tp", "trainer.iterations=4", "--no-progress")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        straight = finish(straight_job)
    assert straight.returncode == 0, straight.stderr[-3000:]
    got, want = rows(tmp_path / "runs" / "tp"), rows(tmp_path / "runs" / "straight")
    assert [r["iteration"] for r in got] == [0, 1, 2, 3]
    for key in ("num_tokens", "reward_mean", "response_len_mean"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)


def test_an_error_every_rank_meets_after_joining_is_printed_once(tmp_path):
    """A bad data file (read once the ranks have joined) printed the same error line once per rank."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    res = torchrun(tmp_path, f"out_dir={tmp_path / 'runs'}", f"data.train={bad}", *SMALL)
    said = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert said == [f"error: {bad}:2: missing field 'answer'"], res.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of `rank` among the processes torchrun `parent` started (Linux /proc), or None yet."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    for pid in children.read_text().split() if children.exists() else []:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank's process through Linux /proc")
def test_a_rank_killed_without_a_word_leaves_its_peer_one_error_line(tmp_path):
    """SIGKILL (the out-of-memory killer) to one rank: its peer printed the collective's ~290-line traceback,
    naming neither the rank nor the cause. Reference: the resume hint's folder holds the checkpoints."""
    import signal
    import time

    run = tmp_path / "runs" / "killed"
    proc = start_torchrun(tmp_path, f"out_dir={tmp_path / 'runs'}", "name=killed", "trainer.iterations=1000", *SMALL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "latest").is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pid = _rank_pid(proc.pid, 1)
    assert pid is not None and proc.poll() is None
    os.kill(pid, signal.SIGKILL)
    res = finish(proc)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: another rank of this job went down without a word (killed? the out-of-memory killer?); this rank "
        "stops too; the checkpoints in"), res.stderr[-3000:]
    assert "Connection reset by peer" not in res.stderr and "Connection closed by peer" not in res.stderr


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks' processes through Linux /proc")
def test_ranks_whose_torchrun_is_killed_end_instead_of_training_on(tmp_path):
    """SIGKILL to torchrun itself (it cannot forward that one): its ranks trained on, orphaned, holding the run
    folder. Each rank now asks the kernel for SIGTERM when torchrun dies: they end (not always with a checkpoint
    of the iteration they were in: the job's store went with torchrun), and the last checkpoint saved is whole."""
    import signal
    import time

    run = tmp_path / "runs" / "orphans"
    proc = start_torchrun(tmp_path, f"out_dir={tmp_path / 'runs'}", "name=orphans", "trainer.iterations=1000",
                          *SMALL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "latest").is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pids = [_rank_pid(proc.pid, rank) for rank in (0, 1)]
    assert None not in pids and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 180
    while any(Path(f"/proc/{pid}").exists() and b"zombie" not in _status(pid) for pid in pids):
        assert time.monotonic() < deadline, "the ranks outlived their killed torchrun"
        time.sleep(0.2)
    assert len(rows(run)) < 20  # far from the 1000 iterations asked for
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "model.safetensors").is_file() and (latest / "trainer_state.pt").is_file()


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"
