"""`kv4rl bench rollout`: what a KV format and a rollout mode buy together at one KV memory budget.

Every (format, mode) corner runs the same workload on the same weights: prompt group g is a fixed
random token sequence and response (g, j) stops after a length drawn from a log-normal distribution
seeded by (g, j) (EOS is ignored), so corners differ only in how many tokens their pool holds and
how the collector schedules the engine. Every format's pool gets the same bytes: `--kv-budget-gib`,
turned into blocks with the engine's own footprint arithmetic (`kv4rl.engine.memory`, as `bench pool`
counts), or on CUDA what `engine.gpu_memory_fraction` leaves after weights and activations (options
and pools: `kv4rl.bench.rollout_plan`). A format with fewer bytes per token therefore keeps more
sequences resident before the scheduler preempts.

Each corner is warmed up with one untimed learner batch (in partial mode this also fills the
pipeline), then timed `repeats` times over `batches` learner batches. Seconds per learner batch are
reported as the median over repeats with min, max and quartiles; a speedup is a ratio of medians, and
its range the ratio of the extremes. Repeats continue one prompt stream, so their spread holds timing
noise and the draw of response lengths; every corner sees the same stream.
"""

from __future__ import annotations

import copy
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from kv4rl.bench.random_model import random_decoder
from kv4rl.bench.rollout_plan import Plan, RolloutBench, model_dir
from kv4rl.data.types import Problem
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_dtype
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig

REFERENCE = ("bf16", "sync")  # the corner every speedup is measured against


def summarize(values: list[float]) -> dict[str, float]:
    """Median, extremes and quartiles (linear interpolation between order statistics) of `values`."""
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def add_speedups(rows: list[dict]) -> None:
    """Each row's time against the bf16 sync corner (bf16 at the common slots, else at its own `bf16@N`): the ratio
    of medians, and the range between the
    ratio of the reference's fastest to the row's slowest repeat and the reverse (None without it)."""
    ref = next((r for r in rows if (r["format"], r["mode"]) == REFERENCE), None) or next(  # else bf16@<slots>
        (r for r in rows if (r["format"].split("@")[0], r["mode"]) == REFERENCE), None)
    for r in rows:
        if ref is None:
            r["speedup_vs_bf16_sync"] = r["speedup_min"] = r["speedup_max"] = None
        elif r is ref:  # the same measurements: exactly one
            r["speedup_vs_bf16_sync"] = r["speedup_min"] = r["speedup_max"] = 1.0
        else:
            r["speedup_vs_bf16_sync"] = ref["rollout_s"] / r["rollout_s"]
            r["speedup_min"] = ref["rollout_s_min"] / r["rollout_s_max"]
            r["speedup_max"] = ref["rollout_s_max"] / r["rollout_s_min"]


class BenchPrompts:
    """Stands in for both the problem source and the formatter: problem g -> fixed random ids."""

    def __init__(self, vocab: int, prompt_len: int, seed: int):
        self.vocab, self.prompt_len, self.seed = vocab, prompt_len, seed

    def problem_at(self, index: int) -> Problem:
        return Problem(problem=str(index), answer="", id=f"bench-{index}")

    def ids(self, problem: Problem) -> list[int]:
        rng = random.Random(self.seed * 7_919 + int(problem.problem))
        return [rng.randrange(1, self.vocab - 1) for _ in range(self.prompt_len)]


ProgressFn = Callable[[str, int], None]  # (what runs now, repeats finished since the last call)


SNAPSHOT_EVERY = 32  # engine steps between two snapshots of the running rows' contexts
PURE_ROW_SNAPSHOTS = 3  # snapshots replayed as pure decode steps of the same rows (`pure_step`)


