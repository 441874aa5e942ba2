"""`kv4rl bench iteration` on CPU with the test shape: the loop's own phases per arm, JSON, CSV and figure."""

import csv
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from kv4rl.bench.iteration import Arm, odd_token_reward, parse_arms
from kv4rl.cli import app

runner = CliRunner()
TINY = ["--shape", "qwen3-tiny", "--device", "cpu", "--quota-groups", "2", "--group-size", "2", "--max-slots", "3",
        "--prompt-len", "4", "--median-len", "6", "--max-len", "24", "--iterations", "2"]


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_arms_phases_json_csv_and_figure(tmp_path, one_thread):
    out, png = tmp_path / "it.json", tmp_path / "figs" / "it.png"
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync,kv4+partial@5,fp8w+kv4+partial",
                              "--max-tokens-per-micro-batch", "64", "--json", str(out), "--png", str(png)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["complete"] is True  # rewritten with complete=false after each arm, so a time limit keeps what ran
    assert [line.split(":")[0].strip() for line in res.output.splitlines() if "s per iteration" in line] == [
        "1/3 bf16+sync", "2/3 kv4+partial@5", "3/3 fp8w+kv4+partial"]
    out_lines = [line.strip() for line in res.output.splitlines()]
    # each arm's builds are progress lines of their own (minutes each at the 8B shape with offload)
    assert [line for line in out_lines if line.startswith("bf16+sync: ") and "engine:" not in line] == [
        "bf16+sync: building the learner", "bf16+sync: building the engine", "bf16+sync: warm-up iteration",
        "bf16+sync: iteration 1/2", "bf16+sync: iteration 2/2"]
    assert r["max_tokens_per_micro_batch"] == 64 and r["attention"] == "auto"  # the learner packs, as train does
    assert r["fuse_elementwise"] is False and r["offload"] is False and r["offload_optimizer"] is False  # CPU: off
    assert r["compile_layers"] is False
    assert r["phases"] == ["rollout", "reward", "update", "sync", "sleep_wake", "other"]
    rows = r["results"]
    assert [(x["arm"], x["kv_format"], x["mode"], x["weights"], x["slots"]) for x in rows] == [
        ("bf16+sync", "bf16", "sync", "float32", 3), ("kv4+partial@5", "kv4", "partial", "float32", 5),
        ("fp8w+kv4+partial", "kv4", "partial", "fp8", 3)]  # @5: that arm's own decode slots, else --max-slots
    assert [x["engine_summary"].count(f"for up to {x['slots']} sequences") for x in rows] == [1, 1, 1]
    for x in rows:
        phases = x["phases"]
        # the loop's timers: each phase measured, `other` what the total holds beyond them
        assert math.isclose(sum(phases.values()), x["seconds_per_iteration"], rel_tol=1e-9)
        assert math.isclose(sum(x["iteration_seconds"]) / 2, x["seconds_per_iteration"], rel_tol=1e-9)
        assert all(phases[p] > 0 for p in ("rollout", "reward", "update", "sync", "sleep_wake"))
        assert -1e-6 < phases["other"] < 0.1 * x["seconds_per_iteration"]
        assert x["speedup_vs_first"] == pytest.approx(rows[0]["seconds_per_iteration"] / x["seconds_per_iteration"])
        assert x["peak_memory_bytes"] is None  # CPU
        assert "KV pool" in x["engine_summary"] and "0 asleep" in x["engine_summary"]
        assert x["tokens_per_iteration"] >= 2 * 2  # every response has at least one token
        assert x["trained_tokens_per_s"] == pytest.approx(x["tokens_per_iteration"] / x["seconds_per_iteration"])
        assert x["trained_tokens_per_s_vs_first"] == pytest.approx(
            x["trained_tokens_per_s"] / (rows[0]["tokens_per_iteration"] / rows[0]["seconds_per_iteration"]))
    assert rows[0]["speedup_vs_first"] == 1.0 and rows[0]["trained_tokens_per_s_vs_first"] == 1.0
    assert "fp8 weights" in rows[2]["engine_summary"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    with png.with_suffix(".csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(t["run"], t["phase"]) for t in table] == [(x["arm"], p) for x in rows for p in r["phases"]]
    for t in table:
        arm = next(x for x in rows if x["arm"] == t["run"])
        assert float(t["mean_s"]) == pytest.approx(arm["phases"][t["phase"]])


def test_without_sleep_the_sleep_phase_is_zero(tmp_path, one_thread):
    out = tmp_path / "it.json"
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+partial", "--no-sleep", "--fuse-elementwise",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["fuse_elementwise"] is True  # the learner of every arm runs trainer.fuse_elementwise
    (x,) = r["results"]
    assert x["phases"]["sleep_wake"] == 0.0 and "asleep" not in x["engine_summary"]
    assert (x["sleeps"], x["carry"]) == (False, "recompute")


def test_awake_arm_keeps_carried_kv_where_a_sleeping_arm_recomputes_it(tmp_path, one_thread):
    """Same workload, one arm sleeping through the update (carry: recompute), one awake (keep_kv): only the
    sleeping one re-prefills the responses it carries, and only it spends time in sleep/wake."""
    out = tmp_path / "it.json"
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+partial,bf16+partial+awake",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    asleep, awake = json.loads(out.read_text())["results"]
    assert (asleep["sleeps"], asleep["carry"], awake["sleeps"], awake["carry"]) == (True, "recompute", False, "keep_kv")
    assert asleep["staleness_mean"] > 0 and awake["staleness_mean"] > 0  # both carried responses over updates
    assert asleep["preemptions"] > 0 and awake["preemptions"] == 0
    assert asleep["phases"]["sleep_wake"] > 0 and awake["phases"]["sleep_wake"] == 0.0
    assert "asleep" in asleep["engine_summary"] and "asleep" not in awake["engine_summary"]


def test_parse_arms():
    assert parse_arms("bf16+sync, kv4+partial,fp8w+kv4+partial") == [
        Arm("bf16+sync", "bf16", "sync"), Arm("kv4+partial", "kv4", "partial"),
        Arm("fp8w+kv4+partial", "kv4", "partial", "fp8")]
    assert parse_arms("partial+fp8") == [Arm("partial+fp8", "fp8", "partial")]  # fp8 alone is the KV format
    assert parse_arms("bf16+sync,kv4+partial@256") == [
        Arm("bf16+sync", "bf16", "sync"), Arm("kv4+partial@256", "kv4", "partial", slots=256)]
    for bad in ("kv4+partial@", "kv4+partial@0", "kv4+partial@x", "kv4+partial@-2", "kv4@8+partial"):
        with pytest.raises(ValueError, match="--arms .*(slots after '@'|an arm is)"):
            parse_arms(bad)
    assert parse_arms("kv4+partial+awake@256,awake+bf16+sync") == [
        Arm("kv4+partial+awake@256", "kv4", "partial", slots=256, awake=True),
        Arm("awake+bf16+sync", "bf16", "sync", awake=True)]
    for bad in ("bf16", "sync", "bf16+kv4+sync", "fp8w+sync", "bf16+sync+x", "kv4+partial+awake+awake", "awake"):
        with pytest.raises(ValueError, match="--arms"):
            parse_arms(bad)


def test_reward_is_the_fraction_of_odd_token_ids():
    assert odd_token_reward(["1 2 3 4", "7", ""], ["", "", ""]).scores == [0.5, 1.0, 0.0]


def test_packed_learner_options_are_checked_before_any_work(tmp_path):
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync", "--max-tokens-per-micro-batch", "32",
                              "--attention", "flex", "--json", str(tmp_path / "no.json")])
    assert res.exit_code == 2 and "--attention flex needs a CUDA device" in " ".join(res.output.split())
    assert not (tmp_path / "no.json").exists()
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync", "--max-tokens-per-micro-batch", "0"])
    assert res.exit_code == 2 and "--max-tokens-per-micro-batch must be >= 1" in " ".join(res.output.split())
    # two labels of one arm at the default slots were both timed (a review helper's find)
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync,kv4+sync,bf16+sync@3"])
    assert res.exit_code == 2 and "--arms: bf16+sync, bf16+sync@3 name one arm (--max-slots 3)" in " ".join(
        res.output.split()), res.output


