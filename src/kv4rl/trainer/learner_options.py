"""The learner's options: refused where they cannot run (before any model is loaded), their `null`
defaults, and how the start line names them. Kept apart from `kv4rl.trainer.learner` so the checks
that `kv4rl train`, `kv4rl bench` and split runs make up front do not need the learner itself."""

from __future__ import annotations

import torch

from kv4rl.kernels import kernels_usable
from kv4rl.trainer.attention import check_attention


def check_learner_options(device: torch.device, *, fsdp: bool, offload: bool, attention: str = "auto",
                          fused_logprobs: bool | None = None, offload_optimizer: bool = False) -> None:
    """Refuse option combinations that cannot run, before any model is loaded."""
    check_attention(attention, device)
    if fused_logprobs and not kernels_usable(device):
        raise ValueError(f"trainer.fused_logprobs=true runs Triton kernels, which need a CUDA device (and "
                         f"Triton); on device {device}: set trainer.fused_logprobs=false")
    if offload and not fsdp:
        raise ValueError("trainer.offload=true needs trainer.fsdp=true (offloading is FSDP2's CPUOffloadPolicy)")
    if offload and device.type != "cuda":
        raise ValueError(f"trainer.offload=true moves parameters, gradients and AdamW state from the GPU to "
                         f"the CPU; on device {device} they already are there: set trainer.offload=false")
    if offload_optimizer and offload:
        raise ValueError("trainer.offload_optimizer=true cannot be combined with trainer.offload=true, which "
                         "already keeps AdamW's state (with the parameters and gradients) in CPU memory; set one "
                         "of them")
    if offload_optimizer and device.type != "cuda":
        raise ValueError(f"trainer.offload_optimizer=true streams AdamW's moments between pinned CPU memory and "
                         f"the GPU; on device {device} they already are in CPU memory: set "
                         f"trainer.offload_optimizer=false")


def fused_logprobs_by_default(device: torch.device) -> bool:
    """`trainer.fused_logprobs: null`: on CUDA where the Triton kernels can run (1.24x per compiled 1.7B
    learner step on an H200), never on the CPU (the interpreter could run them, slowly)."""
    return device.type == "cuda" and kernels_usable(device)


def describe_options(device: torch.device, *, fused_elementwise: bool, compiled_layers: int, fused_logprobs: bool,
                     offload: bool, offload_optimizer: bool) -> str:
    """The resolved speed options and where AdamW's state lives, in one phrase."""
    if offload:
        state = "AdamW state in CPU memory with the weights (trainer.offload)"
    elif offload_optimizer:
        state = "AdamW moments in pinned CPU memory (trainer.offload_optimizer)"
    else:
        state = f"AdamW state on {device.type}"
    return (f"fused elementwise {'on' if fused_elementwise else 'off'}, compiled layers {compiled_layers or 'off'}, "
            f"log-prob head {'triton' if fused_logprobs else 'torch'}, {state}")
