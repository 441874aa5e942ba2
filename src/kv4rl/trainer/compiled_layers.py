"""`trainer.compile_layers`: every decoder layer of the learner's model as one `torch.compile` region.

`trainer.fuse_elementwise` fuses the norms and SwiGLU products, yet the fused 1.7B learner step still
spends 459 ms in copies and casts and 295 ms in unfused elementwise ops of the 2,270 ms its GPU is
busy (bench/RESULTS.md): RoPE (`rotate_half`'s slices, negation and `cat`), residual adds, the
transposes around attention, dtype casts. Compiling each whole layer, as torchtitan compiles each
transformer block, lets inductor fuse all of them, forward and backward, around the GEMMs and the
attention kernel. The layers are compiled in place (`nn.Module.compile`), so parameter names, state
dicts, checkpoints and the weight refresh see the same module tree, and before FSDP2 wraps them, whose
hooks stay outside the compiled code. The layers share one graph (torch inlines module parameters as
inputs). `dynamic=None`, dynamo's automatic dynamic shapes: a dimension turns symbolic once a new
micro-batch length changes it, so after a recompile or two every length reuses the graphs. Not
`dynamic=True`: with every dimension symbolic, inductor's FlexAttention lowering on CUDA could not decide
the head ratio (`64 // s19`) and failed (H200, 2026-12-02). 1.18-1.19x per fused 1.7B learner step
there (bench/RESULTS.md, sixth session).

Every model's layers run one code object, whose automatic dynamic shapes remember sizes across models.
Dynamo specialises an unwrapped layer's int attributes, but not an FSDP2-managed one's
(`torch._dynamo.config.skip_fsdp_guards`, on by default): once a second model of another shape compiled
(the GPU suite in one process; two learners in one run), `self_attn.head_dim` became a graph input `s19`, and
the same FlexAttention lowering failed on `64 // s19` heads (H200, torch 2.11). `compile_layers` turns that
setting off, process-wide, so those ints are guarded constants as without FSDP: a model of a new shape
compiles graphs of its own and only the sequence turns symbolic (the inputs' hidden size and head_dim
become symbols that the static weight shapes pin at once).
"""

from __future__ import annotations

import torch
from torch import nn

BACKEND = "inductor"  # tests on the CPU may swap in "aot_eager" (same graphs, no code generation)
# Graphs dynamo may compile for the decoder layers' one `forward` before it runs it eagerly (its default,
# `recompile_limit`, is 8). A learner needs up to ~8: the policy with and without grad, the reference
# (another dtype, no grad), each for its first length and then for any length, and again for a packed
# micro-batch of one block (dynamo specialises a size of 1). Past the limit an eager recompute of a compiled
# forward fails torch.utils.checkpoint's check ("Recomputed values ... have different metadata").
GRAPHS_PER_LAYER_CODE = 32


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the members of the model's `ModuleList`s whose class ends in DecoderLayer."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList)
            for m in lst if type(m).__name__.endswith("DecoderLayer")]


def compiles_by_default(device: torch.device) -> bool:
    """`trainer.compile_layers: null`: on CUDA (1.19x per fused 1.7B learner step on an H200), never on
    the CPU, where inductor's compile time costs more than it saves."""
    return device.type == "cuda"


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer of `model` in place (before FSDP2 wraps it); how many were compiled.
    Raises ValueError naming the model if it has none this recognises."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.compile_layers: {type(model).__name__} has no ...DecoderLayer modules in a "
                         "ModuleList to compile; set it to false")
    # every layer runs one code object, whose graphs dynamo counts together: see GRAPHS_PER_LAYER_CODE
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_LAYER_CODE)
    # FSDP2-managed layers' int attributes (`head_dim`, ...) specialised and guarded like an unwrapped layer's, not
    # left to automatic dynamic shapes: see the module docstring
    torch._dynamo.config.skip_fsdp_guards = False
    # transformers >= 5.25 with its `kernels` package routes RoPE through a context variable that an attention
    # forward sets and resets: under activation checkpointing dynamo refused that side effect and compiled
    # nothing (no error: the layers silently ran eager). Not replaying it in the backward's recompute is
    # harmless, the value is restored as the forward returns
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # older torch: no such flag
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=None)
    return len(layers)


def forget_compiled_graphs() -> None:
    """Drop every compiled graph (`torch._dynamo.reset`) once a learner is gone: a benchmark building one
    learner per arm otherwise keeps the last arm's graphs, which guard on modules that no longer exist,
    fail on every call and count against the recompile limit (a second 4B arm's first update failed that
    way on the H200, 2026-12-02)."""
    torch._dynamo.reset()
