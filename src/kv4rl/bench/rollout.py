"""`kv4rl bench rollout`: what a KV format and a rollout mode buy together at one KV memory budget.

Every (format, mode) corner runs the same workload on the same weights: prompt group g is a fixed
random token sequence and response (g, j) stops after a length drawn from a log-normal distribution
seeded by (g, j) (EOS is ignored), so corners differ only in how many tokens their pool holds and
how the collector schedules the engine. Every format's pool gets the same bytes: `--kv-budget-gib`,
turned into blocks with the engine's own footprint arithmetic (`kv4rl.engine.memory`, as `bench pool`
counts), or on CUDA what `engine.gpu_memory_fraction` leaves after weights and activations. A format
with fewer bytes per token therefore keeps more sequences resident before the scheduler preempts.

Each corner is warmed up with one untimed learner batch (in partial mode this also fills the
pipeline), then timed `repeats` times over `batches` learner batches. Seconds per learner batch are
reported as the median over repeats with min, max and quartiles; a speedup is a ratio of medians, and
its range the ratio of the extremes. Repeats continue one prompt stream, so their spread holds timing
noise and the draw of response lengths; every corner sees the same stream.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kv4rl.bench.fidelity import default_allocation
from kv4rl.bench.random_model import qwen3_args, random_decoder
from kv4rl.data.types import Problem
from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_device, resolve_dtype
from kv4rl.engine.memory import GIB, KVFootprint, format_bytes, kv_footprint
from kv4rl.models.args import ModelArgs
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig

MODES = ("sync", "partial")
REFERENCE = ("bf16", "sync")  # the corner every speedup is measured against


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one learner batch asks of the engine: `quota_groups` groups of `group_size` responses,
    `max_slots` decode slots, and log-normal response lengths (median, sigma) capped at `max_len`."""

    quota_groups: int = 8
    group_size: int = 4
    max_slots: int = 16
    prompt_len: int = 16
    median_len: int = 8
    sigma: float = 1.0  # log-normal shape: larger = longer tail
    max_len: int = 40
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.max_len

    def length(self, group: int, j: int) -> int:
        rng = random.Random(self.seed * 1_000_003 + group * 1_009 + j)
        return max(1, min(self.max_len, round(self.median_len * math.exp(rng.gauss(0.0, self.sigma)))))

    def validate(self) -> None:
        for flag, value in (("--quota-groups", self.quota_groups), ("--max-slots", self.max_slots),
                            ("--prompt-len", self.prompt_len), ("--median-len", self.median_len),
                            ("--max-len", self.max_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (GRPO compares responses within a group), "
                             f"got {self.group_size}")
        if self.sigma < 0:
            raise ValueError(f"--sigma must be >= 0, got {self.sigma}")
        if self.median_len > self.max_len:
            raise ValueError(f"--median-len {self.median_len} exceeds --max-len {self.max_len}")


@dataclass(frozen=True, kw_only=True)
class RolloutBench:
    """The options of one benchmark, as given. `engine_keys` are the `engine.*` keys set explicitly;
    KV options not among them are fitted to the model (group size, KV4's protected window)."""

    formats: tuple[str, ...] = ("bf16", "kv4")
    modes: tuple[str, ...] = MODES
    workload: Workload = Workload()
    repeats: int = 3
    batches: int = 1
    shape: str | None = None
    model_dir: Path | None = None
    kv_budget_gib: float | None = None
    device: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_keys: frozenset[str] = frozenset()


def split_slots(label: str, option: str, example: str) -> tuple[str, int | None]:
    """`kv4@256` -> ("kv4", 256), `kv4` -> ("kv4", None): an entry of `--formats` (or an arm of `bench
    iteration`) with its own decode slots; partial rollout keeps that many responses in flight, so a
    format whose cache holds more can run more in the same memory. Raises ValueError naming the entry."""
    spec, at, slots = label.partition("@")
    if not at:
        return spec, None
    if not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"{option} {label}: the slots after '@' must be a whole number >= 1, e.g. {example}")
    return spec, int(slots)