class RowContexts:
    """Wraps `engine.step` while a corner is timed: every `SNAPSHOT_EVERY` steps, the context of each
    running sequence (their tokens so far) before the step; a list of ints per snapshot, a few
    microseconds of host work."""

    def __init__(self, engine: Engine):
        self.engine, self.step, self.count, self.snapshots = engine, engine.step, 0, []

    def __enter__(self) -> "RowContexts":
        self.own = vars(self.engine).get("step")  # a wrapper set on the instance before this one
        self.engine.step = self._step
        return self

    def __exit__(self, *exc) -> None:
        if self.own is None:
            del self.engine.step  # the class's method again
        else:
            self.engine.step = self.own

    def _step(self):
        if self.count % SNAPSHOT_EVERY == 0 and self.engine.scheduler.running:
            self.snapshots.append([len(s) for s in self.engine.scheduler.running])
        self.count += 1
        return self.step()

    def spread(self, n: int) -> list[list[int]]:
        """`n` snapshots evenly spaced over the timed steps (all of them when there are fewer)."""
        snaps = self.snapshots
        if len(snaps) <= n:
            return list(snaps)
        if n == 1:
            return [snaps[len(snaps) // 2]]
        return [snaps[round(i * (len(snaps) - 1) / (n - 1))] for i in range(n)]


def _timed_repeats(collector: Collector, bench: RolloutBench, label: str, progress: ProgressFn) -> tuple[list, list]:
    """Per repeat: seconds per learner batch, and the engine steps it took (the collector's trace)."""
    seconds, traces = [], []
    for r in range(bench.repeats):
        progress(f"{label}: repeat {r + 1}/{bench.repeats}", 0)
        collector.trace = []
        t0 = time.perf_counter()
        for _ in range(bench.batches):
            collector.collect()
        seconds.append((time.perf_counter() - t0) / bench.batches)
        traces.append(collector.trace)
        progress(f"{label}: repeat {r + 1}/{bench.repeats}", 1)
    return seconds, traces


def _step_kinds(steps: list[dict], batches: int) -> dict:
    """Pure decode steps (one token per row: a CUDA graph on the fast path) apart from mixed ones
    (a prompt, chunk or recompute in the batch: eager), per learner batch, with their mean latency
    and the batch's mean context: where a corner's steps cost more than a decode step of its size."""
    out = {"context_mean": statistics.fmean(s["context_mean"] for s in steps),
           "prefill_tokens_per_batch": sum(s["prefill_tokens"] for s in steps) / batches}
    for kind, chosen in (("decode", [s for s in steps if s["prefill_tokens"] == 0]),
                         ("mixed", [s for s in steps if s["prefill_tokens"] > 0])):
        out[f"{kind}_steps_per_batch"] = len(chosen) / batches
        out[f"{kind}_step_ms"] = 1e3 * statistics.fmean(s["latency_s"] for s in chosen) if chosen else None
        # the host's part: the step's latency less its wait for the device (see Engine.step)
        out[f"{kind}_host_ms"] = (1e3 * statistics.fmean(s["latency_s"] - s["wait_s"] for s in chosen)
                                  if chosen else None)
    return out


def corner_collector(engine: Engine, plan: Plan, fmt: str, mode: str) -> Collector:
    """The collector of one corner: the workload's prompts and response lengths, `mode`, and the decode
    slots of the `--formats` entry `fmt`."""
    work = plan.bench.workload
    prompts = BenchPrompts(plan.args.vocab_size, work.prompt_len, work.seed)
    rcfg = RolloutConfig(mode=mode, quota_groups=work.quota_groups, group_size=work.group_size,
                         max_slots=plan.slots[fmt])
    return Collector(engine, prompts, prompts, rcfg, seed=work.seed, max_tokens_fn=work.length)


def _run_corner(engine: Engine, plan: Plan, fmt: str, mode: str, progress: ProgressFn) -> tuple[dict, list[dict]]:
    """Warm up, time the repeats, and summarise one corner; also its last repeat's per-step trace.
    `fmt`: a `--formats` entry (`kv4`, or `kv4@256` with its own slots)."""
    bench = plan.bench
    collector = corner_collector(engine, plan, fmt, mode)
    progress(f"{fmt} {mode}: warm-up", 0)
    collector.collect()
    preempted, ahead = engine.num_preemptions, engine.num_steps_ahead
    graph_prefills = engine.runner.prefill_graphs.num_runs if engine.runner.prefill_graphs is not None else None
    with RowContexts(engine) as rows_seen:
        seconds, traces = _timed_repeats(collector, bench, f"{fmt} {mode}", progress)
    steps = [s for trace in traces for s in trace]
    fp, slots = plan.footprints[fmt], plan.slots[fmt]
    num_blocks = engine.pool_tokens // fp.block_size
    active = [s["batch_size"] for s in steps]
    spread = summarize(seconds)
    row = {
        "format": fmt, "mode": mode, "kv_format": plan.configs[fmt].kv.format, "slots": slots,
        "rollout_s": spread["median"], "rollout_s_min": spread["min"], "rollout_s_max": spread["max"],
        "rollout_s_q1": spread["q1"], "rollout_s_q3": spread["q3"], "rollout_s_repeats": seconds,
        "tokens_per_s": sum(active) / (sum(seconds) * bench.batches),  # tokens sampled in the timed batches
        "slot_util": statistics.fmean(active) / slots,
        "mean_active": statistics.fmean(active),
        "preemptions": engine.num_preemptions - preempted,
        # steps launched before the previous one's tokens were read (`engine.async_scheduling`): the others
        # leave the device idle while the host reads, schedules and launches
        "steps_ahead_per_batch": (engine.num_steps_ahead - ahead) / (bench.repeats * bench.batches),
        "steps_per_batch": len(steps) / (bench.repeats * bench.batches),
        # prefills replayed as CUDA graphs (`engine.prefill_graph_tokens`; None: off), of the mixed steps
        "graph_prefills_per_batch": (None if graph_prefills is None else
                                     (engine.runner.prefill_graphs.num_runs - graph_prefills) / (bench.repeats * bench.batches)),
        "step_ms": 1e3 * statistics.fmean(s["latency_s"] for s in steps),
        **_step_kinds(steps, bench.repeats * bench.batches),
        "pool_tokens": engine.pool_tokens,
        "pool_bytes": fp.total_bytes(num_blocks, slots),
        "kv_peak_bytes": fp.total_bytes(max(s["kv_blocks"] for s in steps), slots),
        "pool_sizing": engine.pool_sizing,
        # the running rows' contexts at a few steps spread over the timed batches (`pure_step`)
        "row_context_snapshots": rows_seen.spread(PURE_ROW_SNAPSHOTS),
    }
    t, trace = 0.0, []
    for s in traces[-1]:
        t += s["latency_s"]
        trace.append({"t": t, "active": s["batch_size"], "kv_bytes": fp.total_bytes(s["kv_blocks"], slots)})
    return row, trace


def pure_step(decoder, kv_format, row: dict, block_size: int, device: torch.device) -> dict:
    """The corner's engine step against pure decode steps (`bench decode-forward`'s CUDA-graph replay on
    a cache filled with random codes: no admissions, prefill, host work or sampling):
    - `pure_step_ms`: its mean batch with every row at its mean context; `step_vs_pure` is then what
      the engine adds on top of the bytes a step must read, uneven contexts included;
    - `pure_rows_ms`: the mean over the rows and contexts the engine really ran at a few of its steps
      (`row_context_snapshots`), so `step_vs_pure_rows` leaves out what uneven contexts cost the
      kernels and keeps the engine's own additions (mixed steps, host work not hidden, sampling).
    On CPU there is no graph to replay and the times and ratios are None."""
    batch, context = max(1, round(row["mean_active"])), max(1, round(row["context_mean"]))
    out = {"pure_step_batch": batch, "pure_step_context": context, "pure_step_ms": None, "step_vs_pure": None,
           "pure_rows_ms": None, "step_vs_pure_rows": None}
    if device.type == "cuda":
        from kv4rl.bench.decode_forward import time_step

        out["pure_step_ms"] = time_step(decoder, kv_format, batch, context, block_size=block_size)["ms"]
        out["step_vs_pure"] = row["step_ms"] / out["pure_step_ms"]
        snapshots = row.get("row_context_snapshots") or []
        if snapshots:
            out["pure_rows_ms"] = statistics.fmean(
                time_step(decoder, kv_format, len(c), c, block_size=block_size)["ms"] for c in snapshots)
            out["step_vs_pure_rows"] = row["step_ms"] / out["pure_rows_ms"]
    return out


def decoder_of(plan: Plan):
    """The plan's model: random-init weights of `--shape`, or the checkpoint `--model` names."""
    bench, dtype = plan.bench, resolve_dtype("auto", plan.device)
    if bench.shape is not None:
        return random_decoder(bench.shape, plan.device, dtype=dtype, seed=bench.workload.seed)
    from kv4rl.models.hf_weights import load_model

    return load_model(model_dir(bench), plan.device, dtype)[0]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_rollout(plan: Plan, progress: ProgressFn | None = None,
                  on_result: Callable[[dict], None] | None = None) -> tuple[dict, dict[str, list[dict]]]:
    """Run every corner of a prepared plan on one decoder; returns the JSON-ready summary and, per
    corner ("format mode"), the last repeat's steps (engine time, active sequences, KV bytes in use).
    `on_result(summary)` after each corner with the corners run so far (`complete` false until the
    last), so a time limit keeps what ran: an 8B corner with 8192-token responses takes minutes."""
    progress = progress or (lambda what, done: None)
    bench = plan.bench
    decoder = decoder_of(plan)
    rows, traces, summaries = [], {}, {}
    for fmt in bench.formats:
        for mode in bench.modes:
            engine = Engine.from_model(decoder, copy.deepcopy(plan.configs[fmt]), max_num_seqs=plan.slots[fmt],
                                       seed=bench.workload.seed)
            summaries[fmt] = engine.summary
            row, traces[f"{fmt} {mode}"] = _run_corner(engine, plan, fmt, mode, progress)
            kv_format = engine.kv_format
            del engine
            _free(plan.device)
            progress(f"{fmt} {mode}: pure decode step", 0)
            row.update(pure_step(decoder, kv_format, row, plan.configs[fmt].kv.block_size, plan.device))
            _free(plan.device)
            rows.append(row)
            if on_result is not None:
                on_result(_summary(plan, rows, summaries, complete=len(rows) == len(bench.formats) * len(bench.modes)))
    return _summary(plan, rows, summaries, complete=True), traces


def _summary(plan: Plan, rows: list[dict], summaries: dict[str, str], complete: bool) -> dict:
    """The JSON of the corners in `rows`, each with its speedup against the bf16 sync corner when that ran."""
    bench = plan.bench
    add_speedups(rows)
    args, kv = plan.args, plan.configs[bench.formats[0]].kv
    return {
        "model": bench.shape or str(model_dir(bench)),
        "model_shape": {"layers": args.num_layers, "hidden": args.hidden_size, "kv_heads": args.num_kv_heads,
                        "head_dim": args.head_dim, "vocab": args.vocab_size},
        "device": str(plan.device), "dtype": str(resolve_dtype("auto", plan.device)).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else None,
        "workload": asdict(bench.workload), "repeats": bench.repeats, "batches": bench.batches,
        "kv_budget_gib": bench.kv_budget_gib,
        "kv": {"block_size": kv.block_size, "group_size": kv.group_size, "n_sink": kv.n_sink, "n_recent": kv.n_recent},
        "engine_summaries": dict(summaries), "results": [dict(r) for r in rows], "complete": complete,
    }
