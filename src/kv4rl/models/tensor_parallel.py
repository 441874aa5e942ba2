"""Tensor parallelism for the engine's decoder: each rank holds a slice of the heads and of the MLP.

Megatron's layout, written for this decoder: q/k/v and gate/up projections are split by output rows
(each rank owns `num_heads / tp` query heads, `num_kv_heads / tp` KV heads and `intermediate / tp` MLP
columns); o_proj and down_proj are split by input columns and their partial outputs are summed with
one all-reduce each per layer. Embedding, norms and the output head are replicated, so every rank
ends a step with the same logits and, with the engine's counter-based sampling, the same tokens: the
scheduler and the KV pool (of the rank's own KV heads, in any format) run unchanged on every rank.

A sharded model keeps the Hugging Face names: `shard_targets` turns each local parameter into a
`CheckpointSlot` of the full checkpoint shape that stores this rank's slice, so loading a folder or a
learner's full `state_dict()` needs nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv4rl.models.args import ModelArgs
from kv4rl.models.checkpoint_slots import CheckpointSlot, store

# Split by output rows (dim 0 of weight and bias) and by input columns (dim 1 of the weight).
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_LAYER_PARAM = re.compile(r"^model\.layers\.\d+\.(?P<module>[\w.]+)\.(?P<param>weight|bias)$")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (`size` ranks; `group=None`: the default group)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs in place (the result is the same on every rank)."""
        dist.all_reduce(x, group=self.group)
        return x


def check_shardable(args: ModelArgs, size: int) -> None:
    """Raise ValueError naming the first dimension that `size` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"engine.tensor_parallel must be >= 1, got {size}")
    for what, value in (("attention heads", args.num_heads), ("KV heads", args.num_kv_heads),
                        ("MLP intermediate size", args.intermediate_size)):
        if value % size:
            raise ValueError(f"engine.tensor_parallel={size} does not divide the model's {value} {what}")


def shard_args(args: ModelArgs, size: int) -> ModelArgs:
    """The shape one rank builds: its share of the heads and of the MLP."""
    check_shardable(args, size)
    return dataclasses.replace(args, num_heads=args.num_heads // size, num_kv_heads=args.num_kv_heads // size,
                               intermediate_size=args.intermediate_size // size)


def split_rule(name: str) -> tuple[str, int] | None:
    """('column' | 'row', dim) for a sharded checkpoint name, None for a replicated one."""
    match = _LAYER_PARAM.match(name)
    if match is None:
        return None
    module, param = match["module"], match["param"]
    if module in COLUMN_PARALLEL:
        return "column", 0
    if module in ROW_PARALLEL:
        return "row", 1 if param == "weight" else -1  # -1: a row-parallel bias is added once, on rank 0
    return None


def shard_targets(targets: dict, tp: TensorParallel) -> dict:
    """Wrap each sharded local target in a slot of the full checkpoint shape that stores its slice."""
    def slot(local, kind: str, dim: int):
        shape = list(local.shape)
        if dim >= 0:
            shape[dim] *= tp.size

        def load(full: torch.Tensor) -> None:
            if dim < 0:  # replicated bias of a row-parallel linear: rank 0 adds it, the others add zero
                store(local, full if tp.rank == 0 else torch.zeros_like(full))
            else:
                store(local, full.chunk(tp.size, dim)[tp.rank])

        return CheckpointSlot(tuple(shape), load)

    out = {}
    for name, target in targets.items():
        rule = split_rule(name)
        out[name] = target if rule is None else slot(target, *rule)
    return out


def tensor_parallel_group(size: int) -> TensorParallel:
    """This rank's tensor-parallel group: consecutive blocks of `size` ranks (DP x TP layouts).

    Every rank creates every block's group, in the same order, as torch.distributed requires.
    """
    if size == 1:
        return TensorParallel(0, 1, None)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:  # no process group, or the learner's own one-process group
        raise ValueError(f"engine.tensor_parallel={size} needs {size} processes of torch.distributed: start with "
                         f"`torchrun --nproc-per-node {size} -m kv4rl.cli ...`")
    rank = dist.get_rank()
    if world % size:
        raise ValueError(f"engine.tensor_parallel={size} does not divide the world size {world}")
    key = ("tp", size)
    if key not in _GROUPS:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        _GROUPS[key] = groups
    return TensorParallel(rank % size, size, _GROUPS[key][rank // size])


_GROUPS: dict[tuple, list] = {}