@dataclass(frozen=True)
class Plan:
    """Validated options: the model's shape, the device, and per format entry (`kv4` or `kv4@256`) its
    engine config, footprint and decode slots."""

    bench: RolloutBench
    args: ModelArgs
    device: torch.device
    configs: dict[str, EngineConfig]
    footprints: dict[str, KVFootprint]
    slots: dict[str, int]

    def pool_line(self, label: str) -> str:
        cfg, fp = self.configs[label], self.footprints[label]
        page = f"{fp.block_bytes / fp.block_size:,.0f} B/token in pages"
        if cfg.num_kv_blocks is None:
            return f"{label}: {page}, pool sized by the engine ({_engine_sizing(self.device, cfg)})"
        tokens = cfg.num_kv_blocks * fp.block_size
        total = fp.total_bytes(cfg.num_kv_blocks, self.slots[label])
        return f"{label}: {page}, pool {tokens:,} tokens ({format_bytes(total)})"


def _engine_sizing(device: torch.device, cfg: EngineConfig) -> str:
    if device.type == "cuda":
        return f"engine.gpu_memory_fraction={cfg.gpu_memory_fraction:g}"
    return "every slot at max_model_len, off CUDA"


def _unique(kind: str, names: tuple[str, ...], known) -> None:
    if not names:
        raise ValueError(f"--{kind} is empty")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--{kind}: unknown {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if len(set(names)) != len(names):
        raise ValueError(f"--{kind}: {', '.join(names)} names one twice")


def _model_args(bench: RolloutBench) -> ModelArgs:
    from kv4rl.models.hf_weights import read_model_args

    if bench.shape is not None and bench.model_dir is not None:
        raise ValueError("pass either --model or --shape, not both")
    if bench.shape is not None:
        return qwen3_args(bench.shape)
    return read_model_args(_model_dir(bench))


def _model_dir(bench: RolloutBench) -> Path:
    if bench.model_dir is not None:
        return bench.model_dir
    from kv4rl.models.tiny import tiny_model_dir

    return tiny_model_dir()


def _format_config(bench: RolloutBench, fmt: str, head_dim: int) -> EngineConfig:
    """The engine config of `fmt`: the given one with this format, the workload's context, and KV
    options not given explicitly fitted to the model as `bench fidelity` fits them."""
    cfg = copy.deepcopy(bench.engine)
    cfg.kv.format = fmt
    cfg.max_model_len = bench.workload.max_model_len
    if "engine.kv.group_size" not in bench.engine_keys:
        cfg.kv.group_size = min(cfg.kv.group_size, head_dim)
    if not {"engine.kv.n_sink", "engine.kv.n_recent"} & bench.engine_keys:
        cfg.kv.n_sink, cfg.kv.n_recent = default_allocation(cfg.max_model_len)
    cfg.validate()
    kv_format_from_config(cfg.kv).check(head_dim, cfg.max_model_len)
    return cfg


def _budget_blocks(fmt: str, fp: KVFootprint, gib: float, slots: int, max_model_len: int) -> int:
    """Blocks of `fmt` in `gib` GiB once every slot's rows are reserved, at most what all slots can use."""
    longest = blocks_needed(max_model_len, fp.block_size)
    blocks = fp.blocks_in(int(gib * GIB), slots)
    if blocks < longest:
        need = fp.total_bytes(longest, slots) / GIB
        raise ValueError(f"--kv-budget-gib {gib:g}: {fmt} needs {need:.4f} GiB for one sequence of "
                         f"{max_model_len} tokens plus the rows of {slots} slots")
    return min(blocks, slots * longest)


def prepare(bench: RolloutBench) -> Plan:
    """Check every option against the model and device and size each pool; builds nothing, so a bad
    option fails in a moment instead of after minutes of benchmarking. Raises ValueError."""
    work = bench.workload
    _unique("formats", bench.formats, bench.formats)  # none, or one named twice
    entries = {label: split_slots(label, "--formats", "kv4@256") for label in bench.formats}
    entries = {label: (fmt, n or work.max_slots) for label, (fmt, n) in entries.items()}
    unknown = [label for label, (fmt, _) in entries.items() if fmt not in KV_FORMATS]
    if unknown:
        raise ValueError(f"--formats: unknown {', '.join(unknown)} (known: {', '.join(sorted(KV_FORMATS))}, "
                         "each optionally with its own decode slots, e.g. kv4@256)")
    _unique("modes", bench.modes, MODES)
    work.validate()
    if bench.repeats < 1 or bench.batches < 1:
        raise ValueError(f"--repeats and --batches must be >= 1, got {bench.repeats} and {bench.batches}")
    if bench.kv_budget_gib is not None:
        if not bench.kv_budget_gib > 0:
            raise ValueError(f"--kv-budget-gib must be > 0, got {bench.kv_budget_gib}")
        if bench.engine.num_kv_blocks is not None:
            raise ValueError("pass either --kv-budget-gib or engine.num_kv_blocks, not both")
    for key, owner in (("engine.kv.format", "--formats"), ("engine.max_model_len", "--prompt-len + --max-len")):
        if key in bench.engine_keys:
            raise ValueError(f"{key} is set by {owner} here")
    args = _model_args(bench)
    if work.max_model_len > args.max_position_embeddings:
        raise ValueError(f"--prompt-len + --max-len = {work.max_model_len} exceeds the model's context of "
                         f"{args.max_position_embeddings} tokens")
    device = resolve_device(bench.device)
    configs, footprints, slots = {}, {}, {}
    for label, (fmt, n) in entries.items():
        cfg = _format_config(bench, fmt, args.head_dim)
        fp = kv_footprint(kv_format_from_config(cfg.kv), args.num_layers, args.num_kv_heads, args.head_dim,
                          cfg.kv.block_size)
        if bench.kv_budget_gib is not None:
            cfg.num_kv_blocks = _budget_blocks(label, fp, bench.kv_budget_gib, n, work.max_model_len)
        configs[label], footprints[label], slots[label] = cfg, fp, n
    return Plan(bench, args, device, configs, footprints, slots)


def summarize(values: list[float]) -> dict[str, float]:
    """Median, extremes and quartiles (linear interpolation between order statistics) of `values`."""
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def add_speedups(rows: list[dict]) -> None:
    """Each row's time against the bf16 sync corner: the ratio of medians, and the range between the
    ratio of the reference's fastest to the row's slowest repeat and the reverse (None without it)."""
    ref = next((r for r in rows if (r["format"], r["mode"]) == REFERENCE), None)
    for r in rows:
        if ref is None:
            r["speedup_vs_bf16_sync"] = r["speedup_min"] = r["speedup_max"] = None
        elif r is ref:  # the same measurements: exactly one
            r["speedup_vs_bf16_sync"] = r["speedup_min"] = r["speedup_max"] = 1.0
        else:
            r["speedup_vs_bf16_sync"] = ref["rollout_s"] / r["rollout_s"]
            r["speedup_min"] = ref["rollout_s_min"] / r["rollout_s_max"]
            r["speedup_max"] = ref["rollout_s_max"] / r["rollout_s_min"]


class _Prompts:
    """Stands in for both the problem source and the formatter: problem g -> fixed random ids."""

    def __init__(self, vocab: int, prompt_len: int, seed: int):
        self.vocab, self.prompt_len, self.seed = vocab, prompt_len, seed

    def problem_at(self, index: int) -> Problem:
        return Problem(problem=str(index), answer="", id=f"bench-{index}")

    def ids(self, problem: Problem) -> list[int]:
        rng = random.Random(self.seed * 7_919 + int(problem.problem))
        return [rng.randrange(1, self.vocab - 1) for _ in range(self.prompt_len)]


ProgressFn = Callable[[str, int], None]  # (what runs now, repeats finished since the last call)


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


def _run_corner(engine: Engine, plan: Plan, fmt: str, mode: str, progress: ProgressFn) -> tuple[dict, list[dict]]:
    """Warm up, time the repeats, and summarise one corner; also its last repeat's per-step trace.
    `fmt`: a `--formats` entry (`kv4`, or `kv4@256` with its own slots)."""
    bench, work = plan.bench, plan.bench.workload
    prompts = _Prompts(plan.args.vocab_size, work.prompt_len, work.seed)
    rcfg = RolloutConfig(mode=mode, quota_groups=work.quota_groups, group_size=work.group_size,
                         max_slots=plan.slots[fmt])
    collector = Collector(engine, prompts, prompts, rcfg, seed=work.seed, max_tokens_fn=work.length)
    progress(f"{fmt} {mode}: warm-up", 0)
    collector.collect()
    preempted = engine.num_preemptions
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
        "steps_per_batch": len(steps) / (bench.repeats * bench.batches),
        "step_ms": 1e3 * statistics.fmean(s["latency_s"] for s in steps),
        **_step_kinds(steps, bench.repeats * bench.batches),
        "pool_tokens": engine.pool_tokens,
        "pool_bytes": fp.total_bytes(num_blocks, slots),
        "kv_peak_bytes": fp.total_bytes(max(s["kv_blocks"] for s in steps), slots),
        "pool_sizing": engine.pool_sizing,
    }
    t, trace = 0.0, []
    for s in traces[-1]:
        t += s["latency_s"]
        trace.append({"t": t, "active": s["batch_size"], "kv_bytes": fp.total_bytes(s["kv_blocks"], slots)})
    return row, trace


