"""The KV pool sized from device memory: what is left of `engine.gpu_memory_fraction` once the largest
step has run on dummy tokens (CUDA), the smallest over the tensor-parallel ranks. `ModelRunner.build`
sizes its pool with it at start-up and again at each wake of a sleeping engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv4rl.engine import memory
from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.plan import EnginePlan
from kv4rl.engine.sampler import sample

if TYPE_CHECKING:
    from kv4rl.engine.fast_path import FastAttention

CAPPED = " (capped at max_num_seqs x max_model_len)"


def memory_sized(profile: PoolProfile, model, device: torch.device) -> tuple[int, str]:
    """The profiled pool's blocks and how they were chosen; under tensor parallelism the smallest over
    the ranks, since every shard's scheduler must see the same pool."""
    num_blocks, sizing = profile.pool_blocks()
    if model.tp is not None:
        smallest = smallest_over(model.tp, num_blocks, device)
        if smallest < num_blocks:  # this rank's cap is not the pool: another rank has less room
            sizing = sizing.replace(CAPPED, "")
        num_blocks, sizing = smallest, sizing + ", smallest over the TP ranks"
    return num_blocks, sizing


def smallest_over(tp, num_blocks: int, device: torch.device) -> int:
    import torch.distributed as dist

    count = torch.tensor([num_blocks], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.group)
    return int(count.item())


class PoolProfile:
    """The pool size that fits in device memory, measured by running the largest step (CUDA)."""

    def __init__(self, model, plan: EnginePlan, config: EngineConfig, device: torch.device,
                 fast: FastAttention | None, reserve_bytes: int = 0):
        self.model, self.plan, self.config, self.device, self.fast = model, plan, config, device, fast
        self.reserve_bytes = reserve_bytes  # left free for a learner's update beside an awake engine
        self.activation: int | None = None  # the largest step's peak, measured once

    def pool_blocks(self) -> tuple[int, str]:
        """The pool's blocks and how they were chosen: what is left of `engine.gpu_memory_fraction`
        after the memory in use, the largest step's peak and the reserve (see `kv4rl.engine.memory`). Called again
        at each wake of a sleeping engine; the peak is measured only the first time."""
        cfg, plan, args = self.config, self.plan, self.model.args
        max_num_seqs, max_model_len, block_size = plan.max_num_seqs, plan.max_model_len.value, cfg.kv.block_size
        footprint = memory.kv_footprint(plan.kv_format, args.num_layers, args.num_kv_heads, args.head_dim, block_size)
        if self.activation is None:
            self.activation = memory.measure_step_peak(lambda: self.step(max_num_seqs), self.device)
        activation = self.activation
        graphs = memory.graph_output_bytes(max_num_seqs if plan.cuda_graphs.value else 0,
                                           plan.prefill_graphs.value if plan.cuda_graphs.value else 0, args.vocab_size)
        total, used = memory.in_use_bytes(self.device, cfg.gpu_memory_scope)
        blocks = memory.pool_blocks(
            total_bytes=total, fraction=cfg.gpu_memory_fraction, used_bytes=used, activation_bytes=activation + graphs,
            footprint=footprint, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            reserve_bytes=self.reserve_bytes)
        capped = CAPPED if blocks == max_num_seqs * blocks_needed(max_model_len, block_size) else ""
        return blocks, (
            f"engine.gpu_memory_fraction={cfg.gpu_memory_fraction:g} of {memory.format_bytes(total)}: "
            f"{memory.format_bytes(used)} in use{' by this process' if cfg.gpu_memory_scope == 'process' else ''}, "
            f"{memory.format_bytes(activation)} step peak"
            + (f", {memory.format_bytes(graphs)} CUDA graph outputs" if graphs else "")
            + (f", {memory.format_bytes(self.reserve_bytes)} reserved for the learner's update" if self.reserve_bytes
               else "") + capped
        )

    @torch.inference_mode()
    def step(self, max_num_seqs: int) -> None:
        """The largest step's work on dummy tokens and a one-block cache: its prefill, then sampling
        for `max_num_seqs` rows with top-k, top-p and min-p on (their sorts are the sampler's peak)."""
        block_size, max_model_len = self.config.kv.block_size, self.plan.max_model_len.value
        from kv4rl.engine.runner import ModelRunner  # it sizes its pool with this class

        seqs = memory.profile_batch(self.config.max_num_batched_tokens, max_model_len, max_num_seqs, block_size,
                                    chunked=self.config.chunked_prefill)
        ModelRunner(self.model, self.plan.kv_format, 1, block_size, self.device, fast=self.fast,
                    max_model_len=max_model_len, fast_prefill=self.plan.prefill.value == "triton").forward(seqs)
        rows = {"size": (max_num_seqs,), "device": self.device}
        sample(torch.zeros(max_num_seqs, self.model.args.vocab_size, device=self.device),
               torch.ones(**rows), torch.ones(**rows, dtype=torch.long), torch.full(fill_value=0.5, **rows),
               torch.zeros(**rows, dtype=torch.long), torch.zeros(**rows, dtype=torch.long),
               min_p=torch.full(fill_value=0.5, **rows))
