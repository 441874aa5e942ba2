"""`kv4rl bench rollout` (formats x modes at one KV budget) and `kv4rl plot rollout-trace`, on CPU."""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kv4rl.bench import rollout
from kv4rl.bench.rollout import PURE_ROW_SNAPSHOTS, add_speedups, summarize
from kv4rl.cli import app
from kv4rl.config import load_config
from kv4rl.engine.llm import Engine
from kv4rl.loop import train

runner = CliRunner()
TOOLS_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "rollout_bench.sh"
# qwen3-tiny: 2 layers x 2 KV heads x head_dim 32, K and V in 2 bytes each -> 512 bytes per token
TINY_BF16_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 2
BUDGET_GIB = 0.00015
TINY = ["--shape", "qwen3-tiny", "--device", "cpu", "--quota-groups", "4", "--group-size", "2", "--max-slots", "8",
        "--prompt-len", "4", "--median-len", "8", "--max-len", "60", "--sigma", "1.2"]


@pytest.fixture
def one_thread():
    """One torch thread: the tiny model's steps are far slower when threads contend for shared cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def no_work(monkeypatch):
    """Building an engine or a model fails the test: validation must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the options were validated")

    monkeypatch.setattr(Engine, "__init__", refuse)
    monkeypatch.setattr(rollout, "decoder_of", refuse)