def _decoder(plan: Plan):
    bench, dtype = plan.bench, resolve_dtype("auto", plan.device)
    if bench.shape is not None:
        return random_decoder(bench.shape, plan.device, dtype=dtype, seed=bench.workload.seed)
    from kv4rl.models.hf_weights import load_model

    return load_model(_model_dir(bench), plan.device, dtype)[0]


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
    decoder = _decoder(plan)
    rows, traces, summaries = [], {}, {}
    for fmt in bench.formats:
        for mode in bench.modes:
            engine = Engine.from_model(decoder, copy.deepcopy(plan.configs[fmt]), max_num_seqs=plan.slots[fmt],
                                       seed=bench.workload.seed)
            summaries[fmt] = engine.summary
            row, traces[f"{fmt} {mode}"] = _run_corner(engine, plan, fmt, mode, progress)
            rows.append(row)
            del engine
            _free(plan.device)
            if on_result is not None:
                on_result(_summary(plan, rows, summaries, complete=len(rows) == len(bench.formats) * len(bench.modes)))
    return _summary(plan, rows, summaries, complete=True), traces


def _summary(plan: Plan, rows: list[dict], summaries: dict[str, str], complete: bool) -> dict:
    """The JSON of the corners in `rows`, each with its speedup against the bf16 sync corner when that ran."""
    bench = plan.bench
    add_speedups(rows)
    args, kv = plan.args, plan.configs[bench.formats[0]].kv
    return {
        "model": bench.shape or str(_model_dir(bench)),
        "model_shape": {"layers": args.num_layers, "hidden": args.hidden_size, "kv_heads": args.num_kv_heads,
                        "head_dim": args.head_dim, "vocab": args.vocab_size},
        "device": str(plan.device), "dtype": str(resolve_dtype("auto", plan.device)).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else None,
        "workload": asdict(bench.workload), "repeats": bench.repeats, "batches": bench.batches,
        "kv_budget_gib": bench.kv_budget_gib,
        "kv": {"block_size": kv.block_size, "group_size": kv.group_size, "n_sink": kv.n_sink, "n_recent": kv.n_recent},
        "engine_summaries": dict(summaries), "results": [dict(r) for r in rows], "complete": complete,
    }
