"""`kv4rl bench iteration`: where a whole RL iteration's time goes, per arm (KV format x rollout mode x
weight format), with the engine and the learner on one device.

Each arm drives the training loop's own `loop.run_iteration` (the loop's phase timers, its learner
built by `run_setup.build_learner`, the weight refresh and, by default, the engine's sleep/wake around the
update) on random-init weights of a model shape, so the phases are the ones a `kv4rl train` run logs:
rollout, reward (with advantages), update, weight sync (FP8 re-quantization included for fp8
weights), sleep/wake (pool freed and re-allocated, graphs re-captured), and `other` (what
`time_total` holds beyond them). Nothing is a real task: prompt group g is a fixed random token
sequence and response (g, j) runs to a log-normal length seeded by (g, j), EOS ignored (the
`bench rollout` workload), and the reward is a deterministic function of the response's token ids
(the fraction of odd ids), so GRPO advantages and the update are real work on real shapes.

Every arm starts from the same weights (the cached random-init folder of the shape), builds its
learner first, then its engine (so a pool sized from device memory sees the learner's weights, and at
each wake also its optimizer state), runs `warmup_iterations` untimed iterations (CUDA graphs, allocator,
and in partial mode the carried responses; one by default, which a first run on a fresh machine showed
too few for partial rollout's carried prefill shapes) and then times `iterations` iterations; the reported
seconds are means over those. Peak memory is torch's peak allocated bytes over the timed iterations
(CUDA only). Partial arms carry unfinished responses with `rollout.carry: recompute` (what sleeping
needs; see `EngineConfig`), except `awake` arms: their engine does not sleep, and unfinished responses
keep their KV across the update (`carry: keep_kv`, docs/rollout.md's default), which needs the KV pool and the
learner's update to fit the device together (a small KV4 pool is what makes that possible): their
engine sizes its pool leaving the update's memory free, measured by the learner before the engine
starts (`Learner.update_memory_bytes`, the row's `update_reserve_bytes`).
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kv4rl.bench.fidelity import default_allocation
from kv4rl.bench.random_model import qwen3_args, random_model_dir
from kv4rl.bench.rollout import BenchPrompts
from kv4rl.bench.rollout_plan import MODES, Workload, split_slots
from kv4rl.config import RunConfig
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_device, resolve_dtype
from kv4rl.kernels import kernels_usable
from kv4rl.rewards.base import RewardResult
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.pipeline import RolloutPipeline
from kv4rl.telemetry.phases import PHASES, means_of, rows_of
from kv4rl.trainer.attention import CHOICES as ATTENTION_CHOICES
from kv4rl.telemetry.run_stats import mean_known
from kv4rl.trainer.compiled_layers import compiles_by_default, forget_compiled_graphs
from kv4rl.trainer.fused_elementwise import fuses_by_default
from kv4rl.trainer.learner_options import fused_logprobs_by_default

WEIGHT_FORMATS = {"fp8w": "fp8"}  # arm part -> engine.weight_format (default: the model dtype)
AWAKE = "awake"  # arm part: the engine stays awake through the update, carried responses keep their KV


@dataclass(frozen=True)
class Arm:
    """One bar of the figure: `kv` format, rollout `mode`, engine `weights` ("auto" or "fp8"), and
    whether the engine stays `awake` through the update (else it sleeps as --sleep says)."""

    label: str
    kv: str
    mode: str
    weights: str = "auto"
    slots: int | None = None  # decode slots of this arm (`@N`); None: --max-slots
    awake: bool = False


def parse_arms(text: str) -> list[Arm]:
    """`bf16+sync,kv4+partial@256,fp8w+kv4+partial,kv4+partial+awake` -> arms; each names one KV
    format and one mode, may name a weight format (fp8w), `awake` (no sleep; carried responses keep
    their KV) and, after `@`, its own number of decode slots (partial rollout keeps that many
    responses in flight, so a format whose cache holds more can run more at the same memory).
    Raises ValueError naming the bad arm."""
    arms = [a.strip() for a in text.split(",")]
    if not any(arms):
        raise ValueError("--arms is empty")
    if not all(arms):
        raise ValueError(f"--arms {text!r}: an empty item between commas")
    out = []
    for label in arms:
        spec, slots = split_slots(label, "--arms", "kv4+partial@256")
        parts = spec.split("+")
        kv = [p for p in parts if p in KV_FORMATS]
        mode = [p for p in parts if p in MODES]
        weights = [p for p in parts if p in WEIGHT_FORMATS]
        awake = parts.count(AWAKE)
        unknown = [p for p in parts
                   if p not in KV_FORMATS and p not in MODES and p not in WEIGHT_FORMATS and p != AWAKE]
        if unknown or len(kv) != 1 or len(mode) != 1 or len(weights) > 1 or awake > 1:
            raise ValueError(
                f"--arms {label!r}: an arm is KV format + mode [+ weight format] [+ {AWAKE}], e.g. kv4+partial, "
                f"fp8w+kv4+partial or kv4+partial+{AWAKE} (KV formats: {', '.join(sorted(KV_FORMATS))}; modes: "
                f"{', '.join(MODES)}; weight formats: {', '.join(WEIGHT_FORMATS)})"
                + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
        out.append(Arm(label, kv[0], mode[0], WEIGHT_FORMATS[weights[0]] if weights else "auto", slots,
                       awake=bool(awake)))
    if len({a.label for a in out}) < len(out):
        raise ValueError(f"--arms {text}: names one arm twice")
    return out


@dataclass(frozen=True, kw_only=True)
class IterationBench:
    """The options of one benchmark, as given (see the module docstring)."""

    arms: tuple[Arm, ...]
    shape: str = "qwen3-tiny"
    workload: Workload = Workload()
    iterations: int = 2
    # untimed iterations first: on a fresh machine one was not enough for partial rollout (its carried
    # responses are re-prefilled only after the first update: a first run's rollout took 40-44% longer, H100)
    warmup_iterations: int = 1
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None  # packed micro-batches of this many tokens; None: padded
    attention: str = "auto"
    grad_checkpointing: bool = False
    offload: bool = False  # trainer.offload (FSDP2 CPUOffloadPolicy)
    offload_optimizer: bool = False  # trainer.offload_optimizer (AdamW moments in pinned CPU memory)
    fuse_elementwise: bool | None = None  # trainer.fuse_elementwise (None: on for CUDA)
    compile_layers: bool | None = None  # trainer.compile_layers (None: on for CUDA)
    fused_logprobs: bool | None = None  # trainer.fused_logprobs (None: on for CUDA)
    lr: float = 1e-6
    sleep: bool = True
    device: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_keys: frozenset[str] = frozenset()


def run_config(bench: IterationBench, arm: Arm) -> RunConfig:
    """The training config of one arm, validated as `kv4rl train` validates it (ValueError). KV options
    not given explicitly are fitted to the model as `bench rollout` fits them; `model.path` is set when
    the random-init folder exists."""
    work, head_dim = bench.workload, qwen3_args(bench.shape).head_dim
    cfg = RunConfig(name=f"bench-{arm.label}", seed=work.seed, device=bench.device,
                    engine=copy.deepcopy(bench.engine))
    e = cfg.engine
    e.kv.format, e.weight_format, e.sleep_between_rollouts = arm.kv, arm.weights, bench.sleep and not arm.awake
    e.max_model_len = work.max_model_len
    if "engine.kv.group_size" not in bench.engine_keys:
        e.kv.group_size = min(e.kv.group_size, head_dim)
    if not {"engine.kv.n_sink", "engine.kv.n_recent"} & bench.engine_keys:
        e.kv.n_sink, e.kv.n_recent = default_allocation(work.max_model_len)
    r = cfg.rollout
    r.mode, r.quota_groups, r.group_size = arm.mode, work.quota_groups, work.group_size
    r.max_slots = arm.slots or work.max_slots
    r.max_new_tokens, r.carry = work.max_len, "keep_kv" if arm.awake else "recompute"
    t = cfg.trainer
    t.iterations, t.micro_batch_size, t.grad_checkpointing, t.lr, t.warmup_iters = (
        bench.warmup_iterations + bench.iterations, bench.micro_batch_size, bench.grad_checkpointing, bench.lr, 0)
    t.max_tokens_per_micro_batch, t.attention = bench.max_tokens_per_micro_batch, bench.attention
    t.fuse_elementwise, t.offload, t.compile_layers = bench.fuse_elementwise, bench.offload, bench.compile_layers
    t.fused_logprobs, t.offload_optimizer = bench.fused_logprobs, bench.offload_optimizer
    try:
        cfg.validate()
        kv_format_from_config(e.kv).check(head_dim, work.max_model_len)
    except ValueError as exc:
        raise ValueError(f"--arms {arm.label}: {exc}") from None
    return cfg


def prepare(bench: IterationBench) -> dict[str, RunConfig]:
    """Check every option against the shape and device before anything is built; per arm its config.
    Raises ValueError naming the option."""
    work = bench.workload
    work.validate()
    if not bench.arms:
        raise ValueError("--arms is empty")
    resolved = [(a.kv, a.mode, a.weights, a.slots or work.max_slots, a.awake) for a in bench.arms]
    same = [a.label for a, key in zip(bench.arms, resolved) if resolved.count(key) > 1]
    if same:  # `bf16+sync` and `bf16+sync@128` under --max-slots 128: one arm timed twice under two names
        raise ValueError(f"--arms: {', '.join(same)} name one arm (--max-slots {work.max_slots})")
    if bench.iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {bench.iterations}")
    if bench.warmup_iterations < 1:
        raise ValueError(f"--warmup-iterations must be >= 1 (CUDA graphs and compilation), got "
                         f"{bench.warmup_iterations}")
    if bench.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {bench.micro_batch_size}")
    if bench.max_tokens_per_micro_batch is not None and bench.max_tokens_per_micro_batch < 1:
        raise ValueError(f"--max-tokens-per-micro-batch must be >= 1, got {bench.max_tokens_per_micro_batch}")
    if not bench.lr > 0:
        raise ValueError(f"--lr must be > 0, got {bench.lr}")
    for key, owner in (("engine.kv.format", "--arms"), ("engine.weight_format", "--arms"),
                       ("engine.max_model_len", "--prompt-len + --max-len"),
                       ("engine.sleep_between_rollouts", "--sleep/--no-sleep")):
        if key in bench.engine_keys:
            raise ValueError(f"{key} is set by {owner} here")
    try:
        args = qwen3_args(bench.shape)
    except ValueError as exc:
        raise ValueError(f"--shape: {exc}") from None
    if work.max_model_len > args.max_position_embeddings:
        raise ValueError(f"--prompt-len + --max-len = {work.max_model_len} exceeds the {bench.shape} context of "
                         f"{args.max_position_embeddings} tokens")
    if bench.offload_optimizer and bench.offload:
        raise ValueError("--offload-optimizer and --offload cannot be combined: --offload already keeps AdamW's "
                         "state (with the parameters and gradients) in CPU memory")
    device = resolve_device(bench.device)
    if bench.offload and device.type != "cuda":
        raise ValueError(f"--offload moves the learner's parameters, gradients and AdamW state to the CPU; on "
                         f"device {device} they already are there")
    if bench.offload_optimizer and device.type != "cuda":
        raise ValueError(f"--offload-optimizer streams AdamW's moments between pinned CPU memory and the GPU; on "
                         f"device {device} they already are in CPU memory")
    if bench.attention not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got '{bench.attention}'")
    if bench.attention == "flex" and device.type != "cuda":
        raise ValueError(f"--attention flex needs a CUDA device (FlexAttention has no backward pass on {device}); "
                         f"use --attention auto or sdpa")
    if bench.fused_logprobs and not kernels_usable(device):
        raise ValueError(f"--fused-logprobs runs Triton kernels, which need a CUDA device (and Triton); on device "
                         f"{device} use --no-fused-logprobs")
    return {arm.label: run_config(bench, arm) for arm in bench.arms}


class _IdTokenizer:
    """Decodes token ids to their decimal text (the reward reads them back); pads with id 0."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class _Formatter(BenchPrompts):
    """The `bench rollout` prompts (problem g -> fixed random ids), with the id tokenizer."""

    tokenizer = _IdTokenizer()


