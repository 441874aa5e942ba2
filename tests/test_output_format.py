"""What a person reads: tables keep every number whole, progress fits 80 columns, no library noise.

Tables and bars are rendered into a rich Console of a given width writing to a string, either as a
terminal (the layout must fit the width) or piped (nothing to fit, nothing cut).
"""

from __future__ import annotations

import io
import re
import warnings
from io import StringIO

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kv4rl.bench.tables import (
    decode_attn_table as _decode_attn_table,
    decode_forward_table as _decode_forward_table,
    fidelity_table as _fidelity_table,
    generate_table as _generate_table,
    pool_table as _pool_table,
    rollout_table as _rollout_table,
)
from kv4rl.cli_plot import _curves_table
from kv4rl.cli_sim import _clip_bias_table, _variance_table
from kv4rl.telemetry.progress import FittedItems, StageProgress, TrainProgress
from kv4rl.telemetry.tables import format_value, metric_table, print_table

WIDTH = 80


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def terminal(width: int = WIDTH, clock: Clock | None = None) -> Console:
    return Console(width=width, file=StringIO(), force_terminal=True, color_system=None,
                   get_time=clock or Clock(), _environ={})


def piped() -> Console:
    return Console(width=WIDTH, file=StringIO(), force_terminal=False, _environ={})


def fidelity_result() -> dict:
    def row(fmt, allocation, kl, kl0, kl1, top1, nbytes, rel):
        return {"format": fmt, "allocation": allocation, "kl_mean": kl, "top1_agree": top1,
                "kl_by_position": {"0-15": kl0, "16-63": kl1, "64+": kl * 1.5},
                "bytes_per_token": nbytes, "bytes_vs_bf16": rel}

    return {"reference": "bf16", "num_prompts": 16, "response_tokens_mean": 256.0, "context_for_bytes": 8192,
            "model_shape": {"layers": 28, "kv_heads": 8, "head_dim": 128}, "kv": {"group_size": 128},
            "results": [row("bf16", None, 0.0, 0.0, 0.0, 1.0, 114688, 1.0),
                        row("fp8", None, 2.258e-03, 1.125e-03, 3.5e-03, 0.9871, 57344, 0.5),
                        row("kv4", "16+128", 1.0125e-02, 7.5e-03, 1.25e-02, 0.9612, 30212, 0.2634),
                        row("mxfp4", None, 3.0417e-02, 2.2e-02, 4.4e-02, 0.9310, 30464, 0.2656)]}