def test_offload_is_refused_on_the_cpu_before_any_work(tmp_path):
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync", "--offload",
                              "--json", str(tmp_path / "no.json")])
    assert res.exit_code != 0 and "--offload moves the learner's parameters" in " ".join(res.output.split())
    assert not (tmp_path / "no.json").exists()


def test_offload_optimizer_is_refused_on_the_cpu_and_with_offload_before_any_work(tmp_path):
    for flags, needle in (([], "--offload-optimizer streams AdamW's moments"),
                          (["--offload"], "--offload-optimizer and --offload cannot be combined")):
        res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync", "--offload-optimizer", *flags,
                                  "--json", str(tmp_path / "no.json")])
        assert res.exit_code != 0 and needle in " ".join(res.output.split()), res.output
    assert not (tmp_path / "no.json").exists()


def test_compile_layers_reaches_the_trainer_of_every_arm():
    from kv4rl.bench.iteration import IterationBench, run_config

    for flag in (False, True):
        bench = IterationBench(arms=tuple(parse_arms("bf16+sync,kv4+partial+awake")), shape="qwen3-tiny",
                               compile_layers=flag, device="cpu")
        assert [run_config(bench, arm).trainer.compile_layers for arm in bench.arms] == [flag, flag]


def test_an_arm_the_device_cannot_hold_ends_with_one_line_after_the_arms_that_ran(tmp_path, one_thread, monkeypatch):
    """On an H100 the awake arm's pool and the learner's update did not fit: the engine's ValueError left the
    command as a traceback. Now: the finished arms' table, one error line naming the arm, exit 2, and the
    JSON keeps the finished arms ("complete": false)."""
    import kv4rl.bench.iteration as iteration

    real = iteration.run_arm

    def second_does_not_fit(cfg, bench, model_dir, progress):
        if cfg.rollout.mode == "partial":
            raise ValueError("engine.gpu_memory_fraction=0.9: no room for the KV pool (as an H100 said)")
        return real(cfg, bench, model_dir, progress)

    monkeypatch.setattr(iteration, "run_arm", second_does_not_fit)
    out = tmp_path / "it.json"
    res = runner.invoke(app, ["bench", "iteration", *TINY, "--arms", "bf16+sync,bf16+partial", "--json", str(out)])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "error: arm bf16+partial: engine.gpu_memory_fraction=0.9: no room" in said
    assert 'holds the arms that finished, "complete": false' in said
    assert "Traceback" not in res.output and "bf16+sync" in res.output.split("error:")[0]
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and [r["arm"] for r in saved["results"]] == ["bf16+sync"]


