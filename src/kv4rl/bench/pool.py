"""`kv4rl bench pool`: how many tokens the KV pool holds in a memory budget, per KV format.

Counted with the engine's own sizing arithmetic (`kv4rl.engine.memory`): each format's bytes come from
its real `allocate` on the meta device, and KV4's INT8 rows for `max_num_seqs` running sequences are
reserved before pages are counted, exactly as the engine sizes its pool. Unlike the engine it neither
caps the pool at what `max_num_seqs` sequences of `context` tokens can use (the capacity is the point)
nor refuses a budget without one such sequence: `sequences_at_context` says how many fit, and 0 means an
engine with that budget would refuse to start. Pure arithmetic: runs on CPU.
"""

from __future__ import annotations

import copy

from kv4rl.bench.random_model import qwen3_args
from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.config import KVConfig
from kv4rl.engine.kv_formats import kv_format_from_config
from kv4rl.engine.memory import GIB, kv_footprint

REFERENCE = "bf16"


def bench_pool(shape: str, *, memory_gib: float, formats: list[str], max_num_seqs: int = 256,
               context: int = 8192, kv: KVConfig | None = None) -> dict:
    """Pool capacity of each format in `memory_gib`; `kv` gives the other `engine.kv` settings."""
    if memory_gib <= 0:
        raise ValueError(f"--memory-gib must be > 0, got {memory_gib}")
    if max_num_seqs < 1 or context < 1:
        raise ValueError("--max-num-seqs and --context must be >= 1")
    args = qwen3_args(shape)
    kv = kv or KVConfig()
    budget = int(memory_gib * GIB)

    def measure(name: str) -> dict:
        cfg = copy.deepcopy(kv)
        cfg.format = name
        cfg.validate()
        fmt = kv_format_from_config(cfg)
        fmt.check(args.head_dim, context)
        fp = kv_footprint(fmt, args.num_layers, args.num_kv_heads, args.head_dim, cfg.block_size)
        blocks = fp.blocks_in(budget, max_num_seqs)
        if blocks < 1:
            reserved = fp.total_bytes(0, max_num_seqs)
            raise ValueError(f"{name}: {memory_gib} GiB holds no block ({fp.block_bytes / 2**20:.2f} MiB)"
                             + (f" after the rows reserved for {max_num_seqs} sequences ({reserved / GIB:.2f} GiB)"
                                if reserved else ""))
        return {
            "format": name,
            "blocks": blocks,
            "tokens": blocks * cfg.block_size,
            "bytes_per_token": fp.block_bytes / cfg.block_size,
            "reserve_bytes": fp.total_bytes(0, max_num_seqs),
            "bytes_per_token_at_context": fp.bytes_per_token(context),
            "sequences_at_context": min(max_num_seqs, blocks // blocks_needed(context, cfg.block_size)),
            "rotate": fmt.rotate,
        }

    try:
        reference = measure(REFERENCE)
    except ValueError:
        if REFERENCE in formats:
            raise
        reference = None  # the budget holds no BF16 block: the formats asked for are not compared to it
    results = []
    for name in formats:
        row = reference if name == REFERENCE else measure(name)
        results.append({**row, "tokens_vs_bf16": row["tokens"] / reference["tokens"] if reference else None})
    return {
        "shape": shape,
        "model_shape": {"layers": args.num_layers, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim},
        "memory_gib": memory_gib,
        "budget_bytes": budget,
        "max_num_seqs": max_num_seqs,
        "context": context,
        "kv": {"block_size": kv.block_size, "group_size": kv.group_size, "n_sink": kv.n_sink,
               "n_recent": kv.n_recent},
        "results": results,
    }