def test_formats_x_modes_at_one_budget(tmp_path, one_thread):
    out, png = tmp_path / "new" / "r.json", tmp_path / "figs" / "r.png"
    res = runner.invoke(app, ["bench", "rollout", *TINY, "--formats", "bf16,kv4", "--modes", "sync,partial",
                              "--repeats", "2", "--kv-budget-gib", str(BUDGET_GIB), "--json", str(out),
                              "--png", str(png)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    rows = {(x["format"], x["mode"]): x for x in r["results"]}
    assert list(rows) == [("bf16", "sync"), ("bf16", "partial"), ("kv4", "sync"), ("kv4", "partial")]
    ref = rows["bf16", "sync"]
    for x in rows.values():
        a, b = x["rollout_s_repeats"]
        assert x["rollout_s"] == pytest.approx((a + b) / 2) and (x["rollout_s_min"], x["rollout_s_max"]) == (
            min(a, b), max(a, b))
        assert x["speedup_vs_bf16_sync"] == pytest.approx(ref["rollout_s"] / x["rollout_s"])
        assert x["tokens_per_s"] > 0 and x["step_ms"] > 0
        assert x["slot_util"] == pytest.approx(x["mean_active"] / 8) and 0 < x["slot_util"] <= 1
        assert x["kv_peak_bytes"] <= x["pool_bytes"]
        # steps split into pure decode and mixed (a prompt, chunk or recompute in the batch)
        assert x["decode_steps_per_batch"] + x["mixed_steps_per_batch"] == pytest.approx(x["steps_per_batch"])
        assert x["mixed_steps_per_batch"] > 0 and x["decode_steps_per_batch"] > 0
        assert x["step_ms"] == pytest.approx((x["decode_step_ms"] * x["decode_steps_per_batch"] + x["mixed_step_ms"]
                                              * x["mixed_steps_per_batch"]) / x["steps_per_batch"])
        # the host's part of a step: all of it but the wait for the device's tokens (~0 on the CPU)
        for kind in ("decode", "mixed"):
            assert 0 < x[f"{kind}_host_ms"] <= x[f"{kind}_step_ms"]
        # sync: 4 groups a batch, each prompt computed once (followers fork); partial: a group's prompt is
        # computed in the batch that admits it, which may be the one before (the warm-up) its consumer
        assert x["prefill_tokens_per_batch"] >= (4 * 4 if x["mode"] == "sync" else 1)
        assert 4 < x["context_mean"] < 4 + 60
        # the pure decode step it is compared with: the corner's mean batch at its mean context (a CUDA
        # graph replay: not on CPU)
        assert (x["pure_step_batch"], x["pure_step_context"]) == (round(x["mean_active"]), round(x["context_mean"]))
        assert x["pure_step_ms"] is None and x["step_vs_pure"] is None
        assert x["pure_rows_ms"] is None and x["step_vs_pure_rows"] is None
        # the running rows' contexts at a few timed steps: up to 8 slots, each a prompt of 4 plus < 60
        snaps = x["row_context_snapshots"]
        assert 1 <= len(snaps) <= PURE_ROW_SNAPSHOTS
        assert all(1 <= len(c) <= 8 and all(4 <= n <= 4 + 60 for n in c) for c in snaps)
        assert x["steps_ahead_per_batch"] == 0  # async scheduling is off on a CPU unless asked for
        assert x["graph_prefills_per_batch"] is None  # no prefill graphs without the fast prefill on CUDA
    # the same budget: bf16 gets floor(budget / block bytes) blocks of 16; kv4 fits every slot at its
    # longest (8 slots x 4 blocks of 16 for 4 + 60 tokens), so it can never preempt
    assert ref["pool_tokens"] == int(BUDGET_GIB * 2**30) // (16 * TINY_BF16_BYTES_PER_TOKEN) * 16 == 304
    assert ref["pool_bytes"] == 304 * TINY_BF16_BYTES_PER_TOKEN  # bf16 reserves nothing per sequence
    assert rows["kv4", "sync"]["pool_tokens"] == rows["kv4", "partial"]["pool_tokens"] == 8 * 4 * 16
    # partial rollout fills bf16's pool (to the block, before groups were admitted whole: a preemption),
    # not kv4's
    assert rows["bf16", "partial"]["kv_peak_bytes"] >= 0.9 * ref["pool_bytes"]
    assert rows["kv4", "partial"]["kv_peak_bytes"] <= 0.8 * rows["kv4", "partial"]["pool_bytes"]
    assert rows["kv4", "sync"]["preemptions"] == rows["kv4", "partial"]["preemptions"] == 0
    for fmt in ("bf16", "kv4"):  # the same long-tailed lengths: partial keeps its slots fuller
        assert rows[fmt, "partial"]["slot_util"] > rows[fmt, "sync"]["slot_util"]
        assert rows[fmt, "partial"]["steps_per_batch"] < rows[fmt, "sync"]["steps_per_batch"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_format_may_run_its_own_number_of_slots(tmp_path, one_thread):
    """`kv4@12` beside `--max-slots 8`: that corner's engine and collector get 12 decode slots, its budget
    reserves 12 slots' rows, and partial rollout keeps more than 8 responses in flight."""
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", "rollout", *TINY, "--formats", "bf16,kv4@12", "--modes", "partial",
                              "--repeats", "1", "--kv-budget-gib", str(BUDGET_GIB), "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    rows = {x["format"]: x for x in r["results"]}
    assert [(x["format"], x["kv_format"], x["slots"]) for x in r["results"]] == [
        ("bf16", "bf16", 8), ("kv4@12", "kv4", 12)]
    assert "for up to 12 sequences" in r["engine_summaries"]["kv4@12"]
    assert rows["kv4@12"]["mean_active"] > 8 and rows["kv4@12"]["slot_util"] == pytest.approx(
        rows["kv4@12"]["mean_active"] / 12)
    # more pool than kv4 at 8 slots (capped at 8 x 4 blocks of 16), at most 12 slots at their longest, and
    # the budget holds the pages plus 12 slots' protected rows
    assert 8 * 4 * 16 < rows["kv4@12"]["pool_tokens"] <= 12 * 4 * 16
    assert rows["kv4@12"]["pool_bytes"] <= BUDGET_GIB * 2**30


def test_each_corner_is_written_as_it_ends(tmp_path, one_thread, monkeypatch):
    """A time limit keeps the corners that ran: the JSON is rewritten after each, `complete` only after
    the last, and the speedup against bf16 sync appears once that corner is in."""
    import kv4rl.cli_bench

    written = []
    monkeypatch.setattr(kv4rl.cli_bench, "write_json", lambda res, path: written.append(json.loads(json.dumps(res))))
    res = runner.invoke(app, ["bench", "rollout", *TINY, "--formats", "kv4,bf16", "--modes", "partial,sync",
                              "--repeats", "1", "--kv-budget-gib", str(BUDGET_GIB), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert [len(w["results"]) for w in written] == [1, 2, 3, 4, 4]  # one per corner, then the final write
    assert [w["complete"] for w in written] == [False, False, False, True, True]
    assert [(r["format"], r["mode"]) for r in written[-1]["results"]] == [
        ("kv4", "partial"), ("kv4", "sync"), ("bf16", "partial"), ("bf16", "sync")]
    for w in written[:3]:  # bf16 sync, the reference, runs last
        assert all(r["speedup_vs_bf16_sync"] is None for r in w["results"])
        assert [r["rollout_s"] for r in w["results"]] == [r["rollout_s"] for r in written[-1]["results"][:len(w["results"])]]
    assert written[-1]["results"][-1]["speedup_vs_bf16_sync"] == 1.0
    assert "4/4 bf16 sync" in res.output


def test_model_folder_and_one_repeat(tiny_qwen3, tmp_path, one_thread):
    path, _ = tiny_qwen3
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", "rollout", "--model", str(path), "--device", "cpu", "--formats", "bf16",
                              "--repeats", "1", "--batches", "2", "--quota-groups", "4", "--group-size", "2",
                              "--max-slots", "8", "--prompt-len", "4", "--median-len", "4", "--max-len", "30",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["model"] == str(path) and r["batches"] == 2
    for x in r["results"]:
        assert x["rollout_s"] == x["rollout_s_min"] == x["rollout_s_max"] == x["rollout_s_repeats"][0]
        assert x["pool_sizing"] == "max_num_seqs x max_model_len"


def test_summarize_against_hand_computation():
    # sorted 0.1 0.2 0.3 0.4: median (0.2 + 0.3) / 2; quartiles at positions 0.75 and 2.25 of 0..3
    s = summarize([0.4, 0.1, 0.3, 0.2])
    assert s == pytest.approx({"median": 0.25, "min": 0.1, "max": 0.4, "q1": 0.175, "q3": 0.325})
    assert summarize([3.0, 1.0, 2.0]) == pytest.approx({"median": 2.0, "min": 1.0, "max": 3.0, "q1": 1.5, "q3": 2.5})
    assert summarize([5.0]) == {"median": 5.0, "min": 5.0, "max": 5.0, "q1": 5.0, "q3": 5.0}


def _row(fmt, mode, median, low, high):
    return {"format": fmt, "mode": mode, "rollout_s": median, "rollout_s_min": low, "rollout_s_max": high}


def test_speedups_are_ratios_of_medians_with_extreme_range():
    rows = [_row("bf16", "sync", 2.0, 1.5, 3.0), _row("kv4", "partial", 0.5, 0.4, 1.0)]
    add_speedups(rows)
    assert (rows[0]["speedup_vs_bf16_sync"], rows[0]["speedup_min"], rows[0]["speedup_max"]) == (1.0, 1.0, 1.0)
    assert rows[1]["speedup_vs_bf16_sync"] == pytest.approx(4.0)
    assert (rows[1]["speedup_min"], rows[1]["speedup_max"]) == pytest.approx((1.5, 7.5))
    no_reference = [_row("kv4", "sync", 1.0, 1.0, 1.0)]
    add_speedups(no_reference)
    assert no_reference[0]["speedup_vs_bf16_sync"] is None
    own_slots = [_row("bf16@2", "sync", 4.0, 4.0, 4.0), _row("kv4", "sync", 2.0, 2.0, 2.0)]
    add_speedups(own_slots)  # bf16 at its own slots is still the reference (every speedup was None)
    assert [r["speedup_vs_bf16_sync"] for r in own_slots] == [1.0, pytest.approx(2.0)]
    both = [_row("bf16@2", "sync", 4.0, 4.0, 4.0), _row("bf16", "sync", 8.0, 8.0, 8.0)]
    add_speedups(both)  # bf16 at the common slots first
    assert [r["speedup_vs_bf16_sync"] for r in both] == [pytest.approx(2.0), 1.0]


@pytest.mark.parametrize("args, message", [
    (["--formats", "bf16,kv5"], "--formats: unknown kv5"),
    (["--formats", "bf16,bf16"], "'bf16' is given twice"),
    (["--formats", "kv4,bf16,kv4@8"], "kv4, kv4@8 name one format at one number of slots (--max-slots 8)"),
    (["--modes", "sync,async"], "--modes: unknown async"),
    (["--shape", "qwen3-99b"], "unknown model shape 'qwen3-99b'"),
    (["--repeats", "0"], "--repeats and --batches must be >= 1"),
    (["--max-slots", "0"], "--max-slots must be >= 1"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--median-len", "100"], "--median-len 100 exceeds --max-len 60"),
    (["--sigma", "-1"], "--sigma must be >= 0"),
    (["--kv-budget-gib", "0"], "--kv-budget-gib must be > 0"),
    (["--kv-budget-gib", "0.00001"], "--kv-budget-gib 1e-05: bf16 needs"),
    (["--max-len", "600"], "exceeds the model's context of 512"),
    (["--model", "/nonexistent"], "pass either --model or --shape"),
    (["engine.kv.group_size=64", "--formats", "kv4"], "engine.kv.group_size=64 does not divide"),
    (["engine.max_model_len=99"], "engine.max_model_len is set by --prompt-len + --max-len"),
    (["engine.kv.format=fp8"], "engine.kv.format is set by --formats"),
    (["--formats", ""], "--formats is empty"),
    (["--formats", "bf16,kv4@0"], "--formats kv4@0: the slots after '@' must be a whole number >= 1"),
    (["--formats", "kv4@x"], "--formats kv4@x: the slots after '@'"),
    (["--formats", "kv5@16"], "--formats: unknown kv5@16"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_bad_options_fail_before_any_work(args, message, tmp_path, no_work):
    out = tmp_path / "new" / "r.json"
    res = runner.invoke(app, ["bench", "rollout", *TINY, *args, "--json", str(out)])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert not out.parent.exists()  # validated before the output folder is made


def test_unwritable_output_path_fails_before_any_work(tmp_path, no_work):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = runner.invoke(app, ["bench", "rollout", *TINY, "--json", str(blocker / "r.json")])
    assert res.exit_code == 2 and "--json" in res.output
    res = runner.invoke(app, ["bench", "rollout", *TINY, "--png", str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in " ".join(res.output.split())


def test_steps_run_ahead_are_counted(tmp_path, one_thread):
    """With async scheduling asked for on the CPU, partial rollout launches steps ahead, also while a
    group waits for room for all its siblings (32 slots: runs of up to 4)."""
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", "rollout", "--shape", "qwen3-tiny", "--device", "cpu", "--formats", "bf16",
                              "--modes", "partial", "--quota-groups", "8", "--group-size", "4", "--max-slots", "32",
                              "--prompt-len", "4", "--median-len", "8", "--max-len", "40", "--repeats", "1",
                              "engine.async_scheduling=true", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["results"]
    assert 0 < row["steps_ahead_per_batch"] <= row["decode_steps_per_batch"]


def _script_commands() -> dict[str, list[str]]:
    """The `bench rollout` argument lists of the GPU script, by function name."""
    text = TOOLS_SCRIPT.read_text().replace("\\\n", " ")
    found = re.findall(r"^(\w+)\(\) \{\s+timeout \d+ python -m kv4rl\.cli (bench rollout .*?) \$ROLLOUT_ARGS$",
                       text, flags=re.M)
    return {name: shlex.split(command) for name, command in found}


def test_gpu_command_lines_validate_on_cpu(tmp_path, no_work):
    commands = _script_commands()
    assert set(commands) == {"qwen3_1p7b", "qwen3_1p7b_256", "qwen3_8b", "qwen3_8b_one_repeat", "qwen3_8b_kv4_256",
                             "qwen3_1p7b_formats", "qwen3_8b_fp8", "qwen3_8b_partial"}
    one = commands["qwen3_8b_one_repeat"]
    i = one.index("--repeats")
    assert one[i + 1] == "1" and one[:i] + one[i + 2:] == commands["qwen3_8b"]  # the same corners, one repeat
    wide = commands["qwen3_8b_kv4_256"]  # the same line with KV4 at 256 slots (and its own output files)
    swap = {"bf16,kv4": "bf16,kv4@256", "$OUT/rollout_qwen3_8b.json": "$OUT/rollout_qwen3_8b_256.json",
            "$OUT/rollout_qwen3_8b.png": "$OUT/rollout_qwen3_8b_256.png"}
    assert [swap.get(a, a) for a in one] == wide
    for name, argv in commands.items():
        argv = [a.replace("$OUT", str(tmp_path / "out")) for a in argv]
        res = runner.invoke(app, [*argv, "--validate-only"])
        assert res.exit_code == 0, f"{name}: {res.output}"
        assert "stopping before any work" in res.output
    assert {"--shape", "qwen3-1.7b", "engine.gpu_memory_fraction=0.6", "--max-len", "4096"} <= set(
        commands["qwen3_1p7b"])
    assert {"--shape", "qwen3-8b", "--kv-budget-gib", "40", "--median-len", "1024", "--max-len", "8192"} <= set(
        commands["qwen3_8b"])
    assert {"bf16,kv4@256", "--max-slots", "128"} <= set(commands["qwen3_1p7b_256"])
    # the FP8 cache's lines: the same workloads, only formats, modes, repeats and output files differ
    for name, base, formats, modes in (("qwen3_1p7b_formats", "qwen3_1p7b", "bf16,fp8,kv4", "sync,partial"),
                                       ("qwen3_8b_fp8", "qwen3_8b_one_repeat", "bf16,fp8", "sync,partial"),
                                       ("qwen3_8b_partial", "qwen3_8b_one_repeat", "kv4,bf16,kv4@256,fp8", "partial")):
        line, ref = commands[name], commands[base]
        assert line[line.index("--formats") + 1] == formats and line[line.index("--modes") + 1] == modes
        dropped = {"--formats", "--modes", "--repeats", "bf16,kv4", "sync,partial", formats, modes, "1", "2", "3"}
        assert ([a for a in line if not a.startswith("$OUT") and a not in dropped]
                == [a for a in ref if not a.startswith("$OUT") and a not in dropped]), name
    # 40 GiB of bf16 pages for Qwen3-8B: 36 layers x 8 KV heads x 128 x K,V x 2 bytes per token, blocks of 16
    res = runner.invoke(app, [*commands["qwen3_8b"], "--validate-only"])
    blocks = 40 * 2**30 // (16 * 36 * 8 * 128 * 2 * 2)
    assert f"pool {blocks * 16:,} tokens" in " ".join(res.output.split())
    assert not (tmp_path / "out").exists()


def test_plot_rollout_trace_side_by_side(tmp_path):
    runs = []
    for mode in ("sync", "partial"):
        cfg = load_config(overrides=[f"name={mode}", f"out_dir={tmp_path}", "device=cpu", "trainer.iterations=2",
                                     f"rollout.mode={mode}", "rollout.quota_groups=4", "rollout.max_slots=16"])
        train(cfg, show_progress=False)
        trace = [json.loads(line) for line in (cfg.run_dir / "rollout_trace.jsonl").read_text().splitlines()]
        assert {t["iteration"] for t in trace} == {0, 1}
        assert all(t["batch_size"] <= 16 and t["latency_s"] > 0 and t["kv_bytes"] > 0 for t in trace)
        runs.append(str(cfg.run_dir))
    torn = cfg.run_dir / "rollout_trace.jsonl"  # a kill mid-write: the plot draws the whole rows
    torn.write_bytes(torn.read_bytes()[:-20])
    png = tmp_path / "trace.png"
    res = runner.invoke(app, ["plot", "rollout-trace", *runs, "--out", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_row_contexts_snapshots_every_few_steps_and_restores_the_engine():
    """`RowContexts` around a fake engine: a snapshot of the running rows' lengths before steps 0, 32, 64,
    ...; `spread` picks evenly spaced ones (first, middle, last of five); the engine's own `step` is
    back afterwards."""
    from types import SimpleNamespace

    from kv4rl.bench.rollout import SNAPSHOT_EVERY, RowContexts

    class FakeEngine:
        def __init__(self):
            self.scheduler = SimpleNamespace(running=[])
            self.steps = 0

        def step(self):
            self.steps += 1
            self.scheduler.running = [[0] * self.steps]  # one row whose length is the step count
            return []

    engine = FakeEngine()
    with RowContexts(engine) as seen:
        for _ in range(4 * SNAPSHOT_EVERY + 1):
            engine.step()
    assert "step" not in vars(engine) and engine.steps == 4 * SNAPSHOT_EVERY + 1
    # step 0 saw nothing running; later snapshots see the length the previous step left
    assert seen.snapshots == [[k * SNAPSHOT_EVERY] for k in range(1, 5)]
    assert seen.spread(3) == [[SNAPSHOT_EVERY], [3 * SNAPSHOT_EVERY], [4 * SNAPSHOT_EVERY]]
    assert seen.spread(10) == seen.snapshots and seen.spread(1) == [[3 * SNAPSHOT_EVERY]]