def tables() -> dict:
    """One table of each kind the commands print, from results shaped as the benchmarks return them."""
    generate = {"shape": "qwen3-1.7b", "model_shape": {"layers": 28, "hidden": 2048}, "dtype": "bfloat16",
                "gpu": "NVIDIA H200", "device": "cuda", "prompt_len": 128, "new_tokens": 256,
                "weight_formats": ["fp8"], "results": [
                    {"kv_format": kv, "batch_size": b, "engine_tokens_per_s": 12345.6 * b / 64,
                     "hf_tokens_per_s": 1234.5, "speedup": 10.0 * b / 64, "engine_steps": 257,
                     "decode_step_ms": 11.234, "decode_host_ms": 3.125, "engine_peak_gib": 17.5, "hf_peak_gib": 21.25}
                    for kv in ("bf16", "kv4") for b in (64, 256)]}
    pool = {"model_shape": {"layers": 36, "kv_heads": 8, "head_dim": 128}, "kv": {"block_size": 16},
            "results": [{"format": f, "tokens": t, "tokens_vs_bf16": r, "bytes_per_token": bt,
                         "bytes_per_token_at_context": bt + 3.5, "reserve_bytes": 5 * 2**20,
                         "sequences_at_context": t // 8192}
                        for f, t, r, bt in (("bf16", 291271, 1.0, 147456), ("kv4", 1118481, 3.84, 38400))]}
    attn = {"device": "NVIDIA H200", "results": [
        {"shape": "qwen3-8b", "format": f, "int4_kernel": k, "batch": 64, "context": c, "ms": ms,
         "tbps": 4.123, "speedup_vs_sdpa": 3.21}
        for f, k, ms in (("bf16", "", 0.5123), ("kv4", "cuda", 0.1876)) for c in (2048, 16384)]}
    forward = {"device": "NVIDIA H200", "results": [
        {"shape": "qwen3-8b", "workload": w, "batch": b, "context": c, "weights": wt, "kv": kv, "ms": 25.43,
         "tokens_per_s": 10066.8, "speedup_vs_bf16": 1.37, "fp8_gemm": "triton" if wt == "fp8" else None,
         "fp8_inputs": wt == "fp8"}
        for w, b, c in (("early", 256, 1024), ("late", 64, 8192)) for wt in ("bf16", "fp8") for kv in ("bf16", "kv4")]}
    clip = {"rho": 1.5, "eps": 0.2, "sigma": 1.0, "n_samples": 200000,
            "closed_form": {"regime": "above", "clip": {"mean": -0.75, "var": 0.5625},
                            "noclip": {"mean": 0.0, "var": 2.25}},
            "clip": {"mean": -0.7512, "var": 0.5619}, "noclip": {"mean": 0.0021, "var": 2.2497},
            "stderr": {"clip": {"mean": 0.0017, "var": 0.0009}, "noclip": {"mean": 0.0034, "var": 0.0001}}}
    variance = {"behavior": "stale:4", "n_responses": 64, "n_tokens": 221, "mean_response_len": 3.45,
                "horizons": [{"horizon": h, "var": 0.15293 * i, "std": 0.39107 * i, "mean": -0.05127 * i,
                              "absmax": 2.3946 * i} for i, h in enumerate((1, 4, 16, "full"), start=1)]}
    summary = {"iterations": 200, "seconds": 123.456, "kl_mismatch": 2.5e-05, "reward_last": 0.8125,
               "run_dir": "/tmp/runs/tiny-arith-a-rather-long-run-name"}
    curves = {"arms": {"kv4-partial": {"n_seeds": 3, "last_iteration": 199, "final_mean": 0.61234,
                                       "final_std": 0.01875, "worst_drop_mean_curve": 0.0213,
                                       "worst_drop_worst_seed": 0.0871}}}
    rollout = {"model": "qwen3-1.7b", "gpu": "NVIDIA H200", "device": "cuda", "kv_budget_gib": None, "repeats": 2,
               "workload": {"quota_groups": 16, "group_size": 8, "max_slots": 128, "prompt_len": 256,
                            "median_len": 512, "sigma": 1.0, "max_len": 4096},
               "results": [{"format": f, "mode": m, "rollout_s": 18.786, "rollout_s_min": 18.33,
                            "rollout_s_max": 19.243, "speedup_vs_bf16_sync": 0.74, "speedup_min": 0.66,
                            "speedup_max": 0.83, "tokens_per_s": 5298.5, "slot_util": 0.19, "mean_active": 24.3,
                            "preemptions": 0, "pool_tokens": 557056, "kv_peak_bytes": 5994455040,
                            "pool_bytes": 18060148736, "steps_per_batch": 913.5, "step_ms": 27.898,
                            "decode_steps_per_batch": 897.5, "mixed_steps_per_batch": 16.0, "decode_step_ms": 27.015,
                            "mixed_step_ms": 77.444, "decode_host_ms": 2.875, "mixed_host_ms": 9.625,
                            "graph_prefills_per_batch": 16.0}
                           for f in ("bf16", "kv4") for m in ("sync", "partial")]}
    return {"rollout": _rollout_table(rollout), "curves": _curves_table("eval/mean@1", 0.9, curves), "fidelity": _fidelity_table(fidelity_result()), "pool": _pool_table(pool, "qwen3-8b", 40.0, 256, 8192),
            "generate": _generate_table(generate), "decode-attn": _decode_attn_table(attn),
            "decode-forward": _decode_forward_table(forward, True), "clip-bias": _clip_bias_table(clip),
            "correction-variance": _variance_table(variance), "metrics": metric_table("run", summary)}


@pytest.mark.parametrize("kind", list(tables()))
@pytest.mark.parametrize("console_kind", ["terminal", "piped"])
def test_every_table_keeps_every_cell_whole(kind, console_kind):
    table = tables()[kind]
    console = terminal() if console_kind == "terminal" else piped()
    print_table(console, table)
    out = console.file.getvalue()
    for row in table.rows:
        for cell in row:
            assert cell in out, (kind, console_kind, cell, out)
    if console_kind == "terminal":
        assert max(map(len, out.splitlines())) <= WIDTH, out


def test_rollout_table_counts_graph_prefills_and_marks_them_off():
    table = tables()["rollout"]
    column = table.headers.index("graph prefills")
    assert {row[column] for row in table.rows} == {"16.0"}
    # a run without prefill graphs reports None
    res = {"model": "m", "gpu": None, "device": "cpu", "kv_budget_gib": 1.0, "repeats": 1,
           "workload": {"quota_groups": 1, "group_size": 1, "max_slots": 1, "prompt_len": 1, "median_len": 1,
                        "sigma": 1.0, "max_len": 2},
           "results": [{"format": "bf16", "mode": "sync", "rollout_s": 1.0, "rollout_s_min": 1.0, "rollout_s_max": 1.0,
                        "speedup_vs_bf16_sync": 1.0, "speedup_min": 1.0, "speedup_max": 1.0, "tokens_per_s": 1.0,
                        "slot_util": 1.0, "mean_active": 1.0, "preemptions": 0, "pool_tokens": 16, "kv_peak_bytes": 1,
                        "pool_bytes": 2, "steps_per_batch": 1.0, "step_ms": 1.0, "graph_prefills_per_batch": None}]}
    off = _rollout_table(res)
    assert off.rows[0][off.headers.index("graph prefills")] == "-"


def test_fidelity_at_80_columns_splits_and_repeats_the_labels():
    console = terminal()
    print_table(console, tables()["fidelity"])
    out = console.file.getvalue()
    assert "2.258e-03" in out and "…" not in out
    assert out.count("mxfp4") == 2 and out.count("16+128") == 2  # two parts, each with the label columns
    assert out.count("KV fidelity vs bf16") == 1


def test_piped_table_is_one_table_at_natural_width():
    console = piped()
    table = tables()["fidelity"]
    print_table(console, table)
    out = console.file.getvalue()
    assert out.count("mxfp4") == 1
    top_border = next(line for line in out.splitlines() if line.startswith("┏"))
    widest = [max(len(h), *(len(row[i]) for row in table.rows)) for i, h in enumerate(table.headers)]
    assert len(top_border) == sum(widest) + 3 * len(widest) + 1 > WIDTH  # "│ cell " per column, closing "│"
    header = next(line for line in out.splitlines() if "format" in line)
    assert "KL mean" in header and "bytes/token @8192" in header and "vs bf16" in header


@pytest.mark.parametrize("value, text", [(2.258e-03, "2.258e-03"), (4.5e-05, "4.500e-05"), (0.0123, "0.0123"),
                                         (0.0, "0.0000"), (0.8125, "0.8125"), (12345678.0, "1.235e+07"),
                                         (7, "7"), (True, "True"), ("path", "path")])
def test_format_value_switches_to_scientific_where_decimals_hide_the_value(value, text):
    assert format_value(value) == text


def test_fitted_items_keep_the_leading_items_that_fit():
    items = FittedItems(["rew 0.250", "acc 0.125", "len 5.5"])
    assert items.text(20) == "rew 0.250  acc 0.125"  # exactly 20 cells
    assert items.text(19) == "rew 0.250"
    assert items.text(100) == "rew 0.250  acc 0.125  len 5.5"
    assert items.text(5) == ""


TRAIN_ROW = {"reward_mean": 0.25, "accuracy": 0.125, "response_len_mean": 5.5, "entropy": 1.234,
             "grad_norm": 0.5, "tokens_per_s": 1234.0, "eval/mean@4": 0.3}


@pytest.mark.parametrize("width", [80, 100])
def test_train_bar_keeps_count_eta_reward_and_accuracy(width):
    clock = Clock()
    console = terminal(width, clock)
    bar = TrainProgress(200, 0, console=console)
    for _ in range(3):
        clock.now += 2.0
        bar.update(TRAIN_ROW)
    console.print(bar.progress.get_renderable())
    line = console.file.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= width
    # samples at t = 2, 4, 6 s: 2 iterations in 4 s, so 197 left take 394 s
    assert "3/200" in line and "ETA 0:06:34" in line
    assert "rew 0.250" in line and "acc 0.125" in line
    assert ("gn 0.50" in line) == (width > 100)  # the least important figure goes first


@pytest.mark.parametrize("seconds_per_iteration", [10.0, 31.0, 600.0])
def test_train_bar_estimates_the_time_left_from_iterations_longer_than_30_s(seconds_per_iteration):
    """rich's speed window was its default 30 s: an iteration longer than that left one sample, and the bar
    said `ETA -:--:--` for the whole run (a 1.7B iteration takes ~40 s). Reference: (left) x (seconds each)."""
    from kv4rl.telemetry.progress import _Eta

    clock = [1000.0]
    bar = TrainProgress(100, 0, console=Console(file=StringIO(), force_terminal=True, width=120))
    bar.progress.get_time = lambda: clock[0]
    with bar:
        for _ in range(4):
            clock[0] += seconds_per_iteration
            bar.update({"reward_mean": 0.1, "accuracy": 0.1, "response_len_mean": 3.0, "tokens_per_s": 100.0})
        shown = _Eta().render(bar.progress.tasks[0]).plain
    hours, minutes, seconds = map(int, shown.removeprefix("ETA ").split(":"))
    assert hours * 3600 + minutes * 60 + seconds == pytest.approx(96 * seconds_per_iteration, rel=0.02), shown


def test_piped_training_prints_a_line_per_iteration():
    """Piped, the bar draws nothing, so a run printed nothing until its summary; now each iteration is one line
    with its count (from the resumed start) and figures, and a terminal gets no such lines."""
    console = piped()
    bar = TrainProgress(20, 5, console=console)
    with bar:
        bar.update(TRAIN_ROW)
        bar.update(dict(TRAIN_ROW, reward_mean=0.5))
    lines = console.file.getvalue().splitlines()
    assert lines == ["train 6/20  rew 0.250  acc 0.125  eval@4 0.300  len 5.5  1234 tok/s  ent 1.234  gn 0.50",
                     "train 7/20  rew 0.500  acc 0.125  eval@4 0.300  len 5.5  1234 tok/s  ent 1.234  gn 0.50"]
    quiet = piped()
    with TrainProgress(20, 0, enabled=False, console=quiet) as off:
        off.update(TRAIN_ROW)
    assert quiet.file.getvalue() == ""
    tty = terminal()
    bar = TrainProgress(20, 0, console=tty)
    bar.update(TRAIN_ROW)
    assert "train 1/20" not in tty.file.getvalue()


def test_stage_bar_counts_and_estimates_at_80_columns():
    clock = Clock()
    console = terminal(clock=clock)
    stages = StageProgress(console, "fidelity")
    announce = stages.counted(5)
    for message in ("sampling 16 responses with the bf16 cache", "teacher-forcing through fp8",
                    "teacher-forcing through a format with a rather long name that cannot fit in the line"):
        announce(message)
        clock.now += 2.0
    console.print(stages.progress.get_renderable())
    line = console.file.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= WIDTH
    # stages started at t = 0, 2, 4 s: one stage per 2 s, 3 of 5 to go -> 6 s
    assert "2/5" in line and "ETA 0:00:06" in line and "teacher-forcing through a format" in line
    stages("scoring")  # a stage of unknown length: no count, no ETA
    console.print(stages.progress.get_renderable())
    last = console.file.getvalue().rstrip("\n").splitlines()[-1]
    assert "scoring" in last and "/" not in last and "ETA" not in last


def test_piped_stage_bar_prints_one_line_per_stage_and_keeps_notes():
    console = piped()
    with StageProgress(console, "eval") as stages:
        for done in range(9):
            stages("sampling 8 responses", done, 8)
        stages("scoring 8 responses")
        stages.advance("bf16 batch 64: 1234 tokens/s")
    assert console.file.getvalue().splitlines() == [
        "sampling 8 responses", "scoring 8 responses", "bf16 batch 64: 1234 tokens/s"]


def test_eval_command_reports_its_stages_and_raises_no_library_warnings():
    from kv4rl.cli import app

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = CliRunner().invoke(app, ["eval", "--n", "4", "--k", "2"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[:2] == ["sampling 8 responses", "scoring 8 responses"]
    assert "Warning" not in res.output
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_tiny_model_sampling_raises_no_deprecation_warning():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kv4rl.models import tiny

    path = tiny.tiny_model_dir(progress=False)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny.evaluate_samples(model, tokenizer, tiny.TASK.problems(4, seed=3), temperature=1.0, seed=0)
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_correction_variance_reports_each_stage_to_completion(tmp_path):
    from kv4rl.sim.correction_variance import Settings, measure, parse_behavior
    from tests.test_correction_variance import arith_checkpoint

    calls = []
    settings = Settings(model_dir=arith_checkpoint(tmp_path), behavior=parse_behavior("stale:2"), horizons=[1],
                        n_prompts=2, samples_per_prompt=5, max_new_tokens=4, seed=1, device="cpu",
                        stale_batch_size=2)
    measure(settings, progress=lambda stage, done, total: calls.append((stage, done, total)))
    finals = {}
    for stage, done, total in calls:
        assert 0 <= done <= total
        finals[stage] = (done, total)
    assert finals == {"training μ = stale:2": (2, 2), "sampling 10 responses from μ = stale:2": (10, 10),
                      "teacher-forcing 10 responses through π": (10, 10)}
    assert [s for s, _, _ in calls] == sorted((s for s, _, _ in calls), key=list(finals).index)  # in order


def test_no_bar_escape_codes_in_piped_output():
    console = piped()
    with StageProgress(console, "decode-attn") as stages:
        stages("timing 2 kernel cases", 0, 2)
        stages.advance("qwen3-8b kv4 B64 L2048: 0.1876 ms")
    assert not re.search(r"\x1b\[", console.file.getvalue())


def test_decode_forward_table_names_the_fp8_product():
    assert "FP8 product Triton e4m3 up to 128 tokens, FP8 inputs from the norms and SwiGLU" in tables()["decode-forward"].title
    bf16_only = {"device": "cpu", "results": [{"shape": "s", "workload": "w", "batch": 1, "context": 1, "weights": "bf16",
                                               "kv": "bf16", "ms": 1.0, "tokens_per_s": 1.0, "speedup_vs_bf16": 1.0}]}
    assert "FP8" not in _decode_forward_table(bf16_only, True).title


def test_a_decode_forward_workload_that_does_not_fit_is_a_row_not_a_traceback(monkeypatch):
    """On an H100, the BF16 cache of 64 x 8,192 tokens at 8B (72 GiB) ran out of memory and the whole bench ended in a
    traceback, the other workloads' rows lost. Now that row says so and the rest are measured (a stub model and
    step timer stand in for the GPU: the ms of the rows that fit are the stub's own)."""
    import importlib

    import torch

    # the modules as `import` finds them (sys.modules): another test's re-import can leave the package's attribute
    # naming an older copy, and a patch through it missed, so this test built a real 8B model on the CPU (96 s)
    forward = importlib.import_module("kv4rl.bench.decode_forward")
    random_model = importlib.import_module("kv4rl.bench.random_model")
    built = []

    class Stub(torch.nn.Module):
        args = None

    def step(model, kv, batch, context, barrier=None):
        if (kv, context) == ("bf16", 8192):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"ms": 2.0 if kv == "bf16" else 1.0, "tokens_per_s": 1.0, "finite": True, "kv_gib": 1.0}

    monkeypatch.setattr(random_model, "random_decoder", lambda shape, device, tp=None: built.append(shape) or Stub())
    monkeypatch.setattr(forward, "time_step", step)
    monkeypatch.setattr(forward, "copy_bandwidth", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, int(79.18 * 2**30)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stub")
    res = forward.run_decode_forward(["qwen3-8b"], ["mid", "late"], variants=(("bf16", "bf16"), ("bf16", "kv4")), merge_projections=False,
                                     device="cpu")
    assert built == ["qwen3-8b"]  # the stub, not an 8B model
    rows = {(r["workload"], r["kv"]): r for r in res["results"]}
    assert rows["late", "bf16"]["ms"] is None and rows["late", "bf16"]["does_not_fit"] == (
        "bf16 KV of 64 x 8192 tokens does not fit beside the weights in 79.2 GiB")
    assert rows["late", "kv4"]["ms"] == 1.0 and rows["late", "kv4"]["speedup_vs_bf16"] is None
    assert rows["mid", "kv4"]["speedup_vs_bf16"] == 2.0
    table = _decode_forward_table(res, False)
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(table)
    text = console.file.getvalue()
    assert "does not fit" in text and "2.00x" in text