def odd_token_reward(texts: list[str], answers: list[str]) -> RewardResult:
    """The fraction of odd token ids in each response: deterministic, varies within a group."""
    scores = []
    for text in texts:
        ids = [int(t) for t in text.split()]
        scores.append(sum(i % 2 for i in ids) / max(len(ids), 1))
    return RewardResult(scores)


ProgressFn = Callable[[str], None]


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_arm(cfg: RunConfig, bench: IterationBench, model_dir: Path, progress: ProgressFn) -> dict:
    """Build the arm's learner and engine, run the warm-up iterations, time the rest; one result row."""
    from kv4rl.loop import Setup, run_iteration
    from kv4rl.run_setup import build_learner

    work, device = bench.workload, resolve_device(cfg.device)
    label = cfg.name.removeprefix("bench-")
    torch.manual_seed(cfg.seed)
    # each build is a progress line of its own: at the 8B shape with offload they take minutes
    progress(f"{label}: building the learner")
    learner = build_learner(cfg, model_dir, model_dir, device)
    progress(f"{label}: building the engine")
    engine_cfg = EngineConfig(**{f: getattr(cfg.engine, f) for f in EngineConfig.__slots__})
    # an awake engine keeps its pool through the update: it leaves the update's memory free (measured)
    reserve = 0 if engine_cfg.sleep_between_rollouts else learner.update_memory_bytes(work.max_model_len)
    engine = Engine(model_dir, engine_cfg, max_num_seqs=cfg.rollout.max_slots, device=device, dtype=cfg.model.dtype,
                    seed=cfg.seed, reserve_bytes=reserve)
    prompts = _Formatter(engine.args.vocab_size, work.prompt_len, work.seed)
    collector = Collector(engine, prompts, prompts, cfg.rollout, cfg.seed, max_tokens_fn=work.length)
    s = Setup(cfg, device, prompts, prompts, odd_token_reward, engine, learner, collector,
              RolloutPipeline(collector, cfg.staleness), 0)
    warm = bench.warmup_iterations
    for it in range(warm):
        progress(f"{label}: warm-up iteration" + (f" {it + 1}/{warm}" if warm > 1 else ""))
        run_iteration(s, it)
    preempted = engine.num_preemptions
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for it in range(1, bench.iterations + 1):
        progress(f"{label}: iteration {it}/{bench.iterations}")
        rows.append(run_iteration(s, warm + it - 1)[0])
    means = means_of(rows, label)
    row = {
        "arm": label, "kv_format": cfg.engine.kv.format, "mode": cfg.rollout.mode, "slots": cfg.rollout.max_slots,
        "sleeps": cfg.engine.sleep_between_rollouts, "carry": cfg.rollout.carry,
        "weights": "fp8" if cfg.engine.weight_format == "fp8" else str(engine.dtype).removeprefix("torch."),
        "seconds_per_iteration": means["time_total"],
        "phases": {p["phase"]: p["mean_s"] for p in rows_of(label, means)},
        "iteration_seconds": [r["time_total"] for r in rows],
        "iteration_seconds_stdev": statistics.stdev(r["time_total"] for r in rows) if len(rows) > 1 else 0.0,
        "tokens_per_iteration": statistics.fmean(r["response_len_mean"] * len(r["groups"]) * work.group_size
                                                 for r in rows),
        # over the iterations whose engine stepped (a partial batch handed over from earlier ones has none)
        "rollout_tokens_per_s": mean_known(r["tokens_per_s"] for r in rows),
        "preemptions": engine.num_preemptions - preempted,  # a sleep's or a refresh's recompute included
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "peak_memory_bytes": _peak(device),
        "pool_bytes_awake": engine.pool_bytes, "pool_tokens_awake": engine.pool_tokens,
        "update_reserve_bytes": reserve,
        "pool_sizing": engine.pool_sizing, "engine_summary": engine.summary,
    }
    del s, engine, learner, collector
    gc.collect()
    forget_compiled_graphs()  # the next arm's learner compiles its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_iteration(bench: IterationBench, configs: dict[str, RunConfig],
                    progress: ProgressFn | None = None, on_result: Callable[[dict], None] | None = None) -> dict:
    """Run every arm of a prepared benchmark; the JSON-ready result (speedups against the first arm).
    `on_result(summary)` after each arm, with the arms run so far (a time limit keeps what ran)."""
    progress = progress or (lambda what: None)
    device = resolve_device(bench.device)
    progress(f"random-init {bench.shape} folder (built once on {device.type}, then cached)")
    model_dir = random_model_dir(bench.shape, seed=bench.workload.seed, device=device)
    args = qwen3_args(bench.shape)
    rows = []

    def summary(complete: bool) -> dict:
        first = rows[0]["seconds_per_iteration"]
        for r in rows:
            r["speedup_vs_first"] = first / r["seconds_per_iteration"]
            # a partial arm meets its quota with the groups that finish first and carries the long ones, so
            # it can train on fewer tokens per iteration than a sync arm: the speedup in tokens too
            r["trained_tokens_per_s"] = r["tokens_per_iteration"] / r["seconds_per_iteration"]
            r["trained_tokens_per_s_vs_first"] = r["trained_tokens_per_s"] / rows[0]["trained_tokens_per_s"]
        return {
            "model": bench.shape,
            "model_shape": {"layers": args.num_layers, "hidden": args.hidden_size, "kv_heads": args.num_kv_heads,
                            "head_dim": args.head_dim, "vocab": args.vocab_size},
            "device": str(device), "engine_dtype": str(resolve_dtype("auto", device)).removeprefix("torch."),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "workload": asdict(bench.workload), "iterations": bench.iterations,
            "warmup_iterations": bench.warmup_iterations, "sleep": bench.sleep,
            "micro_batch_size": bench.micro_batch_size, "grad_checkpointing": bench.grad_checkpointing,
            "offload": bench.offload, "offload_optimizer": bench.offload_optimizer,
            "max_tokens_per_micro_batch": bench.max_tokens_per_micro_batch, "attention": bench.attention,
            "fuse_elementwise": (fuses_by_default(device) if bench.fuse_elementwise is None
                                 else bench.fuse_elementwise),
            "compile_layers": compiles_by_default(device) if bench.compile_layers is None else bench.compile_layers,
            "fused_logprobs": (fused_logprobs_by_default(device) if bench.fused_logprobs is None
                               else bench.fused_logprobs),
            "phases": [p.removeprefix("time_") for p in PHASES] + ["other"],
            "complete": complete, "results": rows,
        }

    for arm in bench.arms:
        cfg = configs[arm.label]
        cfg.model.path = str(model_dir)
        try:
            rows.append(run_arm(cfg, bench, model_dir, progress))
        except ValueError as exc:  # e.g. an awake arm whose pool and the learner's update do not fit the device
            raise ValueError(f"arm {arm.label}: {exc}") from None
        if on_result is not None:
            on_result(summary(complete=False))
    return summary(complete=True)


def figure_rows(res: dict) -> list[dict]:
    """The CSV rows behind the figure, in `plot iteration-time`'s form: one per (arm, phase)."""
    return [{"run": r["arm"], "phase": phase, "mean_s": r["phases"][phase],
             "share": r["phases"][phase] / r["seconds_per_iteration"] if r["seconds_per_iteration"] else 0.0,
             "iterations": res["iterations"]}
            for r in res["results"] for phase in res["phases"]]

