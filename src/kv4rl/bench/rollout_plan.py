"""`kv4rl bench rollout`'s plan: its options, checked against the model and device, and each format's
pool sized, before anything is built (`prepare`), so a bad option fails in a moment instead of after
minutes of benchmarking. `kv4rl.bench.rollout` runs the plan; `bench iteration` shares its workload.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kv4rl.bench.fidelity import default_allocation
from kv4rl.bench.random_model import qwen3_args
from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config
from kv4rl.engine.memory import GIB, KVFootprint, format_bytes, kv_footprint
from kv4rl.engine.placement import resolve_device
from kv4rl.models.args import ModelArgs

MODES = ("sync", "partial")


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
    return read_model_args(model_dir(bench))


def model_dir(bench: RolloutBench) -> Path:
    """The model folder `--model` names, or the cached tiny model (built on first use)."""
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
        raise ValueError(f"--kv-budget-gib {gib:g}: {fmt} needs {need:.3g} GiB for one sequence of "
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
    resolved = list(entries.values())
    same = [label for label, entry in entries.items() if resolved.count(entry) > 1]
    if same:  # `kv4` and `kv4@16` under --max-slots 16: one pool timed twice under two names
        raise ValueError(f"--formats: {', '.join(same)} name one format at one number of slots (--max-slots "
                         f"{work.max_slots})")
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
