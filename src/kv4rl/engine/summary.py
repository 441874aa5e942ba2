"""The engine's start line: what its plan decided (KV format, pool, weights, attention path, sampler,
options), logged once and kept as `Engine.summary` for benchmark JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv4rl.engine import memory

if TYPE_CHECKING:
    from kv4rl.engine.llm import Engine


def engine_summary(engine: Engine, max_num_seqs: int) -> str:
    plan, block_size, args, tp = engine.plan, engine.config.kv.block_size, engine.args, engine.tp
    fast = engine.runner.fast
    in_rope = engine.fused_ops and fast is not None and fast.rotates_qk  # q and k rotated by the fused RoPE
    return (
        f"engine: kv format {plan.kv_format_name.value} (rotate {engine.kv_format.rotate}"
        f"{', in the RoPE kernel' if in_rope else ''}), "
        f"{engine.bytes_per_token:.1f} bytes/token at context {engine.max_model_len}, pool {engine.pool_tokens} tokens "
        f"({engine.runner.num_blocks} blocks x {block_size}) for up to {max_num_seqs} sequences, "
        f"{memory.format_bytes(engine.pool_bytes)} (sized by {engine.pool_sizing}), {plan.weights_desc}, "
        f"{plan.attention_desc}, sampler {engine.sampler}{', fused ops' if engine.fused_ops else ''}"
        f"{', merged q|k|v and gate|up projections' if plan.merge_projections.value else ''}"
        f"{', async scheduling' if engine.async_scheduling else ''}"
        + (f", tensor parallel {tp.size} (rank {tp.rank}: {args.num_heads} heads, "
           f"{args.num_kv_heads} KV heads; pool and bytes/token are per rank)" if tp.size > 1 else "")
        + (f"; sleeps between rollouts: KV pool {memory.format_bytes(engine.pool_bytes)} awake, 0 asleep"
           if engine.config.sleep_between_rollouts else "")
    )