def test_warmup_iterations_run_untimed_before_the_timed_ones(tmp_path, one_thread, monkeypatch):
    """On a fresh machine one warm-up was too few for a partial arm (its carried responses' prefill shapes
    first come in the second iteration): `--warmup-iterations` runs more, untimed, and the timed ones follow
    them in the run's iteration numbering (staleness counts versions from it)."""
    import kv4rl.loop

    called, real = [], kv4rl.loop.run_iteration

    def counted(s, it):
        called.append(it)
        return real(s, it)

    monkeypatch.setattr(kv4rl.loop, "run_iteration", counted)
    out = tmp_path / "it.json"
    tiny = [a if a != "2" or TINY[i - 1] != "--iterations" else "1" for i, a in enumerate(TINY)]
    res = runner.invoke(app, ["bench", "iteration", *tiny, "--arms", "kv4+partial", "--warmup-iterations", "2",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert called == [0, 1, 2]
    lines = [line.strip() for line in res.output.splitlines() if line.strip().startswith("kv4+partial: ")]
    assert [line for line in lines if "iteration" in line] == [
        "kv4+partial: warm-up iteration 1/2", "kv4+partial: warm-up iteration 2/2", "kv4+partial: iteration 1/1"]
    r = json.loads(out.read_text())
    assert r["warmup_iterations"] == 2 and r["iterations"] == 1 and len(r["results"][0]["iteration_seconds"]) == 1
    res = runner.invoke(app, ["bench", "iteration", *tiny, "--warmup-iterations", "0", "--validate-only"])
    assert res.exit_code != 0 and "--warmup-iterations must be >= 1" in res.output
